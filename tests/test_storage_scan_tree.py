"""A scan of the run on S3 lists the generations' files in one paged listing of the tree (``ListsTrees``), so a
flood of small ``step-*`` folders planted in a shared bucket costs a page per thousand objects instead of a request
per folder, and classifies every entry exactly as a folder-by-folder look does (on Ceph RGW)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from trainproof.storage import StoreOptions, open_store
from trainproof.storage.backend import Entry
from trainproof.storage.generations import Ctx, inspect, scan_capped
from trainproof.storage.limits import Limits

FLOOD = 400


def _plant(client, bucket: str, keys: list[str]) -> None:
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda key: client.put_object(Bucket=bucket, Key=key, Body=b""), keys))


def test_a_scan_lists_a_flood_of_folders_in_pages_and_classifies_each_as_alone(s3_env, s3_server):
    url = f"s3://{s3_env}/flood/run"
    options = StoreOptions.from_env()
    options = replace(options, limits=replace(options.limits, scan_entries=5))
    store = open_store(url, options)
    for step in (1, 2):
        store.commit(step, {"state.pt": bytes([step]) * 1000}, contract="c", world=1, code_version="v")
    keys = [f"flood/run/step-{90000000 + i:08d}/x" for i in range(FLOOD)]  # empty objects: no COMPLETE.json
    keys += [f"flood/run/step-00000003/deep/{i}" for i in range(3)]  # a folder of folders
    keys += [f"flood/run/step-00000005/o{i:02d}" for i in range(40)]  # over Limits.scan_entries: corrupt, cut
    keys += ["flood/run/step-00000004", "flood/run/step-00000002/extra"]  # an object named like a folder; an extra
    _plant(s3_server.boto3_client(), s3_env, keys)

    calls = []
    fs = store.backend.fs
    real = fs.call_s3

    def counted(method, *args, **kwargs):
        calls.append(method)
        return real(method, *args, **kwargs)

    fs.call_s3 = counted
    try:
        found = store.scan(contract="c", world=1)
    finally:
        fs.call_s3 = real
    listings = calls.count("list_objects_v2")
    # One listing of the root (a page per thousand folders) and one of the tree (a page per thousand objects, the
    # cut folder skipped past): a request per folder would be over FLOOD.
    assert listings <= 6, listings

    by_name = {g.name: g for g in found}
    assert len(by_name) == FLOOD + 5
    assert [by_name[f"step-{s:08d}"].status for s in (1, 2)] == ["complete", "complete"]
    assert by_name["step-00000005"].status == "corrupt" and "scan_entries" in by_name["step-00000005"].reason
    alone = {g.name: inspect(store._ctx, g.name, contract="c", world=1) for g in found}
    assert {n: (g.status, g.reason, g.bytes) for n, g in by_name.items()} == {
        n: (g.status, g.reason, g.bytes) for n, g in alone.items()}


def test_a_scan_reads_the_markers_and_lists_the_tree_at_once_and_finds_what_one_at_a_time_finds(s3_env, s3_server):
    """A resume or a retention scans the run: on S3 its two listings run together and the generations' COMPLETE.json
    are read ``concurrency`` at a time, so a run keeping milestones does not pay a round trip per generation after
    the other. Each gated request waits for a second one to be in flight: done one after the other, the scan fails."""
    store = open_store(f"s3://{s3_env}/together/run", StoreOptions.from_env())
    for step in (1, 2, 3, 5):
        store.commit(step, {"state.pt": bytes([step]) * 1000}, contract="c", world=1, code_version="v")
    _plant(s3_server.boto3_client(), s3_env, ["together/run/step-00000004/x",  # partial: no marker
                                              "together/run/step-00000006/COMPLETE.json"])  # a marker alone: corrupt

    barriers = {"listing": threading.Barrier(2, timeout=20), "marker": threading.Barrier(2, timeout=20)}
    met: list[str] = []
    lock = threading.Lock()

    def gate(kind: str) -> None:
        with lock:
            first_two = met.count(kind) < 2
            met.append(kind)
        if first_two:
            barriers[kind].wait()  # BrokenBarrierError after 20 s alone: the scan fails

    backend, fs = store.backend, store.backend.fs
    real_call, real_iter_read = fs.call_s3, backend.iter_read

    def call_s3(method, *args, **kwargs):
        if method == "list_objects_v2":
            gate("listing")
        return real_call(method, *args, **kwargs)

    def iter_read(path, *args, **kwargs):
        if path.endswith("/COMPLETE.json"):
            gate("marker")
        return real_iter_read(path, *args, **kwargs)

    fs.call_s3, backend.iter_read = call_s3, iter_read
    try:
        found = store.scan(contract="c", world=1)
    finally:
        fs.call_s3, backend.iter_read = real_call, real_iter_read
    assert met.count("listing") >= 2 and met.count("marker") == 5
    alone = {n: inspect(store._ctx, n, contract="c", world=1) for n in (f"step-{s:08d}" for s in range(1, 7))}
    assert [g.name for g in found] == sorted(alone)  # ascending, as one at a time
    assert {g.name: (g.status, g.reason, g.bytes) for g in found} == {
        n: (g.status, g.reason, g.bytes) for n, g in alone.items()}
    assert [g.status for g in found] == ["complete", "complete", "complete", "incomplete", "complete", "corrupt"]


def test_a_failed_listing_of_the_generations_stops_the_listing_of_their_files_beside_it():
    """The listing of the generations' files runs beside the listing of the generations: when the latter fails, the
    scan raises its error after the other listing's next page, not after it has listed a whole flood (or run into
    ``Limits.scan_seconds``)."""
    listed = [0]

    class Flooded:  # a bucket whose tree listing never ends, and whose folder listing is refused
        parallel_ranges = True

        def iterdir(self, path, *, prefix=""):
            raise PermissionError("listing refused")
            yield  # a generator, as S3's pages are

        def itertree(self, path, *, prefix="", cap=None):
            while True:
                listed[0] += 1
                yield "step-flood", Entry("x", 0, False, None)  # not a generation's folder: kept nowhere

    limits = replace(Limits(), scan_seconds=60.0)
    ctx = Ctx(backend=Flooded(), root="bucket/run", io=lambda _what, fn: fn(), limits=limits)
    with pytest.raises(PermissionError, match="listing refused"):
        scan_capped(ctx)
    assert 0 < listed[0] < 1_000_000, listed  # stopped at its next page (about 20 million in 60 s)
