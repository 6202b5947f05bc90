"""``trainproof export``: the bundle is committed with generation semantics (COMPLETE.json with the bf16
file's digest), reloaded from its destination in a fresh process with a matching metric, loadable with the
README's snippet, and a bundle whose recorded metric is wrong fails its reload check. Also the tasks'
``evaluate``: deterministic, and it leaves the model's mode and every generator as it found them."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random

import numpy as np
import pytest
import torch

from trainproof.storage import open_store
from tests.test_train_helpers import run
from tests.test_verify_helpers import cli, trainproof  # noqa: F401  (cli: a fixture)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A regression run trained 4 steps, exported to another folder through the entry point."""
    d = tmp_path_factory.mktemp("export")
    trained = run(d / "run", "--max-steps", "4")
    assert trained.code == 0, trained.stderr
    spool = d / "spool"
    result = trainproof("export", "--store", str(d / "run"), "--dest", str(d / "dest"),
                        env={"TRAINPROOF_SPOOL_DIR": str(spool)})
    return {"dir": d, "result": result, "bundle": d / "dest" / "step-00000004", "spool": spool}


def test_export_commits_a_complete_bundle(exported):
    assert exported["result"].returncode == 0, exported["result"].stderr
    bundle = exported["bundle"]
    manifest = json.loads((bundle / "COMPLETE.json").read_text())
    names = set(manifest["files"])
    assert {"model_bf16.pt", "config.json", "metrics.json", "data.json", "README.md", "SHA256SUMS"} <= names
    assert "model.safetensors" in names
    bf16 = (bundle / "model_bf16.pt").read_bytes()
    assert manifest["export_sha256"] == hashlib.sha256(bf16).hexdigest() and manifest["export_bytes"] == len(bf16)
    for line in (bundle / "SHA256SUMS").read_text().splitlines():  # sha256sum -c, by hand
        digest, name = line.split("  ")
        assert hashlib.sha256((bundle / name).read_bytes()).hexdigest() == digest
    weights = torch.load(io.BytesIO(bf16), weights_only=True)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    metrics = json.loads((bundle / "metrics.json").read_text())
    assert (metrics["step"], metrics["samples_seen"], metrics["eval"]["metric"]) == (4, 16, "mse")
    assert metrics["final_loss"] > 0 and metrics["bf16_tolerance"]["why"]
    data = json.loads((bundle / "data.json").read_text())
    assert data["data_identity"] == json.loads((exported["dir"] / "run" / "plan.json").read_text())["data_identity"]


def test_the_weight_files_are_what_the_libraries_write_and_no_spool_file_is_left(exported):
    """The weight files are written tensor by tensor through spool files (trainproof.export.tensorfile); the bytes are
    still exactly what safetensors and torch.save make of the same weights, and the spools are deleted."""
    from safetensors.torch import load, save

    from trainproof.tasks import load_task

    bundle = exported["bundle"]
    full = (bundle / "model.safetensors").read_bytes()
    weights = load(full)
    assert weights and all(t.is_floating_point() for t in weights.values())
    assert save(weights) == full
    bf16 = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    assert save(bf16) == (bundle / "model_bf16.safetensors").read_bytes()
    plan = json.loads((exported["dir"] / "run" / "plan.json").read_text())
    order = list(load_task(plan["task"], plan["task_config"]).build_model().state_dict())  # a state_dict's order
    bf16 = {k: bf16[k] for k in order}
    expected = io.BytesIO()
    torch.save(bf16, expected)
    assert expected.getvalue() == (bundle / "model_bf16.pt").read_bytes()
    assert exported["spool"].is_dir() and not any(exported["spool"].iterdir())


