"""A scan of the run on S3 lists the generations' files in one paged listing of the tree (``ListsTrees``), so a
flood of small ``step-*`` folders planted in a shared bucket costs a page per thousand objects instead of a request
per folder, and classifies every entry exactly as a folder-by-folder look does (on Ceph RGW)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from trainproof.storage import StoreOptions, open_store
from trainproof.storage.generations import inspect

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
