"""Shared fixtures: an S3 server on loopback (moto server mode) and the same store contract on every backend."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.support.s3server import S3Server, dummy_aws_env

BACKENDS = ["memory", "local", "s3"]


@pytest.fixture(scope="session")
def s3_server():
    """One moto S3 server for the session; tests isolate themselves with a unique bucket each."""
    saved = {k: os.environ.get(k) for k in dummy_aws_env()}
    os.environ.update(dummy_aws_env())  # hermetic: never read real credentials or instance metadata
    with S3Server() as server:
        yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Environment pointing the AWS variables at the loopback server; returns the bucket created for this test."""
    for k, v in dummy_aws_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    return s3_server.create_bucket()


@pytest.fixture(params=BACKENDS)
def store_url(request, tmp_path):
    """A fresh run URL on each backend: memory://, a local folder, and s3:// over HTTP on loopback."""
    kind = request.param
    if kind == "memory":
        return f"memory://tp-{uuid.uuid4().hex[:12]}/run"
    if kind == "local":
        return str(tmp_path / "run")
    bucket = request.getfixturevalue("s3_env")
    return f"s3://{bucket}/prefix/run"


# Modules whose shared reference runs take a minute or more: collected first, so that with parallel workers
# (``--dist loadscope`` hands out whole modules in collection order) they start at once instead of being the
# tail that one worker runs alone at the end.
HEAVY_FIRST = ("test_verify_fsdp", "test_verify_world", "test_dist_equivalence", "test_preempt", "test_dist_resume",
               "test_verify", "test_examples", "test_multinode", "test_train_fsdp", "test_verify_cuts",
               "test_verify_objective", "test_trust_audit", "test_trust_resume", "test_async_checkpoint",
               "test_async_world", "test_train_deadline", "test_export", "test_code_identity", "test_sharded", "test_signing_train",
               "test_data_workers", "test_data_s3")


def pytest_collection_modifyitems(config, items):
    """Heavy modules first (``HEAVY_FIRST``). ``slow`` tests (longer real-process variants of behaviour a faster
    test already covers) run only with ``TRAINPROOF_SLOW=1``; the default run deselects them and says how many
    it left out."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)) if item.module else len(rank))
    if os.environ.get("TRAINPROOF_SLOW") == "1":
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
        config._trainproof_slow = len(slow)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left_out = getattr(config, "_trainproof_slow", 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} slow test(s) left out; TRAINPROOF_SLOW=1 runs them too")
