"""A planted export bundle is never adopted, and never crashes ``export``: a bundle already at the step is reused
only when it is this state's own export (its files verify, it names this generation and state, and every file is
byte for byte what this state exports; with a signing key, validly signed); anything else is moved to quarantine and
rebuilt."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from trainproof.export.tensorfile import write_safetensors
from trainproof.format.state import STATE_FILE
from trainproof.storage import open_store
from tests.support.timing import budget
from tests.test_train_helpers import ROOT, run, train_env


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("trained") / "run"
    assert run(d, "--max-steps", "4", "--checkpoint-every", "2").code == 0
    return d


def export(store) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainproof", "export", "--store", str(store), "--step", "4"], cwd=ROOT,
                          env=train_env(), capture_output=True, text=True, timeout=budget(300))


def plant_bundle(store, config: bytes, weights: bytes) -> None:
    s = open_store(str(store))
    loaded = s.load(4)
    source = {"run": s.url, "generation": "step-00000004",
              "state_sha256": loaded.info.manifest["files"][STATE_FILE]["sha256"]}
    open_store(str(store / "exports")).commit(
        4, {"config.json": config, "model.safetensors": weights}, contract=loaded.info.manifest["contract"], world=1,
        code_version="t", extra={"kind": "export", "source": source})


def other_weights(tmp_path) -> bytes:
    path = tmp_path / "w.safetensors"
    with open(path, "wb") as out:
        write_safetensors(out, {"0.weight": torch.ones(8, 2, dtype=torch.float64)})
    return path.read_bytes()


@pytest.mark.parametrize("config", ["a-json-list", "naming-the-real-state"])
def test_a_planted_bundle_is_quarantined_and_the_export_rebuilt(trained, tmp_path, config):
    store = tmp_path / "run"
    shutil.copytree(trained, store)
    state_sha = open_store(str(store)).load(4).info.manifest["files"][STATE_FILE]["sha256"]
    raw = b"[1, 2, 3]" if config == "a-json-list" else json.dumps({"source": {"state_sha256": state_sha}}).encode()
    plant_bundle(store, raw, other_weights(tmp_path))
    result = export(store)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and not result.stdout.startswith("reused"), result.stdout
    assert "not this state's export" in result.stderr, result.stderr
    dest = open_store(str(store / "exports"))
    assert len(dest.quarantined()) == 1
    files = dest.load(4).files
    assert json.loads(files["config.json"])["source"]["state_sha256"] == state_sha
    assert files["model.safetensors"] != other_weights(tmp_path)
    again = export(store)  # and the rebuilt bundle, being this state's own, is reused
    assert again.returncode == 0 and again.stdout.startswith("reused"), again.stdout + again.stderr


@pytest.mark.parametrize("changed", ["model_bf16.pt", "README.md", "an-extra-file"])
def test_a_bundle_with_the_genuine_weights_and_any_other_file_of_its_own_is_rebuilt(trained, tmp_path, changed):
    """Without a key, the reuse check used to compare only ``model.safetensors``: a planted bundle with the genuine
    full-precision weights and its own bf16 weights (or README, or a file the export never writes) was reused and
    vouched for. Every stored byte must now be what this state exports, else it is quarantined and rebuilt."""
    store = tmp_path / "run"
    shutil.copytree(trained, store)
    assert export(store).returncode == 0  # what this state exports, byte for byte (the export is deterministic)
    exports = open_store(str(store / "exports"))
    genuine, manifest = dict(exports.load(4).files), exports.generation(4).manifest
    shutil.rmtree(store / "exports")  # as before any export: the co-tenant plants first
    files = dict(genuine)
    if changed == "an-extra-file":
        files["config.py"] = b"import os  # not written by the export\n"
    else:
        files[changed] = files[changed][:-1] + bytes([files[changed][-1] ^ 1])
    open_store(str(store / "exports")).commit(4, files, contract=manifest["contract"], world=1,
                                              code_version=manifest["code_version"], extra=manifest["extra"])
    result = export(store)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stdout.startswith("committed") and "not this state's export" in result.stderr, result.stdout
    assert open_store(str(store / "exports")).load(4).files == genuine
    again = export(store)  # the rebuilt bundle is this state's own: reused
    assert again.returncode == 0 and again.stdout.startswith("reused"), again.stdout + again.stderr