def test_building_the_bundle_lets_the_gathered_weights_go_and_deletes_its_spools_on_error(exported, tmp_path):
    """Once model.safetensors is written, build_files reads the weights from it: the caller's tensors (a sharded
    run's gathered model) are no longer referenced, so they can be freed before the model is evaluated."""
    import gc
    import weakref

    from trainproof.tasks import load_task
    from trainproof.export.bundle import FP_FILE, build_files, discard
    from trainproof.format.state import STATE_FILE, decode
    from trainproof.storage.spool import Spool

    run_dir = exported["dir"] / "run"
    plan = json.loads((run_dir / "plan.json").read_text())
    state = decode(open_store(str(run_dir)).load(4).files[STATE_FILE])
    state["model"] = {k: v.clone() for k, v in state["model"].items()}  # memory of their own, as gathered ones
    gathered = [weakref.ref(t) for t in state["model"].values()]
    task = load_task(plan["task"], plan["task_config"])
    files = build_files(task, plan, state, {"run": "test"}, directory=str(tmp_path))
    try:
        gc.collect()
        assert gathered and all(ref() is None for ref in gathered)
        assert isinstance(files[FP_FILE], Spool) and files[FP_FILE].path.startswith(str(tmp_path))
    finally:
        discard(files)
    assert not any(tmp_path.iterdir())

    def fail(model):
        raise RuntimeError("evaluation broke")

    task.evaluate = fail
    with pytest.raises(RuntimeError, match="evaluation broke"):
        build_files(task, plan, state, {"run": "test"}, directory=str(tmp_path))
    assert not any(tmp_path.iterdir())  # the weight files written before the error are gone


def test_a_damaged_weights_spool_fails_the_content_check(tmp_path):
    """The store's content check reads a spooled weights file from its path (mapped, or tensor by tensor)."""
    from trainproof.export.bundle import check_file
    from trainproof.export.tensorfile import write_safetensors
    from trainproof.storage.spool import SpoolWriter

    with SpoolWriter(str(tmp_path)) as out:
        write_safetensors(out, {"a": torch.arange(6, dtype=torch.float32)})
    good = out.finish()
    check_file("model.safetensors", good)
    with SpoolWriter(str(tmp_path)) as out:
        torch.save({"a": torch.ones(2)}, out)
    check_file("model_bf16.pt", out.finish())
    with open(good.path, "r+b") as fh:  # the header now claims more data than the file holds
        fh.seek(8)
        text = fh.read(64).replace(b"[0,24]", b"[0,99]")
        fh.seek(8)
        fh.write(text)
    with pytest.raises(Exception):
        check_file("model.safetensors", good)
    with SpoolWriter(str(tmp_path)) as out:
        out.write(b"not a zip")
    with pytest.raises(Exception):
        check_file("model_bf16.pt", out.finish())


def test_export_is_reloaded_from_its_destination_in_a_fresh_process(exported):
    record_file = exported["dir"] / "dest" / "step-00000004.reload-check.json"
    record = json.loads(record_file.read_text())
    assert record["passed"] is True and record["pid"] != os.getpid()
    assert record["bundle"] == str(exported["bundle"])
    assert record["reloaded_full_precision"] == record["recorded"]  # same bytes, same CPU: exact
    bf16_rtol = record["checks"]["bf16_within_tolerance"]["rtol"]
    assert abs(record["reloaded_bf16"] - record["recorded"]) <= bf16_rtol * record["recorded"]
    assert "reload check (mse)" in exported["result"].stdout and "passed" in exported["result"].stdout


def test_the_bundle_holds_pictures_and_plain_files_and_never_says_pip_install_trainproof(exported):
    """The loss curve is a PNG; the snippet itself is run without trainproof by tests/test_bundle_standalone.py."""
    bundle = exported["bundle"]
    names = set(json.loads((bundle / "COMPLETE.json").read_text())["files"])
    assert {"model.safetensors", "model_bf16.safetensors", "model.py", "eval_data.safetensors", "loss.png"} <= names
    assert (bundle / "loss.png").read_bytes().startswith(b"\x89PNG")
    readme = (bundle / "README.md").read_text()
    assert "pip install trainproof" not in readme and "another project" in readme
    config = json.loads((bundle / "config.json").read_text())
    assert config["weights"] == {"bf16": "model_bf16.pt", "bf16_safetensors": "model_bf16.safetensors",
                                 "full_precision": "model.safetensors"}
    assert config["standalone"]["model_py"] is True


