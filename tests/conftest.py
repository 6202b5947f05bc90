"""Shared fixtures: the S3 servers on loopback (Ceph's RADOS Gateway, and moto where a fault proxy or a second
implementation is the point) and the same store contract on every backend."""

from __future__ import annotations

import contextlib
import os
import uuid

import pytest

from tests.support import container, rgw
from tests.support.s3server import S3Server, dummy_aws_env

BACKENDS = ["memory", "local", "s3"]


@contextlib.contextmanager
def _hermetic_aws_env():
    """Dummy credentials for the whole session: nothing may read real credentials or instance metadata."""
    saved = {k: os.environ.get(k) for k in dummy_aws_env()}
    os.environ.update(dummy_aws_env())
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3_server():
    """The session's S3 server: a throw-away Ceph RADOS Gateway (``scripts/rgw.sh``, shared by the xdist workers,
    stopped when the session ends); tests isolate themselves with a unique bucket each. Skipped, with the reason,
    where it cannot start (``TRAINPROOF_TEST_RGW=require`` fails instead; ``=0`` skips without trying)."""
    try:
        server, why = rgw.session_server(), None
    except rgw.Unavailable as exc:
        why = str(exc)
    if why is not None and rgw.mode() == "require":
        pytest.fail(f"TRAINPROOF_TEST_RGW=require but {why}", pytrace=False)
    if why is not None:
        pytest.skip(f"no S3 server: {why}")
    with _hermetic_aws_env():
        yield server


@pytest.fixture(scope="session")
def moto_server():
    """moto's S3 in server mode, for the tests where fault injection through the proxy depends on moto's exact
    answers, or where a second implementation is the point (docs/testing.md lists them, with the reasons)."""
    with _hermetic_aws_env(), S3Server() as server:
        yield server


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


def pytest_configure(config):
    """The controlling process picks this session's gateway folder (workers inherit it); nothing starts yet."""
    if not hasattr(config, "workerinput"):
        config._trainproof_rgw_state = rgw.prepare_session()
        config._trainproof_container_report = container.prepare_session()


def pytest_unconfigure(config):
    state = getattr(config, "_trainproof_rgw_state", None)
    if state:
        rgw.end_session(state)
    report = getattr(config, "_trainproof_container_report", None)
    if report:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(report)


# Modules whose shared reference runs take a minute or more: collected first, so that with parallel workers
# (``--dist loadscope`` hands out whole modules in collection order) they start at once instead of being the
# tail that one worker runs alone at the end.
HEAVY_FIRST = ("test_hf", "test_hf_lora", "test_container", "test_verify_fsdp", "test_verify_world", "test_dist_equivalence", "test_preempt", "test_dist_resume",
               "test_verify", "test_examples", "test_multinode", "test_train_fsdp", "test_verify_cuts",
               "test_verify_objective", "test_trust_audit", "test_trust_resume", "test_async_checkpoint",
               "test_async_world", "test_train_deadline", "test_export", "test_code_identity", "test_sharded", "test_signing_train",
               "test_storage_faults", "test_storage_crash", "test_data_workers", "test_data_s3")


def pytest_collection_modifyitems(config, items):
    """Heavy modules first (``HEAVY_FIRST``). ``slow`` tests (longer real-process variants of behaviour a faster
    test already covers) run only with ``TRAINPROOF_SLOW=1``; the default run deselects them and says how many
    it left out."""
    for item in items:  # `-m s3` selects every test that talks to an S3 server, whichever way it gets one
        params = getattr(getattr(item, "callspec", None), "params", {})
        if {"s3_server", "s3_env", "moto_server"} & set(getattr(item, "fixturenames", ())) or \
                params.get("store_url") == "s3" or str(params.get("backend", "")).startswith("s3"):
            item.add_marker(pytest.mark.s3)
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
    state = getattr(config, "_trainproof_rgw_state", None)
    said = rgw.session_summary(state) if state else None
    if said:
        terminalreporter.write_line(said)
    report = getattr(config, "_trainproof_container_report", None)
    for line in container.session_summary(report) if report else []:
        terminalreporter.write_line(line)
