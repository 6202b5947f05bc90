"""Settings from the environment are read once, at the edge, into the options objects: a bad value is a one-line
configuration error when a store is opened (exit 2), never an import-time traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainproof.storage import StoreOptions
from trainproof.storage.errors import StoreConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_a_bad_digest_part_size_is_refused_when_a_store_is_opened_not_on_import(tmp_path):
    env = {**os.environ, "TRAINPROOF_DIGEST_PART_MIB": "lots", "PYTHONPATH": str(ROOT)}
    imported = subprocess.run([sys.executable, "-c", "import trainproof.storage, trainproof.storage.digest, trainproof.format.state"],
                              env=env, capture_output=True, text=True)
    assert imported.returncode == 0, imported.stderr
    listed = subprocess.run([sys.executable, "-m", "trainproof", "ls", "--store", str(tmp_path / "run")], env=env,
                            capture_output=True, text=True, cwd=ROOT)
    assert listed.returncode == 2
    assert listed.stderr.strip().splitlines() == [
        "trainproof: error: TRAINPROOF_DIGEST_PART_MIB='lots' is not a number of MiB: set the digest part size in "
        "MiB (default 32) or unset it"]


@pytest.mark.parametrize("raw, ok", [("", True), ("8", True), ("0.5", True), ("0", False), ("4096", False)])
def test_the_digest_part_size_is_checked_by_the_options(raw, ok):
    env = {"TRAINPROOF_DIGEST_PART_MIB": raw}
    if ok:
        StoreOptions.from_env(env)
    else:
        with pytest.raises(StoreConfigError, match="TRAINPROOF_DIGEST_PART_MIB"):
            StoreOptions.from_env(env)
