"""LoRA fine-tuning of a published model through the real entry point: ``examples/hf_lora.py`` (``peft`` adapters on a
``transformers`` Llama, the base frozen, bf16 autocast), initialised from a sharded Hugging Face directory the example
writes for itself.

- a run SIGTERMed mid-way (a real signal) exits 75, resumes and ends bitwise equal to an uninterrupted one; the frozen
  base in the final state is the directory's, byte for byte, and the optimizer holds the adapters only;
- ``export`` writes the adapter (``adapter_config.json``, ``adapter_model.safetensors``) and the merged model; in an
  interpreter whose import path holds only transformers, peft and their dependencies (no trainproof),
  ``PeftModel.from_pretrained(base, adapter)`` and ``AutoModelForCausalLM.from_pretrained(merged)`` reproduce the
  values the bundle records exactly, and the export's reload check passed both;
- docs/tasks.md's "Fine-tuning a published model with LoRA" runs as written (write-base, digest, train, verify with
  the default checks, export) and its python block loads both directories.

Nothing touches the network: ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
import os
import re
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
from tests.test_train_helpers import differences, finish, load_state, run, start, stopped_after_step

pytest.importorskip("transformers")  # the optional extra `[hf]`; the test extras install it
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parent.parent
LORA = "examples.hf_lora:factory"
STEPS = 12
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _python(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    from tests.test_train_helpers import train_env

    return subprocess.run([sys.executable, *args], cwd=cwd, env=train_env(OFFLINE), text=True, capture_output=True,
                          timeout=budget(timeout))


def _without_invocation(state: dict) -> dict:
    return {**state, "meta": {k: v for k, v in state["meta"].items() if k != "trainer"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> SimpleNamespace:
    """The example's base directory and its digest, an uninterrupted LoRA run, one SIGTERMed after step 2 and resumed,
    and the resumed run exported."""
    tmp = tmp_path_factory.mktemp("lora")
    base = tmp / "base"
    wrote = _python("-m", "examples.hf_lora", "write-base", str(base), cwd=ROOT)
    assert wrote.returncode == 0, wrote.stderr[-3000:]
    digest = _python("-m", "trainproof", "digest", str(base), cwd=ROOT)
    assert digest.returncode == 0, digest.stderr[-3000:]
    config = tmp / "lora.json"
    config.write_text(json.dumps({"init_from": str(base), "init_sha256": json.loads(digest.stdout)["digest"]}))
    args = ("--task", LORA, "--config", str(config), "--max-steps", str(STEPS))
    reference = start(tmp / "ref", *args, env=OFFLINE)
    stopped = stopped_after_step(tmp / "cut", *args, step=2, env=OFFLINE)
    resumed = run(tmp / "cut", *args, env=OFFLINE)
    ref = finish(reference, timeout=budget(300))
    exported = _python("-m", "trainproof", "export", "--store", str(tmp / "cut"), "--task", LORA, cwd=ROOT,
                       timeout=600)
    exports = tmp / "cut" / "exports"
    return SimpleNamespace(tmp=tmp, base=base, ref=ref, stopped=stopped, resumed=resumed, exported=exported,
                           bundle=exports / f"step-{STEPS:08d}", merged=exports / "hf" / f"step-{STEPS:08d}",
                           adapter=exports / "hf-adapter" / f"step-{STEPS:08d}",
                           record=exports / f"step-{STEPS:08d}.reload-check.json")


def test_a_lora_run_from_a_sharded_directory_stops_on_sigterm_and_resumes_bitwise(runs):
    from safetensors.torch import load_file

    from trainproof.tasks import peft_base_name

    assert runs.stopped.code == 75, runs.stopped.stderr[-2000:]
    cut = runs.stopped.last("stopped")["step"]
    assert runs.stopped.last("stopped")["reason"] == "signal" and 2 <= cut < STEPS
    assert (runs.ref.code, runs.resumed.code) == (0, 0), runs.ref.stderr[-2000:] + runs.resumed.stderr[-2000:]
    assert runs.resumed.last("resume")["step"] == cut and runs.resumed.last("resume")["rng_restored"] is True
    shards = sorted(p.name for p in runs.base.glob("model-*-of-*.safetensors"))
    (loaded,) = runs.ref.last("pretrained")["files"]
    assert len(shards) >= 2 and loaded["weights"] == shards  # every shard, through the index
    expected, got = load_state(runs.tmp / "ref"), load_state(runs.tmp / "cut")
    assert got["progress"]["step"] == STEPS and (got["meta"]["autocast"], got["meta"]["amp"]) == ("bfloat16", True)
    assert differences(_without_invocation(expected), _without_invocation(got)) == []
    # The frozen base is the directory's byte for byte after training; the adapters trained; the optimizer holds
    # the adapters only (no Adam state, no decay for the base).
    published = {k: v for shard in shards for k, v in load_file(runs.base / shard).items()}
    base = {peft_base_name(k): v for k, v in got["model"].items() if peft_base_name(k) is not None}
    adapters = sorted(k for k in got["model"] if peft_base_name(k) is None)
    assert set(base) == set(published) and all(base[k].equal(published[k]) for k in published)
    assert adapters and all(".lora_" in k for k in adapters)
    assert any(got["model"][k].abs().max() > 0 for k in adapters if ".lora_B." in k)  # lora_B starts at zero
    assert sum(len(g["params"]) for g in got["optimizer"]["param_groups"]) == len(adapters)
    assert len(got["optimizer"]["state"]) == len(adapters)


def test_the_export_writes_the_adapter_and_the_merged_model_and_the_reload_check_passes_both(runs):
    assert runs.exported.returncode == 0, runs.exported.stderr[-3000:]
    assert sorted(p.name for p in runs.adapter.iterdir()) == [
        "COMPLETE.json", "adapter_config.json", "adapter_model.safetensors"]
    assert (runs.merged / "model.safetensors").is_file() and (runs.merged / "config.json").is_file()
    config = json.loads((runs.bundle / "config.json").read_text())
    assert config["hf"]["architecture"] == "LlamaForCausalLM"
    assert config["hf_adapter"]["folder"] == f"hf-adapter/step-{STEPS:08d}"
    assert set(config["hf_adapter"]["files"]) == {"adapter_config.json", "adapter_model.safetensors"}
    record = json.loads(runs.record.read_text())
    merged, adapter = record["checks"]["hf_from_pretrained"], record["checks"]["hf_adapter_from_pretrained"]
    assert record["passed"] and merged["passed"] and adapter["passed"], record["checks"]
    assert adapter["architecture"] == "PeftModelForCausalLM" and adapter["trainproof_importable"] == []
    assert adapter["abs_diff"] == 0.0 and merged["abs_diff"] == 0.0


def test_a_lora_run_sharded_over_two_ranks_resumes_bitwise_and_exports_its_adapter(runs):
    """LoRA under ``--fsdp``: the adapters and the frozen base sharded over two gloo ranks. A run cut after step 3
    and resumed ends with the uninterrupted sharded run's model and optimizer, bit for bit (gathered whole here from
    the shards); its frozen base is still the directory's; and ``export`` of the sharded run writes the adapter and
    the merged model, whose reload checks pass."""
    from safetensors.torch import load_file

    from tests.test_dist_helpers import start_world
    from tests.test_train_fsdp import full_state
    from trainproof.tasks import peft_base_name

    steps, tmp = 6, runs.tmp / "fsdp"
    args = ("--task", LORA, "--config", str(runs.tmp / "lora.json"), "--fsdp", "--checkpoint-every", "2")
    whole = start_world(tmp / "whole", *args, "--max-steps", str(steps), env=OFFLINE)
    cut = finish(start_world(tmp / "cut", *args, "--max-steps", "3", env=OFFLINE), timeout=budget(300))
    assert cut.code == 0, cut.stderr[-3000:]
    resumed = finish(start_world(tmp / "cut", *args, "--max-steps", str(steps), env=OFFLINE), timeout=budget(300))
    whole_done = finish(whole, timeout=budget(300))
    assert (resumed.code, whole_done.code) == (0, 0), resumed.stderr[-3000:] + whole_done.stderr[-3000:]
    assert resumed.last("resume")["step"] == 3 and resumed.last("resume")["rng_restored"] is True
    expected, got = full_state(tmp / "whole"), full_state(tmp / "cut")
    assert sorted(got) == sorted(expected)
    assert [k for k in expected if not _same(expected[k], got[k])] == []
    published = {k: v for shard in runs.base.glob("model-*-of-*.safetensors") for k, v in load_file(shard).items()}
    model = {k.removeprefix("model."): v for k, v in got.items() if k.startswith("model.")}
    base = {peft_base_name(k): v for k, v in model.items() if peft_base_name(k) is not None}
    assert set(base) == set(published) and all(base[k].equal(published[k]) for k in published)
    assert any(v.abs().max() > 0 for k, v in model.items() if ".lora_B." in k)  # trained: lora_B starts at zero
    assert not [k for k in got if k.startswith("optim.state.") and ".lora_" not in k]  # Adam holds the adapters only
    exported = _python("-m", "trainproof", "export", "--store", str(tmp / "cut"), "--task", LORA, cwd=ROOT,
                       timeout=600)
    assert exported.returncode == 0, exported.stderr[-3000:]
    record = json.loads((tmp / "cut" / "exports" / f"step-{steps:08d}.reload-check.json").read_text())
    assert record["passed"] and set(record["checks"]) >= {"hf_from_pretrained", "hf_adapter_from_pretrained"}
    assert all(check["passed"] for check in record["checks"].values()), record["checks"]


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.equal(b) if isinstance(a, torch.Tensor) else a == b


CONSUMER = """
import importlib.util, json, runpy, sys
sys.path.insert(1, {site!r})
print("TRAINPROOF-REACHABLE", [m for m in ("trainproof", "tests", "examples") if importlib.util.find_spec(m)])
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
evaluate = runpy.run_path("bundle/hf_eval.py")["evaluate"]
data = load_file("bundle/hf_eval_data.safetensors")
torch.set_num_threads(json.load(open("bundle/metrics.json"))["eval"]["threads"])
tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("base"), "adapter")
merged = AutoModelForCausalLM.from_pretrained("merged")
print(json.dumps({{"adapter": evaluate(tuned, data), "merged": evaluate(merged, data)}}))
"""


def test_peft_and_transformers_without_trainproof_load_the_adapter_on_the_base_and_the_merged_model(runs, tmp_path):
    """A consumer's copies of the published base, the adapter, the merged directory and the bundle, in
    ``python -S -E -s`` whose import path is the copy, the standard library and a transformers + peft site:
    ``PeftModel.from_pretrained(base, adapter)`` and ``AutoModelForCausalLM.from_pretrained(merged)`` reproduce the
    values metrics.json records exactly."""
    assert runs.exported.returncode == 0, runs.exported.stderr[-3000:]
    (tmp_path / "site").mkdir()
    site = link_site(tmp_path / "site", "transformers", "peft", "torch", "safetensors", "tokenizers")
    assert not {"trainproof", "examples"} & {p.name for p in site.iterdir()}
    consumer = tmp_path / "consumer"
    for name, source in (("base", runs.base), ("adapter", runs.adapter), ("merged", runs.merged),
                         ("bundle", runs.bundle)):
        shutil.copytree(source, consumer / name)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(consumer), **OFFLINE}
    result = subprocess.run([sys.executable, "-S", "-E", "-s", "-c", CONSUMER.format(site=str(site))], cwd=consumer,
                            env=env, capture_output=True, text=True, timeout=budget(300))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "TRAINPROOF-REACHABLE []", lines[0]
    printed = json.loads(lines[-1])
    metrics = json.loads((runs.bundle / "metrics.json").read_text())
    assert printed == {"adapter": metrics["hf_adapter"]["value"], "merged": metrics["hf"]["value"]}, metrics


def test_the_docs_lora_section_runs_as_written_verify_passes_and_both_directories_load(tmp_path):
    """docs/tasks.md's "Fine-tuning a published model with LoRA" bash block in one script, in a folder of its own with
    the checkout on PYTHONPATH (as from the repository root), ``bash scripts/dev.sh`` replaced by the console script
    it execs, ``.venv/bin/python`` by this interpreter and 40 steps cut to 8; then its python block. ``verify`` runs
    with the default checks: the objective check's negative control is caught and every check passes."""
    text = (ROOT / "docs" / "tasks.md").read_text()
    section = text.split("\n## Fine-tuning a published model with LoRA\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    bindir = Path(sys.executable).parent
    script = (block.replace("bash scripts/dev.sh ", f"{shlex.quote(str(bindir / 'trainproof'))} ")
              .replace(".venv/bin/python ", f"{shlex.quote(sys.executable)} ").replace("--max-steps 40", "--max-steps 8"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_")}
    env.update(PATH=f"{bindir}{os.pathsep}{env['PATH']}", PYTHONPATH=str(ROOT), TRAINPROOF_LOG_FORMAT="json", **OFFLINE)
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, text=True, capture_output=True,
                            env=env, timeout=budget(1500))
    assert result.returncode == 0, f"{script}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    store = tmp_path / "runs" / "lora"
    assert load_state(store)["progress"]["step"] == 8
    (vid,) = [p.name for p in (store / "verification").iterdir() if p.is_dir()]
    report = json.loads((store / "verification" / vid / "verification.json").read_text())
    assert report["all_checks_passed"] and report["failing_checks"] == []
    assert report["objective_equivalence_passed"] and report["objective_negative_detected"]
    checks = report["export"]["reload_check"]["checks"]
    assert checks["hf_from_pretrained"]["passed"] and checks["hf_adapter_from_pretrained"]["passed"]
    loaded = subprocess.run([sys.executable, "-c", snippet.replace("step-00000040", "step-00000008")], cwd=tmp_path,
                            env=env, text=True, capture_output=True, timeout=budget(300))
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    tuned, merged = map(int, loaded.stdout.split()[-2:])
    assert tuned == merged  # the adapter on its base and the merged model predict the same next token


def test_the_published_names_must_cover_every_entry_but_the_adapters():
    """In process, over the example's model: the base's published names cover every entry but the adapters (which keep
    their seeded initialisation); a base tensor missing from the files is named by its published name, and a tensor
    the base does not have is named too."""
    import torch

    from examples.hf_llama import build_llama
    from examples.hf_lora import HFLoraConfig, build_lora
    from trainproof.errors import ConfigError
    from trainproof.tasks import peft_base_name
    from trainproof.train.pretrained import check_fits, file_names

    model = build_lora(HFLoraConfig(), 257)
    named = file_names(model, peft_base_name)
    published = {name: list(t.shape) for name, t in build_llama(HFLoraConfig(), 257).state_dict().items()}
    assert set(named.values()) == set(published) and len(named) < len(model.state_dict())
    assert named["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == \
        "model.layers.0.self_attn.q_proj.weight"
    check_fits(model, published, ["base"], named)
    with pytest.raises(ConfigError, match=r"lack 1 of the model's tensor\(s\): \['model.norm.weight'\]"):
        check_fits(model, {k: v for k, v in published.items() if k != "model.norm.weight"}, ["base"], named)
    with pytest.raises(ConfigError, match=r"hold 1 tensor\(s\) the model does not have: \['extra.weight'\]"):
        check_fits(model, {**published, "extra.weight": [1]}, ["base"], named)
    assert torch.count_nonzero(model.state_dict()[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"]) == 0