def test_exporting_again_reuses_the_committed_bundle(exported, cli):  # noqa: F811
    d = exported["dir"]
    result = cli("export", "--store", str(d / "run"), "--step", "4", "--dest", str(d / "dest"))
    assert result.exit_code == 0, result.output + result.stderr
    assert result.output.startswith("reused ")


def test_a_bundle_whose_metric_is_wrong_fails_its_reload_check(exported, tmp_path):
    from trainproof.export.bundle import check_file
    from trainproof.proof.reload import reload_check

    source = open_store(str(exported["dir"] / "dest")).load(4)
    files = dict(source.files)
    metrics = json.loads(files["metrics.json"])
    metrics["eval"]["value"] *= 1.5  # a metric that these weights do not give
    files["metrics.json"] = json.dumps(metrics).encode()
    files["SHA256SUMS"] = "".join(f"{hashlib.sha256(v).hexdigest()}  {k}\n" for k, v in sorted(files.items())
                                  if k != "SHA256SUMS").encode()
    dest = open_store(str(tmp_path / "dest"))
    dest.commit(4, files, contract="c", world=1, code_version="test", check=check_file,
                digests={"export": "model_bf16.pt"})
    record = reload_check(dest, 4, task="regression")
    assert record["passed"] is False
    assert not record["checks"]["full_precision_reproduced"]["passed"] and record["checks"]["bf16_reproduced"]["passed"]


def test_the_reload_check_maps_spooled_weight_files_and_refuses_a_malformed_one(exported, tmp_path, monkeypatch):
    """With every file spooled (as the weights of any real model are), the reload check maps the weight files,
    reads the records from their spools and reproduces the metrics exactly; a committed model.safetensors whose
    header is not safetensors' is named, not crashed on."""
    from trainproof.errors import ConfigError
    from trainproof.proof import reload

    monkeypatch.setattr(reload, "SPOOL_FROM", 1)
    monkeypatch.setenv("TRAINPROOF_SPOOL_DIR", str(tmp_path / "spool"))
    record = reload.reload_check(open_store(str(exported["dir"] / "dest")), 4, task="regression")
    assert record["passed"] is True and record["reloaded_full_precision"] == record["recorded"]
    assert record["reloaded_bf16"] == record["recorded_bf16"] and record["checks"]["sha256sums"]["passed"]
    assert not any((tmp_path / "spool").iterdir())  # the spools are deleted

    files = dict(open_store(str(exported["dir"] / "dest")).load(4).files)
    weights = bytearray(files["model.safetensors"])
    length = int.from_bytes(weights[:8], "little")
    header = weights[8:8 + length].replace(b'"F64"', b'"F99"')  # an unknown dtype, same length
    files["model.safetensors"] = bytes(weights[:8] + header + weights[8 + length:])
    dest = open_store(str(tmp_path / "forged"))
    dest.commit(4, files, contract="c", world=1, code_version="test", digests={"export": "model_bf16.pt"})
    with pytest.raises(ConfigError, match="model.safetensors.*not a safetensors tensor entry"):
        reload.reload_check(dest, 4, task="regression")


def test_export_of_a_store_without_a_run_is_exit_2(cli, tmp_path):  # noqa: F811
    result = cli("export", "--store", str(tmp_path / "nothing"))
    assert result.exit_code == 2 and "no run" in result.stderr


@pytest.mark.parametrize("name,config", [("regression", {}), ("tinylm", {"n_sequences": 12})])
def test_evaluate_is_deterministic_and_leaves_no_trace(name, config):
    from trainproof.tasks import load_task

    task = load_task(name, config)
    torch.manual_seed(0)
    model = task.build_model().to(task.dtype)
    model.train()
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    first, second = task.evaluate(model), task.evaluate(model)
    assert first == second and np.isfinite(first) and first > 0
    assert model.training  # dropout is back on for training
    assert random.getstate() == states[0] and np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])
