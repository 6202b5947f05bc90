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

from storage import open_store
from tests.test_train_helpers import run
from tests.test_verify_helpers import cli, trainproof  # noqa: F401  (cli: a fixture)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A regression run trained 4 steps, exported to another folder through the entry point."""
    d = tmp_path_factory.mktemp("export")
    trained = run(d / "run", "--max-steps", "4")
    assert trained.code == 0, trained.stderr
    result = trainproof("export", "--store", str(d / "run"), "--dest", str(d / "dest"))
    return {"dir": d, "result": result, "bundle": d / "dest" / "step-00000004"}


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
    from job.train.export import check_file
    from job.proof.reload import reload_check

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


def test_export_of_a_store_without_a_run_is_exit_2(cli, tmp_path):  # noqa: F811
    result = cli("export", "--store", str(tmp_path / "nothing"))
    assert result.exit_code == 2 and "no run" in result.stderr


@pytest.mark.parametrize("name,config", [("regression", {}), ("tinylm", {"n_sequences": 12})])
def test_evaluate_is_deterministic_and_leaves_no_trace(name, config):
    from job.tasks import load_task

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
