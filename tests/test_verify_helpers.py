"""Shared helpers for the verifier and export tests (no tests here)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from trainproof.storage import open_store
from tests.test_train_helpers import entry_module

ROOT = Path(__file__).resolve().parent.parent


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment without TRAINPROOF_* options, with this checkout importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return {**env, **(extra or {})}


def trainproof(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m trainproof ARGS`` as a user runs it (the fault-injecting test wrapper when ``env`` has TPHOOK_*)."""
    return subprocess.run([sys.executable, "-m", entry_module(env), *args], cwd=ROOT, env=clean_env(env), text=True,
                          capture_output=True, timeout=600)


def read_report(store: str, vid: str) -> dict[str, Any]:
    """verification.json, read back from the store."""
    return json.loads(open_store(f"{store.rstrip('/')}/verification/{vid}").read_file("verification.json"))


def checks(report: dict[str, Any], path: str) -> dict[str, dict[str, Any]]:
    """One path's checks by name."""
    return {c["name"]: c for c in report["checks"][path]}


@pytest.fixture
def cli(monkeypatch):
    """The Typer app in this process; TRAINPROOF_* options cleared, logging handed back afterwards."""
    from trainproof.cli import _register, app

    _register()
    for k in [k for k in os.environ if k.startswith("TRAINPROOF_")]:
        monkeypatch.delenv(k)
    saved = logging.root.handlers[:], logging.root.level
    yield lambda *args: CliRunner().invoke(app, list(args))
    logging.root.handlers[:] = saved[0]
    logging.root.setLevel(saved[1])


HOOKED = "tests.support.hooked"
"""The fault-injecting wrapper of ``python -m trainproof`` (tests only)."""


def sabotaged(cli, monkeypatch, ref: dict[str, Any], sabotage: str, *extra: str,
              vid: str | None = None) -> tuple[Any, dict[str, Any]]:
    """``verify --reuse-reference ref`` on ``ref``'s store (its continuous, cut and negative paths reused), the
    resumed paths run by the wrapper with ``TPHOOK_SABOTAGE`` set; the result and the report."""
    monkeypatch.setenv("TPHOOK_SABOTAGE", sabotage)  # inherited by every path
    monkeypatch.setattr("trainproof.train.launch.ENTRY_MODULE", HOOKED)
    vid = vid or f"sabotage-{sabotage}"
    config = ["--task", "tinylm", "--config", ref["config"]] if "config" in ref else []
    result = cli("verify", "--store", ref["store"], *config, "--reuse-reference", "ref", "--id", vid, "--no-export",
                 *extra)
    return result, read_report(ref["store"], vid)
