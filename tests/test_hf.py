"""Hugging Face models through the real entry point: ``examples/hf_llama.py`` (a ``transformers`` Llama with an offline
byte-level tokenizer), bf16 autocast on the CPU, pretrained weights, and the export's Hugging Face directory.

- the example in bf16 (``examples/hf_llama-quick.json``), SIGTERMed mid-run (a real signal), exits 75, resumes and
  ends bitwise equal to an uninterrupted run; the precision is in plan.json and the contract (another one: exit 2);
- ``verify`` (with the objective check) exits 0, and its export's reload check loads the Hugging Face directory with
  ``from_pretrained`` in a process that cannot import trainproof and reproduces the recorded metric;
- ``export`` with small shards writes ``model-0000i-of-0000N.safetensors`` and the index; in an interpreter whose
  import path holds only transformers and its dependencies (no trainproof), ``from_pretrained`` loads it,
  ``hf_eval.py`` reproduces the bundle's metric exactly and ``AutoTokenizer`` loads the tokenizer;
- pretrained weights: a fresh start loads the declared file (local and ``s3://``), a resume never reads it again,
  another file is another contract (exit 2), a flipped byte is refused by name (exit 1: the file can be put back).

Nothing touches the network: ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support.timing import budget
from tests.test_bundle_standalone import link_site
from tests.test_examples import readme_commands
from tests.test_train_helpers import differences, finish, load_state, run, start, stopped_after_step

pytest.importorskip("transformers")  # the optional extra `[hf]`; the test extras install it

ROOT = Path(__file__).resolve().parent.parent
HF = "examples.hf_llama:factory"
QUICK = ROOT / "examples" / "hf_llama-quick.json"  # bf16 autocast; 4 steps an epoch
STEPS = 12
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _job(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    from tests.test_train_helpers import train_env

    return subprocess.run([sys.executable, "-m", "trainproof", *args], cwd=ROOT, env=train_env({**OFFLINE, **(env or {})}),
                          text=True, capture_output=True, timeout=timeout)


def _without_invocation(state: dict) -> dict:
    return {**state, "meta": {k: v for k, v in state["meta"].items() if k != "trainer"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> SimpleNamespace:
    """An uninterrupted bf16 run, one SIGTERMed after step 2 and resumed, and the resumed run exported with shards of
    0.05 MB (the model is ~120 kB)."""
    tmp = tmp_path_factory.mktemp("hf")
    args = ("--task", HF, "--config", str(QUICK), "--max-steps", str(STEPS))
    reference = start(tmp / "ref", *args, env=OFFLINE)
    stopped = stopped_after_step(tmp / "cut", *args, step=2, env=OFFLINE)
    resumed = run(tmp / "cut", *args, env=OFFLINE)
    ref = finish(reference, timeout=budget(300))
    exported = _job("export", "--store", str(tmp / "cut"), "--task", HF, env={"TRAINPROOF_HF_SHARD_MB": "0.05"})
    return SimpleNamespace(tmp=tmp, ref=ref, stopped=stopped, resumed=resumed, exported=exported,
                           bundle=tmp / "cut" / "exports" / f"step-{STEPS:08d}",
                           hf=tmp / "cut" / "exports" / "hf" / f"step-{STEPS:08d}")


def test_the_hf_example_in_bf16_stops_on_sigterm_with_75_and_resumes_bitwise(runs):
    assert runs.stopped.code == 75, runs.stopped.stderr[-2000:]
    cut = runs.stopped.last("stopped")["step"]
    assert runs.stopped.last("stopped")["reason"] == "signal" and 2 <= cut < STEPS
    assert (runs.ref.code, runs.resumed.code) == (0, 0), runs.ref.stderr[-2000:] + runs.resumed.stderr[-2000:]
    assert runs.resumed.last("resume")["step"] == cut and runs.resumed.last("resume")["rng_restored"] is True
    expected, got = load_state(runs.tmp / "ref"), load_state(runs.tmp / "cut")
    assert got["progress"]["step"] == STEPS and got["ranks"][0]["data"]["epoch"] == 2  # crossed two epoch boundaries
    assert differences(_without_invocation(expected), _without_invocation(got)) == []
    # bf16 autocast, no GradScaler, recorded in the state and in plan.json's contract fields
    assert (got["meta"]["autocast"], got["meta"]["amp"]) == ("bfloat16", True)
    assert not got["scaler"] or got["scaler"].get("scale") is None
    plan = json.loads((runs.tmp / "cut" / "plan.json").read_text())
    assert plan["precision"] == "bf16"


@pytest.mark.slow  # the contract test in tests/test_pretrained.py names the field in process
def test_another_precision_is_another_experiment(runs, tmp_path):
    config = tmp_path / "fp32.json"
    config.write_text(json.dumps({**json.loads(QUICK.read_text()), "precision": "fp32"}))
    result = run(runs.tmp / "cut", "--task", HF, "--config", str(config), "--max-steps", str(STEPS + 2), env=OFFLINE)
    assert result.code == 2, result.stderr[-2000:]
    assert "task_config.precision (stored 'bf16', now 'fp32')" in result.stderr and "precision" in result.stderr


def test_the_export_holds_a_sharded_hf_directory_the_bundle_vouches_for(runs):
    assert runs.exported.returncode == 0, runs.exported.stderr[-3000:]
    files = sorted(p.name for p in runs.hf.iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "COMPLETE.json"} <= set(files)
    index = json.loads((runs.hf / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    config = json.loads((runs.bundle / "config.json").read_text())
    listed = config["hf"]["files"]
    assert set(listed) == set(files) - {"COMPLETE.json"}
    assert all(hashlib.sha256((runs.hf / n).read_bytes()).hexdigest() == sha for n, sha in listed.items())
    record = json.loads((runs.tmp / "cut" / "exports" / f"step-{STEPS:08d}.reload-check.json").read_text())
    check = record["checks"]["hf_from_pretrained"]
    assert record["passed"] and check["passed"] and check["abs_diff"] == 0.0 and check["trainproof_importable"] == []
    metrics = json.loads((runs.bundle / "metrics.json").read_text())
    assert metrics["hf"]["value"] == metrics["eval"]["value"] and metrics["hf"]["equals_eval"] is True
    readme = (runs.bundle / "README.md").read_text()
    assert f'from_pretrained("../hf/step-{STEPS:08d}")' in readme and readme.count("```python") == 1
    assert config["standalone"]["program"] == "not needed: the Hugging Face directory rebuilds it"


@pytest.fixture(scope="module")
def transformers_only_site(tmp_path_factory) -> Path:
    """A folder of links to transformers, torch, safetensors and their dependencies only (no trainproof)."""
    site = link_site(tmp_path_factory.mktemp("transformers-only-site"), "transformers", "torch", "safetensors",
                     "tokenizers")
    assert not {"trainproof", "examples"} & {p.name for p in site.iterdir()}
    return site


CONSUMER = """
import importlib.util, json, runpy, sys
sys.path.insert(1, {site!r})
print("TRAINPROOF-REACHABLE", [m for m in ("trainproof", "tests", "examples") if importlib.util.find_spec(m)])
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained("hf")
ids = tokenizer("héllo, wörld", add_special_tokens=False)["input_ids"]
print("TOKENS-ARE-BYTES", ids == list("héllo, wörld".encode()), tokenizer.decode(ids) == "héllo, wörld")
sys.argv = ["hf_eval.py", "hf"]
runpy.run_path("bundle/hf_eval.py", run_name="__main__")
"""


def test_from_pretrained_in_an_interpreter_without_trainproof_reproduces_the_metric(runs, tmp_path,
                                                                                   transformers_only_site):
    """A consumer's copy of the directory and the bundle, in ``python -S -E -s`` whose import path is the copy, the
    standard library and the transformers-only site: ``AutoModelForCausalLM.from_pretrained`` loads the sharded
    directory and the bundle's ``hf_eval.py`` reproduces metrics.json's metric exactly."""
    assert runs.exported.returncode == 0, runs.exported.stderr[-3000:]
    consumer = tmp_path / "consumer"
    shutil.copytree(runs.hf, consumer / "hf")
    shutil.copytree(runs.bundle, consumer / "bundle")
    shutil.copy(runs.bundle / "metrics.json", consumer / "metrics.json")
    shutil.copy(runs.bundle / "hf_eval_data.safetensors", consumer / "hf_eval_data.safetensors")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(consumer), **OFFLINE}
    result = subprocess.run([sys.executable, "-S", "-E", "-s", "-c", CONSUMER.format(site=str(transformers_only_site))],
                            cwd=consumer, env=env, capture_output=True, text=True, timeout=budget(300))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "TRAINPROOF-REACHABLE []", lines[0]
    assert "TOKENS-ARE-BYTES True True" in lines, lines
    printed = json.loads(lines[-1])
    metrics = json.loads((runs.bundle / "metrics.json").read_text())
    assert printed["hf_eval"] == metrics["eval"]["value"] == printed["recorded"], (printed, metrics["eval"])


def test_the_readme_hf_block_runs_as_written_verify_passes_and_the_export_reloads_with_from_pretrained(tmp_path):
    """README's block (train, verify with the objective check, export) in one bash script from the repository root,
    with ``bash scripts/dev.sh`` replaced by the console script it execs, the run folder moved into tmp_path and 100
    steps cut to 12. The export's and the verifier's reload checks load the Hugging Face directory with from_pretrained
    in a process that cannot import trainproof and reproduce the recorded metric."""
    trainproof = Path(sys.executable).parent / "trainproof"
    store = tmp_path / "llama"
    lines = readme_commands("### Hugging Face models")
    assert [line.split()[2] for line in lines] == ["train", "verify", "export"], lines
    script = "\n".join(line.replace("bash scripts/dev.sh ", f"{shlex.quote(str(trainproof))} ")
                        .replace("./runs/llama", shlex.quote(str(store))).replace("--max-steps 100", "--max-steps 12")
                        for line in lines)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_") and k != "PYTHONPATH"}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, text=True, capture_output=True,
                            env={**env, "TRAINPROOF_LOG_FORMAT": "json"}, timeout=budget(900))
    assert result.returncode == 0, f"{script}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert load_state(store)["progress"]["step"] == 12
    (vid,) = [p.name for p in (store / "verification").iterdir() if p.is_dir()]
    report = json.loads((store / "verification" / vid / "verification.json").read_text())
    assert report["all_checks_passed"] and report["failing_checks"] == []
    assert report["objective_equivalence_passed"] and report["objective_negative_detected"]
    assert report["environment"]["precision"] == "float32 + bfloat16 autocast"  # the quick configuration's bf16
    check = report["export"]["reload_check"]["checks"]["hf_from_pretrained"]
    assert check["passed"] and check["architecture"] == "LlamaForCausalLM" and check["abs_diff"] == 0.0
    record = json.loads((store / "exports" / "step-00000012.reload-check.json").read_text())
    check = record["checks"]["hf_from_pretrained"]
    assert record["passed"] and check["passed"] and check["trainproof_importable"] == []
    assert check["reloaded"] == record["recorded"]  # the task's own held-out loss, from the directory's model
    assert (store / "exports" / "hf" / "step-00000012" / "model.safetensors").is_file()


# -- pretrained weights -------------------------------------------------------------------------------------
def _config(tmp: Path, name: str, **settings) -> str:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({**json.loads(QUICK.read_text()), **settings}))
    return str(path)


def _first_loss(result) -> float:
    return next(e["loss"] for e in result.events if e["event"] == "step")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pretrained_weights_start_a_run_and_a_resume_never_reads_them_again(runs, tmp_path):
    assert runs.exported.returncode == 0, runs.exported.stderr[-3000:]
    weights = tmp_path / "w.safetensors"
    shutil.copy(runs.bundle / "model.safetensors", weights)  # the trained model's tensors, by the model's names
    config = _config(tmp_path, "init", init_from=str(weights), init_sha256=_sha(weights))
    store = tmp_path / "run"
    first = run(store, "--task", HF, "--config", config, "--max-steps", "2", env=OFFLINE)
    assert first.code == 0, first.stderr[-2000:]
    loaded = first.last("pretrained")
    assert loaded["files"] == [{"url": str(weights), "sha256": _sha(weights)}] and loaded["tensors"] > 0
    # Step 1 trains on the same samples as the seeded reference's step 1 (same seed, same data): from the trained
    # weights its loss is far lower.
    assert _first_loss(first) < _first_loss(runs.ref) - 0.3, (_first_loss(first), _first_loss(runs.ref))
    assert json.loads((store / "plan.json").read_text())["init_sha256"] == [_sha(weights)]

    weights.rename(tmp_path / "moved.safetensors")  # gone: a resume must not need it
    resumed = run(store, "--task", HF, "--config", config, "--max-steps", "4", env=OFFLINE)
    assert resumed.code == 0, resumed.stderr[-2000:]
    assert resumed.last("resume")["step"] == 2 and not [e for e in resumed.events if e["event"] == "pretrained"]

    other = tmp_path / "other.safetensors"  # another file (the bf16 weights, cast on load) is another experiment
    shutil.copy(runs.bundle / "model_bf16.safetensors", other)
    changed = run(store, "--task", HF, "--config", _config(tmp_path, "other", init_from=str(other),
                                                           init_sha256=_sha(other)), "--max-steps", "6", env=OFFLINE)
    assert changed.code == 2, changed.stderr[-2000:]
    assert "init_sha256: the pretrained weights (stored sha256 " in changed.stderr, changed.stderr[-2000:]


def test_a_flipped_byte_in_the_pretrained_weights_is_refused_by_name(runs, tmp_path):
    assert runs.exported.returncode == 0, runs.exported.stderr[-3000:]
    weights = tmp_path / "w.safetensors"
    shutil.copy(runs.bundle / "model.safetensors", weights)
    declared = _sha(weights)
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(data))
    result = run(tmp_path / "run", "--task", HF, "--config",
                 _config(tmp_path, "init", init_from=str(weights), init_sha256=declared), "--max-steps", "2",
                 env=OFFLINE)
    assert result.code == 1, result.stderr[-2000:]
    assert f"pretrained weights {weights}: its sha256 is {_sha(weights)}, not the declared {declared}" in result.stderr
    assert not (tmp_path / "run" / "step-00000001").exists() and not (tmp_path / "run" / "step-00000002").exists()


@pytest.mark.s3
@pytest.mark.slow  # the local file takes the same path through the store (download_file, hashed spool)
def test_pretrained_weights_from_an_s3_url_are_read_through_the_store(runs, tmp_path, s3_env):
    from trainproof.storage import open_store

    assert runs.exported.returncode == 0, runs.exported.stderr[-3000:]
    data = (runs.bundle / "model.safetensors").read_bytes()
    open_store(f"s3://{s3_env}/models").write_file("llama.safetensors", data)
    url = f"s3://{s3_env}/models/llama.safetensors"
    config = _config(tmp_path, "s3", init_from=url, init_sha256=hashlib.sha256(data).hexdigest())
    result = run(tmp_path / "run", "--task", HF, "--config", config, "--max-steps", "1", env=OFFLINE)
    assert result.code == 0, result.stderr[-2000:]
    assert result.last("pretrained")["files"][0]["url"] == url
    assert _first_loss(result) < _first_loss(runs.ref) - 0.3


# -- in process ---------------------------------------------------------------------------------------------
def test_pretrained_files_must_fit_the_model_by_name_and_shape():
    from trainproof.errors import ConfigError
    from trainproof.train.pretrained import check_fits

    tied = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    tied[1].weight = tied[0].weight  # an output layer sharing the embedding
    check_fits(tied, {"0.weight": [5, 3]}, ["w"])  # the tied twin may be left out
    with pytest.raises(ConfigError, match=r"lack 1 of the model's tensor\(s\): \['1.weight'\]"):
        check_fits(torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False)),
                   {"0.weight": [5, 3]}, ["w"])
    with pytest.raises(ConfigError, match=r"the model does not have: \['extra'\]"):
        check_fits(tied, {"0.weight": [5, 3], "extra": [1]}, ["w"])
    with pytest.raises(ConfigError, match=r"0.weight: file \[5, 4\], model \[5, 3\]"):
        check_fits(tied, {"0.weight": [5, 4]}, ["w"])


def test_bf16_autocast_runs_on_the_cpu_without_a_grad_scaler_and_changes_the_arithmetic():
    from trainproof.tasks import load_task
    from trainproof.train.run import build_run, train_step

    losses = {}
    for precision in ("fp32", "bf16"):
        task = load_task("tinylm")
        task.precision = precision
        trained = build_run(task, torch.device("cpu"), 3)
        assert trained.autocast == (torch.bfloat16 if precision == "bf16" else None)
        assert not trained.scaler.is_enabled()
        losses[precision] = [train_step(trained)["loss"] for _ in range(2)]
    assert losses["bf16"] != losses["fp32"]  # the forward really ran in bfloat16


def test_the_docs_model_directory_block_runs_as_written(tmp_path):
    """docs/tasks.md's "Start from a Hugging Face model directory" block in one bash script, in a folder of its own
    with the checkout on PYTHONPATH (as from the repository root), ``bash scripts/dev.sh`` replaced by the console
    script it execs and 100 steps cut to 12: the export's sharded directory is listed by ``trainproof digest``, and the
    run declaring the printed digest loads every shard through the index."""
    import re

    text = (ROOT / "docs" / "tasks.md").read_text()
    section = text.split("\n## Start from a Hugging Face model directory\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    trainproof = Path(sys.executable).parent / "trainproof"
    script = (block.replace("bash scripts/dev.sh ", f"{shlex.quote(str(trainproof))} ")
              .replace("--max-steps 100", "--max-steps 12").replace("step-00000100", "step-00000012")
              .replace("--max-steps 20", "--max-steps 2"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", PYTHONPATH=str(ROOT),
               TRAINPROOF_LOG_FORMAT="json", **OFFLINE)
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, text=True, capture_output=True,
                            env=env, timeout=budget(900))
    assert result.returncode == 0, f"{script}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    base = tmp_path / "models" / "llama-base"
    printed = json.loads((tmp_path / "digest.json").read_text())
    shards = sorted(p.name for p in base.glob("model-*.safetensors"))
    assert len(shards) >= 2 and printed["weights"] == shards and printed["architectures"] == ["LlamaForCausalLM"]
    assert printed["digest"] == _sha(base / "trainproof-listing.json")
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"')]
    (loaded,) = [e for e in events if e.get("event") == "pretrained"]
    assert loaded["files"][0]["digest"] == printed["digest"] and loaded["files"][0]["weights"] == shards
    assert json.loads((tmp_path / "runs" / "tuned" / "plan.json").read_text())["init_sha256"] == [printed["digest"]]
    assert load_state(tmp_path / "runs" / "tuned")["progress"]["step"] == 2
