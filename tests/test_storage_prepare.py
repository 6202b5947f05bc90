"""A writer prepares an S3 store for writing (the create-only probe, the sweep of stale multipart uploads) on a thread
of its own while it sets up (``GenerationStore.prepare_soon``): its first write waits for it and raises what it
raised, and a write after that tries again (on Ceph RGW)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

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
