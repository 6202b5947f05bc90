"""A writer prepares an S3 store for writing (the create-only probe, the sweep of stale multipart uploads) on a thread
of its own while it sets up (``GenerationStore.prepare_soon``): its first write waits for it and raises what it
raised, and a write after that tries again (on Ceph RGW)."""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import replace

import pytest

from tests.support.timing import budget
from trainproof.storage import StoreOptions, open_store
from trainproof.storage.errors import StoreConfigError


def test_the_probe_runs_beside_the_callers_set_up_and_the_first_write_waits_for_it(s3_env):
    store = open_store(f"s3://{s3_env}/soon/run", StoreOptions.from_env())
    backend = store.backend
    real_probe, real_write = backend.probe_create_only, backend.write
    events: list[str] = []
    started, release = threading.Event(), threading.Event()

    def held_probe(path):
        events.append(f"probe on {threading.current_thread().name}")
        started.set()
        assert release.wait(20)
        events.append("probe done")
        return real_probe(path)

    def write(path, data, **kwargs):
        events.append(f"write {path.rsplit('/', 1)[-1]}")
        return real_write(path, data, **kwargs)

    backend.probe_create_only, backend.write = held_probe, write
    try:
        store.prepare_soon()
        assert started.wait(20), "no probe started before any write"
        store.prepare_soon()  # started already: returns at once (waiting here would hold the probe 20 s, and fail)
        writer = threading.Thread(target=store.write_file, args=("plan.json", b"{}"))
        writer.start()
        writer.join(0.5)  # a write that did not wait would have begun by now
        release.set()
        writer.join(20)
        store.prepare_soon()  # prepared: nothing more
        store.write_file("again.json", b"{}")
    finally:
        backend.probe_create_only, backend.write = real_probe, real_write
    probe_writes = [e for e in events if e.startswith("write probe-")]  # the probe's own objects
    assert events[0] == "probe on trainproof-prepare" and events[1] == "probe done", events
    assert [e for e in events[2:] if e not in probe_writes] == ["write plan.json", "write again.json"], events
    assert store.read_file("plan.json") == b"{}"


def test_a_failed_preparation_is_raised_by_the_first_write_and_tried_again_by_the_next(s3_env):
    store = open_store(f"s3://{s3_env}/soon-failed/run", replace(StoreOptions.from_env(), create_only="require"))
    backend = store.backend
    real_probe, probes, probed = backend.probe_create_only, [], threading.Event()

    def ignored(path):  # as an endpoint that ignores If-None-Match answers
        probes.append(threading.current_thread().name)
        probed.set()
        return False

    backend.probe_create_only = ignored
    try:
        store.prepare_soon()
        assert probed.wait(20)  # the thread got there first (else the write would simply probe itself)
        with pytest.raises(StoreConfigError, match="ignores If-None-Match"):
            store.write_file("plan.json", b"{}")
        assert probes == ["trainproof-prepare"]  # raised from the probe beside, not probed again
        backend.probe_create_only = real_probe
        store.write_file("plan.json", b"{}")  # the next write prepares again, and this endpoint honours it
    finally:
        backend.probe_create_only = real_probe
    assert store.read_file("plan.json") == b"{}"


def test_a_start_refused_after_the_probe_began_leaves_nothing_in_the_bucket(s3_server, s3_env, tmp_path):
    """``train`` starts the probe as soon as it has opened the store; a task that does not import is refused (exit 2)
    after that, and the process ends only once the probe has deleted its objects and aborted its upload."""
    from tests.test_train_helpers import ROOT, train_env

    (tmp_path / "usertask.py").write_text("import not_installed_package_xyz\n")
    env = {**train_env(), "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, "-m", "trainproof", "train", "--store", f"s3://{s3_env}/refused/run",
                             "--task", "usertask:make"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=budget(300))
    assert result.returncode == 2, result.stderr
    assert "not_installed_package_xyz" in result.stderr.strip().splitlines()[-1]
    client = s3_server.boto3_client()
    assert client.list_objects_v2(Bucket=s3_env, Prefix="refused/").get("KeyCount") == 0
    assert not client.list_multipart_uploads(Bucket=s3_env, Prefix="refused/").get("Uploads")
