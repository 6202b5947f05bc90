"""Nothing stored reaches ``from_pretrained`` unless it is a plain Hugging Face directory this export writes, and a
stored bundle that fails its reload check cannot stop an export (issue 37):

- a directory holding a file ``save_pretrained`` does not write (custom code, other weights) or a JSON file with
  ``auto_map`` is refused by the reload check by name, even when the bundle lists it, and never loaded;
- an export that finds such a directory (and a bundle listing it) at its name quarantines both and commits its own;
- a task whose model config has ``auto_map`` gets a bundle without a Hugging Face directory, with a one-line reason;
- a bundle found stored and reused whose reload check fails (a signed bundle whose directory a co-tenant replaced)
  is quarantined and the export rebuilt and checked once; a failing bundle this process built is the result.

Real processes (``train``, ``export``, ``reload-check``) over one trained store per module.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.timing import budget
from tests.test_train_helpers import ROOT, run, train_env
from trainproof.storage import StoreOptions, open_store

pytest.importorskip("transformers")

HF = "examples.hf_llama:factory"
QUICK = str(ROOT / "examples" / "hf_llama-quick.json")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
KEY = {"TRAINPROOF_SIGNING_KEY": "k-hf-0123456789abcdef"}
STEP = 2
EVIL = "import pathlib\npathlib.Path({canary!r}).write_text('imported')\nclass EvilLM: pass\n"


def job(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainproof", *args], cwd=ROOT, capture_output=True, text=True,
                          env=train_env({**OFFLINE, **(env or {})}), timeout=budget(300))


def train_and_export(store: Path, task: str = HF, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    trained = run(store, "--task", task, "--config", QUICK, "--max-steps", str(STEP), env={**OFFLINE, **(env or {})})
    assert trained.code == 0, trained.stderr[-2000:]
    return job("export", "--store", str(store), "--task", task, env=env)


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "COMPLETE.json"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> SimpleNamespace:
    """A 2-step run of examples/hf_llama.py and its export (bundle and Hugging Face directory)."""
    store = tmp_path_factory.mktemp("hf-hostile") / "run"
    exported = train_and_export(store)
    assert exported.returncode == 0, exported.stderr[-3000:]
    bundle, hf = store / "exports" / f"step-{STEP:08d}", store / "exports" / "hf" / f"step-{STEP:08d}"
    return SimpleNamespace(store=store, bundle=folder_files(bundle), hf=folder_files(hf),
                           manifest=json.loads((bundle / "COMPLETE.json").read_text()),
                           hf_manifest=json.loads((hf / "COMPLETE.json").read_text()))


def planted(trained, kind: str, canary: Path) -> dict[str, bytes]:
    """The genuine directory with one thing a plain save_pretrained directory never holds."""
    files = dict(trained.hf)
    if kind in ("auto_map", "tokenizer-auto_map"):
        name = "config.json" if kind == "auto_map" else "tokenizer_config.json"
        config = json.loads(files[name])
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilLM", "AutoTokenizer": ["modeling_evil.T", None]}
        files[name] = json.dumps(config).encode()  # naming code the directory would need from elsewhere
    elif kind == "modeling_evil.py":
        files[kind] = EVIL.format(canary=str(canary)).encode()
    else:  # another format's weights: a pickle from_pretrained could read instead
        files[kind] = b"not a safetensors file"
    return files


def plant(trained, dest: Path, hf_files: dict[str, bytes], keys: StoreOptions | None = None) -> None:
    """Commit ``hf_files`` as the directory and the genuine bundle with config.json (and SHA256SUMS) listing them,
    as a co-tenant without the key writes them (through the store's own API, unsigned)."""
    bundle = dict(trained.bundle)
    config = json.loads(bundle["config.json"])
    config["hf"]["files"] = {n: hashlib.sha256(d).hexdigest() for n, d in sorted(hf_files.items())}
    bundle["config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    bundle["SHA256SUMS"] = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in sorted(bundle.items())
                                   if n != "SHA256SUMS").encode()
    store = open_store(str(dest), keys)
    m, h = trained.manifest, trained.hf_manifest
    store.child("hf").commit(STEP, hf_files, contract=h["contract"], world=1, code_version=h["code_version"],
                             extra=h["extra"])
    store.commit(STEP, bundle, contract=m["contract"], world=1, code_version=m["code_version"], extra=m["extra"])


@pytest.mark.parametrize("kind", ["auto_map", "tokenizer-auto_map", "modeling_evil.py", "pytorch_model.bin"])
def test_the_reload_check_refuses_a_directory_save_pretrained_did_not_write_by_name(trained, tmp_path, kind):
    """The bundle lists the planted directory's files with their sha256, so only the directory itself can tell:
    from_pretrained (of the class config.json names, which ignores auto_map) used to load it and pass."""
    canary = tmp_path / "imported"
    dest = tmp_path / "dest"
    plant(trained, dest, planted(trained, kind, canary))
    result = job("reload-check", "--bundle", str(dest), "--step", str(STEP), "--task", HF)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    hf = record["checks"].pop("hf_from_pretrained")
    named = "modeling_evil.py" if kind == "modeling_evil.py" else "pytorch_model.bin" if kind == "pytorch_model.bin" \
        else "config.json" if kind == "auto_map" else "tokenizer_config.json"
    assert hf["passed"] is False and hf["why"].startswith(f"not loaded: {named} "), hf
    assert "\n" not in hf["why"] and "architecture" not in hf and "reloaded" not in hf  # nothing was loaded
    assert all(c["passed"] for c in record["checks"].values()), record["checks"]  # the bundle itself is fine
    assert not canary.exists()


def test_an_export_quarantines_a_planted_directory_with_auto_map_and_commits_its_own(trained, tmp_path):
    store = tmp_path / "run"
    shutil.copytree(trained.store, store)
    shutil.rmtree(store / "exports")
    canary = tmp_path / "imported"
    plant(trained, store / "exports", planted(trained, "auto_map", canary))
    result = job("export", "--store", str(store), "--task", HF)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stdout + result.stderr[-3000:]
    assert result.stdout.startswith("committed"), result.stdout
    assert folder_files(store / "exports" / "hf" / f"step-{STEP:08d}") == trained.hf
    assert len(open_store(str(store / "exports" / "hf")).quarantined()) == 1
    assert len(open_store(str(store / "exports")).quarantined()) == 1
    assert not canary.exists()


def test_a_model_config_with_auto_map_gets_no_hf_directory_and_a_one_line_reason(tmp_path):
    """A custom model registered for the auto classes: its save_pretrained would write auto_map (code a consumer's
    from_pretrained imports with trust_remote_code). The export leaves the directory out and keeps the bundle."""
    store = tmp_path / "run"
    result = train_and_export(store, task="tests.support.hf_auto_map:factory")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert not (store / "exports" / "hf").exists()
    config = json.loads((store / "exports" / f"step-{STEP:08d}" / "config.json").read_text())
    assert "hf" not in config and "auto_map" in config["hf_refused"] and "config.json" in config["hf_refused"]
    warnings = [line for line in result.stderr.splitlines() if "no Hugging Face directory" in line]
    assert len(warnings) == 1, result.stderr[-3000:]
    record = json.loads((store / "exports" / f"step-{STEP:08d}.reload-check.json").read_text())
    assert record["passed"] and "hf_from_pretrained" not in record["checks"]


def test_a_reused_signed_bundle_whose_check_fails_is_quarantined_and_rebuilt_once(tmp_path):
    """With a key a validly signed bundle is reused without a byte comparison; a co-tenant (no key) then replaces
    its Hugging Face directory. Its reload check fails: the bundle used to stop the export (exit 1); it is now moved
    to quarantine and the export rebuilt, whose check passes."""
    store = tmp_path / "run"
    first = train_and_export(store, env=KEY)
    assert first.returncode == 0, first.stderr[-3000:]
    hf = store / "exports" / "hf" / f"step-{STEP:08d}"
    genuine = folder_files(hf)
    shutil.rmtree(hf)
    manifest = json.loads((store / "exports" / f"step-{STEP:08d}" / "COMPLETE.json").read_text())
    canary = tmp_path / "imported"
    files = planted(SimpleNamespace(hf=genuine), "modeling_evil.py", canary)
    open_store(str(store / "exports")).child("hf").commit(
        STEP, files, contract=manifest["contract"], world=1, code_version=manifest["code_version"],
        extra={"kind": "hf-directory"})
    result = job("export", "--store", str(store), "--task", HF, env=KEY)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("reused") and lines[1].startswith("committed"), lines
    assert "not the run's own" in result.stderr and "hf_from_pretrained" in result.stderr, result.stderr[-3000:]
    assert folder_files(hf) == genuine and not canary.exists()
    exports = open_store(str(store / "exports"), StoreOptions.from_env(env=KEY))
    assert [r for _, r in exports.quarantined() if "reused by the export" in r], exports.quarantined()
    assert json.loads((store / "exports" / f"step-{STEP:08d}.reload-check.json").read_text())["passed"]


# -- in process: the rebuild happens once, and only for a bundle this process did not build ---------------------
@pytest.mark.parametrize("reused", [True, False])
def test_a_failing_check_rebuilds_a_reused_bundle_once_and_never_a_fresh_one(monkeypatch, reused):
    from trainproof.proof import reload

    exports, quarantined = [], []
    dest = SimpleNamespace(url="mem://x/exports", quarantine=lambda step, why: quarantined.append((step, why)))

    def export(run, *, step, dest, task):
        exports.append(step)
        return SimpleNamespace(dest=dest, step=7, reused=reused and len(exports) == 1, task="tinylm")

    failing = {"passed": False, "checks": {"sha256sums": {"passed": True}, "bf16_reproduced": {"passed": False}}}
    monkeypatch.setattr(reload, "export", lambda run, **kw: export(run, **kw))
    monkeypatch.setattr(reload, "absolute_url", lambda dest: dest.url)
    monkeypatch.setattr(reload, "check_in_fresh_process", lambda *a, **kw: dict(failing))
    checked = reload.export_and_check(SimpleNamespace(), task="tinylm", store_args=[], timeout=5, dest=dest,
                                      keep_record=False)
    assert checked.passed is False and checked.bundle.reused is False
    assert exports == ([None, 7] if reused else [None])
    assert [s for s, _ in quarantined] == ([7] if reused else [])
    assert all("bf16_reproduced" in why for _, why in quarantined)
