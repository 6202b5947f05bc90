"""The S3 store under injected faults: a FaultProxy (tests/support/faultproxy.py) sits on loopback between
s3fs/aiobotocore and the session's Ceph RADOS Gateway, so every fault goes through the real HTTP stack. A server
that ignores ``If-None-Match`` is simulated by the proxy deleting that header, which breaks the request's
signature on RGW: those tests run against moto, which does not check signatures.

Organised by what the store must do on S3 (trainproof/storage/s3.py says why, fact by fact):
- transient faults (503 SlowDown, 500, connection resets, lost responses, stalls) are retried by the one retry
  layer, within its budget, with one log line per retry; commits still land and verify, nothing partial is usable;
- attempts never multiply (botocore and s3fs add none; aiohttp's one re-send on a reset is pinned and documented);
- 403 fails fast; a 412 on ``COMPLETE.json`` is read back and recognised as our own write;
- the create-only probe, per-endpoint checksum settings, the multipart sweep, and discovery without a listing cache.

Stores are opened with a short RetryPolicy and read timeout so the file runs in well under a minute and a half.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import types

import pytest

from trainproof.storage.retention import RetentionPolicy
import trainproof.storage.s3
from trainproof.storage import (COMPLETE, INCOMPLETE, CommitConflictError, RetryPolicy, StoreConfigError, StoreOptions,
                     StoreUnavailableError, open_store)
from trainproof.storage.manifest import MARKER
from tests.support.timing import budget
from tests.support.faultproxy import Fault, FaultProxy

pytestmark = pytest.mark.s3

MiB = 2**20
C = "contract-faults"
LOGGER = "trainproof.storage"
# Objects of 2 x the store's part size (8 MiB: trainproof/storage/spool.py PART_SIZE) or more go up as a multipart upload.
BIG = 33 * MiB
ATTEMPT_COPY = re.compile(r"\.[0-9a-f]{12}\.pt$")  # trainproof.storage.manifest.attempt_object names


# -- fixtures and helpers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_payload():
    """One random payload big enough for the multipart path (5 parts: 4 x 8 + 1 MiB), made once."""
    return os.urandom(BIG)


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint, seed=0, upstream_timeout=30, idle_timeout=30) as p:
        yield p


def _emptied_bucket(server):
    """A unique bucket, emptied afterwards (the session's server keeps every object until it stops)."""
    name = server.create_bucket()
    yield name
    client = server.boto3_client()
    for up in client.list_multipart_uploads(Bucket=name).get("Uploads", []):
        client.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=name, Key=obj["Key"])


@pytest.fixture
def bucket(s3_server):
    yield from _emptied_bucket(s3_server)


@pytest.fixture
def moto_bucket(moto_server):
    yield from _emptied_bucket(moto_server)


@pytest.fixture
def moto_proxy(moto_server):
    with FaultProxy(moto_server.endpoint, seed=0, upstream_timeout=30, idle_timeout=30) as p:
        yield p


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    return caplog


def options(endpoint, *, attempts=8, total=30.0, read_timeout=5.0, **kw) -> StoreOptions:
    return StoreOptions.from_env(
        endpoint_url=endpoint, read_timeout=read_timeout,
        retry=RetryPolicy(attempts=attempts, total_seconds=total, initial_wait=0.01, max_wait=0.2), **kw)


def store_via(proxy, bucket, run="prefix/run", **kw):
    return open_store(f"s3://{bucket}/{run}", options(proxy.endpoint, **kw))


def prepared(store):
    """Make the store do its one-time create-only probe and multipart sweep now (the first write does it),
    so faults set afterwards hit the commit under test."""
    store.write_file("plan.json", b"{}\n")
    return store


def files_for(step, big=None):
    files = {"training_state.pt": hashlib.sha256(b"%d" % step).digest() * 10_000,  # 320 KB
             "rank-00000.pt": b"rank0-%d" % step}
    if big is not None:
        files["big.bin"] = big
    return files


def commit(store, step, files=None, **kw):
    return store.commit(step, files if files is not None else files_for(step), contract=C, world=1,
                        code_version="faults", **kw)


def retry_lines(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.getMessage().startswith("retrying")]


def settled_events(proxy, timeout=budget(3.0)):
    """The proxy's events once every request it read has its event: a handler records the event just *after*
    sending the response, so the client can raise (or go on) a moment before the last one is logged."""
    deadline = time.monotonic() + timeout
    while proxy.stats.requests > len(proxy.events) and time.monotonic() < deadline:
        time.sleep(0.01)
    return proxy.events


def requests(proxy, method, path_contains):
    return [e for e in settled_events(proxy) if e.method == method and path_contains in e.target]


def fresh(s3_server, bucket, run="prefix/run"):
    """A second client straight to the server (no proxy, no faults): what a restarted job would see."""
    return open_store(f"s3://{bucket}/{run}", options(s3_server.endpoint))


def assert_nothing_usable(s3_server, bucket, step):
    store = fresh(s3_server, bucket)
    assert [g.status for g in store.scan() if g.step == step] in ([], [INCOMPLETE])
    assert not store.backend.exists(f"{store.root}/step-{step:08d}/{MARKER}")


# -- transient faults: commits still land, within the budget, with a log line per retry --------------------
SERIES = [
    pytest.param("slowdown", {}, id="503-slowdown"),
    pytest.param("internal", {}, id="500-internal"),
    pytest.param("reset", {}, id="reset"),
    pytest.param("reset_after_forward", {}, id="reset-after-forward"),
    # a stall costs a read timeout (1 s) each: bound how many the random rule may inject
    pytest.param("stall", {"stall_s": 1.5, "max_count": 3}, id="stall"),
    pytest.param("stall_after_forward", {"stall_s": 1.5, "max_count": 3}, id="stall-after-forward"),
]


@pytest.mark.parametrize("kind, extra", SERIES)
def test_commits_land_and_verify_under_transient_faults(s3_server, proxy, bucket, big_payload, logs, kind, extra):
    store = prepared(store_via(proxy, bucket, attempts=12, total=60.0, read_timeout=1.0))
    # Opening the store checks the bucket under its own short retry budget (not counted in store.stats), and the
    # probe and sweep of `prepared` may retry too on a loaded machine (1 s read timeout): count only the retries
    # and the lines of the commits below.
    logs.clear()
    retries_before = store.stats.retries
    stall = {"stall_s": extra.get("stall_s", 1.5)}
    proxy.set_faults([
        # Deterministic: two faults in a row on one single PUT, so the store's own layer must retry at least
        # once even for resets (aiohttp absorbs one reset of an idempotent request by re-sending it).
        Fault(kind, methods={"PUT"}, path_contains="step-00000001/training_state.pt", max_count=2, **stall),
        # The multipart path meets faults too, a bounded number: whole-operation retries re-send every part, so
        # a 25% rate on every part would fail most attempts (see test_one_bad_part_does_not_fail_every_attempt).
        Fault(kind, methods={"PUT"}, path_contains="partNumber=", max_count=2, **stall),
        # A seeded 25% of every other request: HEAD, GET, LIST, PUT, POST (create/complete multipart), DELETE.
        Fault(kind, rate=0.25, when=lambda m, t, h: "partNumber=" not in t, **extra),
    ], seed=7)
    expected = {1: files_for(1), 2: files_for(2, big_payload), 3: files_for(3)}
    t0 = time.monotonic()
    for step, files in expected.items():
        info = commit(store, step, files)
        assert info.status == COMPLETE
    elapsed = time.monotonic() - t0
    proxy.clear_faults()

    injected = proxy.stats.injected.get(kind, 0)
    assert injected >= 4, proxy.fault_counts()
    assert store.stats.retries > retries_before
    assert len(retry_lines(logs)) == store.stats.retries - retries_before  # one warning line per retry, none silent
    assert elapsed < budget(60.0)
    # A restarted job (fresh client, no faults) sees three usable generations, each verifying byte for byte.
    reader = fresh(s3_server, bucket)
    assert [(g.step, g.status) for g in reader.scan(contract=C, world=1)] == [(1, COMPLETE), (2, COMPLETE), (3, COMPLETE)]
    for step, files in expected.items():
        assert reader.load(step, contract=C, world=1).files == files
    assert reader.load_latest(contract=C, world=1).info.step == 3


# -- attempts never multiply -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, method, target", [
    pytest.param("slowdown", "PUT", "step-00000001/training_state.pt", id="503-on-PUT"),
    pytest.param("internal", "PUT", "step-00000001/training_state.pt", id="500-on-PUT"),
    pytest.param("slowdown", "GET", "step-00000001/training_state.pt", id="503-on-verify-GET"),
])
def test_attempts_never_multiply_on_http_errors(s3_server, proxy, bucket, logs, kind, method, target):
    store = prepared(store_via(proxy, bucket, attempts=3))
    proxy.reset_stats()
    proxy.set_faults([Fault(kind, methods={method}, path_contains=target)])
    with pytest.raises(StoreUnavailableError, match="kept failing after retries"):
        commit(store, 1)
    # botocore (total_max_attempts=1), s3fs (retries=1) and aiohttp add nothing to the store's 3 attempts.
    assert len(requests(proxy, method, target)) == 3
    assert store.stats.retries == 2 and len(retry_lines(logs)) == 2
    proxy.clear_faults()
    assert_nothing_usable(s3_server, bucket, 1)


def test_a_reset_is_resent_once_by_aiohttp_below_the_retry_layer(s3_server, proxy, bucket, logs):
    """aiohttp re-sends an idempotent request (PUT/GET/HEAD/DELETE, not POST) once when the connection is reset
    (RFC 9112 retry of a persistent connection, ``ClientSession._retry_connection``).  So a reset costs at most
    2 x ``RetryPolicy.attempts`` requests; HTTP errors (above) cost exactly ``attempts``.  Pinned here so a
    change in either layer is noticed."""
    store = prepared(store_via(proxy, bucket, attempts=3))
    target = "step-00000001/training_state.pt"
    proxy.reset_stats()
    proxy.set_faults([Fault("reset", methods={"PUT"}, path_contains=target)])
    with pytest.raises(StoreUnavailableError):
        commit(store, 1)
    assert len(requests(proxy, "PUT", target)) == 2 * 3
    assert store.stats.retries == 2 and len(retry_lines(logs)) == 2
    proxy.clear_faults()
    assert_nothing_usable(s3_server, bucket, 1)


def test_a_stalled_endpoint_fails_the_commit_within_the_deadline(s3_server, proxy, bucket):
    """A rank whose uploads stall must fail the commit, not hang it: total_seconds bounds the whole operation
    (plus the attempt in flight when the deadline passes)."""
    store = prepared(store_via(proxy, bucket, attempts=50, total=2.0, read_timeout=1.0))
    proxy.set_faults([Fault("stall", methods={"PUT"}, path_contains="training_state.pt", stall_s=3.0)])
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError):
        commit(store, 1)
    elapsed = time.monotonic() - t0
    assert elapsed < 2.0 + budget(1.0 + 1.5), elapsed  # the deadline, then slack
    assert len(requests(proxy, "PUT", "training_state.pt")) < 50
    proxy.clear_faults()
    assert_nothing_usable(s3_server, bucket, 1)


# -- permanent errors fail fast ----------------------------------------------------------------------------
def test_forbidden_write_fails_fast_without_retrying(s3_server, proxy, bucket, logs):
    store = prepared(store_via(proxy, bucket, attempts=5))
    target = "step-00000001/training_state.pt"
    proxy.reset_stats()
    proxy.set_faults([Fault("forbidden", code="InvalidAccessKeyId", methods={"PUT"}, path_contains=target)])
    with pytest.raises(PermissionError, match="Access Key Id"):
        commit(store, 1)
    assert len(requests(proxy, "PUT", target)) == 1
    assert store.stats.retries == 0 and retry_lines(logs) == []
    proxy.clear_faults()
    assert_nothing_usable(s3_server, bucket, 1)


def test_forbidden_bucket_check_is_a_config_error_at_open(proxy, bucket, logs):
    # The check lists at most one key under the run's prefix (a prefix-scoped IAM policy allows that).
    proxy.set_faults([Fault("forbidden", methods={"GET"}, path_contains="list-type=2")])
    with pytest.raises(StoreConfigError, match="refused \\(403\\)"):
        store_via(proxy, bucket, attempts=5)
    assert len(requests(proxy, "GET", "list-type=2")) == 1
    assert retry_lines(logs) == []


# -- "a 412 can be your own write" ---------------------------------------------------------------------------
@pytest.mark.parametrize("lost", [1, 2], ids=["aiohttp-resend-gets-412", "store-retry-gets-412"])
def test_lost_response_on_complete_marker_is_recognised_as_our_own(s3_server, proxy, bucket, logs, lost):
    """The PUT of COMPLETE.json lands but its response is lost.  With one loss aiohttp's re-send gets the 412;
    with two the store's retry does.  Either way the marker is read back, the attempt id is ours, and the
    commit succeeds with exactly one COMPLETE.json."""
    store = prepared(store_via(proxy, bucket))
    proxy.reset_stats()
    proxy.set_faults([Fault("reset_after_forward", methods={"PUT"}, path_contains=MARKER, max_count=lost)])
    info = commit(store, 1)
    puts = requests(proxy, "PUT", f"step-00000001/{MARKER}")
    assert [e.outcome for e in puts] == ["reset_after_forward"] * lost + ["forwarded"]
    assert puts[-1].status == 412
    assert store.stats.retries == lost - 1
    listing = s3_server.boto3_client().list_objects_v2(Bucket=bucket, Prefix="prefix/run/step-00000001/")
    assert [o["Key"].rsplit("/", 1)[-1] for o in listing["Contents"]].count(MARKER) == 1
    stored = json.loads(fresh(s3_server, bucket).read_file(f"step-00000001/{MARKER}"))
    assert stored["attempt"] == info.manifest["attempt"]
    assert fresh(s3_server, bucket).load_latest(contract=C, world=1).info.step == 1


def test_lost_response_on_multipart_completion_is_claimed_after_checking(s3_server, proxy, bucket, big_payload, logs):
    """CompleteMultipartUpload (a POST, never re-sent by aiohttp) lands but its response is lost: s3fs aborts
    the already-completed upload, gets NoSuchUpload and raises FileNotFoundError; the store sees the object
    exists, and the read-back verify proves its bytes before the generation is marked usable."""
    store = prepared(store_via(proxy, bucket))
    proxy.set_faults([Fault("reset_after_forward", methods={"POST"}, path_contains="uploadId=", max_count=1)])
    commit(store, 1, {"big.bin": big_payload})
    assert proxy.stats.injected == {"reset_after_forward": 1}
    assert any("lost completion" in r.getMessage() for r in logs.records)
    assert fresh(s3_server, bucket).load(1).files["big.bin"] == big_payload


def test_lost_response_on_a_data_file_put_still_commits(s3_server, proxy, bucket, logs):
    """The create-only PUT of a data file lands but its response is lost; aiohttp's re-send gets 412.  The commit
    still succeeds: the existing object has our size and sha256, so it is claimed (no second copy is written)."""
    store = prepared(store_via(proxy, bucket))
    payload = files_for(1)
    proxy.set_faults([Fault("reset_after_forward", methods={"PUT"}, path_contains="step-00000001/training_state.pt",
                            max_count=1)])
    commit(store, 1, payload)
    assert proxy.stats.injected == {"reset_after_forward": 1}
    loaded = fresh(s3_server, bucket).load(1)
    assert loaded.files == payload
    assert "object" not in loaded.info.manifest["files"]["training_state.pt"]


def test_lost_response_on_an_attempt_named_copy_is_not_a_conflict(s3_server, proxy, bucket):
    """Resuming after a writer was killed mid-save: its partial training_state.pt is there, so this commit writes
    ``training_state.<attempt>.pt``; that PUT lands but its response is lost.  One lost response must not turn
    into 'another writer won'."""
    s3_server.boto3_client().put_object(Bucket=bucket, Key="prefix/run/step-00000001/training_state.pt", Body=b"half")
    store = prepared(store_via(proxy, bucket))
    payload = files_for(1)
    proxy.set_faults([Fault("reset_after_forward", methods={"PUT"}, path_regex=ATTEMPT_COPY, max_count=1)])
    commit(store, 1, payload)
    assert fresh(s3_server, bucket).load(1).files == payload


def test_lost_response_on_a_multipart_abort_is_retried(s3_server, proxy, bucket, big_payload):
    store = prepared(store_via(proxy, bucket))
    proxy.set_faults([
        Fault("slowdown", methods={"PUT"}, path_contains="partNumber=2&", max_count=1),
        Fault("reset_after_forward", methods={"DELETE"}, path_contains="uploadId=", max_count=1),
    ])
    commit(store, 1, {"big.bin": big_payload})
    assert fresh(s3_server, bucket).load(1).files["big.bin"] == big_payload


# -- lost races ------------------------------------------------------------------------------------------------
def test_a_second_writer_of_a_committed_step_gets_a_conflict(s3_server, proxy, bucket):
    first = prepared(store_via(proxy, bucket))
    second = prepared(store_via(proxy, bucket))
    commit(first, 1, {"training_state.pt": b"first"})
    with pytest.raises(CommitConflictError, match="already committed"):
        commit(second, 1, {"training_state.pt": b"second"})
    assert fresh(s3_server, bucket).load(1).files["training_state.pt"] == b"first"


def test_losing_the_marker_race_mid_commit_is_a_conflict_not_a_success(s3_server, proxy, bucket):
    """The loser passed the 'already committed?' check, wrote and verified its files, and only its create-only
    PUT of COMPLETE.json meets the winner's marker (412, another attempt id): CommitConflictError, and the
    winner's bytes are what the generation holds."""
    loser = prepared(store_via(proxy, bucket))
    winner = prepared(fresh(s3_server, bucket))  # straight to moto: runs inside the proxy's hook below
    won = {}

    def winner_commits_first(method, target, headers):
        if not won:
            won["info"] = commit(winner, 4, {"training_state.pt": b"winner"})
        return False  # observe only: the loser's PUT is then forwarded and gets 412

    proxy.set_faults([Fault("internal", methods={"PUT"}, path_contains=f"step-00000004/{MARKER}",
                            when=winner_commits_first)])
    with pytest.raises(CommitConflictError, match="committed by another writer"):
        commit(loser, 4, {"training_state.pt": b"loser"})
    assert [e.status for e in requests(proxy, "PUT", f"step-00000004/{MARKER}")] == [412]
    reader = fresh(s3_server, bucket)
    assert reader.load(4).files["training_state.pt"] == b"winner"
    assert json.loads(reader.read_file(f"step-00000004/{MARKER}"))["attempt"] == won["info"].manifest["attempt"]


# -- the create-only probe -------------------------------------------------------------------------------------
def strip_if_none_match() -> Fault:
    """A rule that never fires but deletes ``If-None-Match`` from the request the proxy forwards (``when`` gets the
    live header object the proxy relays): moto then behaves like a server that silently ignores the condition.
    (RGW refuses such a request: the header is signed.)"""

    def strip(method, target, headers):
        del headers["If-None-Match"]
        return False

    return Fault("internal", when=strip)


def test_an_endpoint_that_ignores_if_none_match_is_refused(moto_server, moto_proxy, moto_bucket):
    moto_proxy.set_faults([strip_if_none_match()])
    store = store_via(moto_proxy, moto_bucket)
    with pytest.raises(StoreConfigError, match="If-None-Match"):
        commit(store, 1)
    with pytest.raises(StoreConfigError, match="If-None-Match"):
        store.write_file("plan.json", b"{}", create_only=True)
    listing = moto_server.boto3_client().list_objects_v2(Bucket=moto_bucket, Prefix="prefix/run/")
    assert [o["Key"] for o in listing.get("Contents", [])] == []  # nothing written, probe keys cleaned up


def test_weak_create_only_mode_proceeds_with_a_warning(moto_server, moto_proxy, moto_bucket, logs):
    moto_proxy.set_faults([strip_if_none_match()])
    store = store_via(moto_proxy, moto_bucket, create_only="weak")
    commit(store, 1)
    assert any("ignores create-only writes" in r.getMessage() and r.levelno == logging.WARNING for r in logs.records)
    assert fresh(moto_server, moto_bucket).load_latest(contract=C, world=1).info.step == 1


@pytest.mark.parametrize("server, honoured", [("s3_server", False), ("moto_server", True)], ids=["rgw", "moto"])
def test_the_probe_tells_whether_multipart_completions_are_create_only(server, honoured, request, logs):
    """Ceph RGW 16 completes a multipart upload over an existing key despite ``If-None-Match: *`` (and replaces
    the object); moto refuses it with 412 as AWS does. The probe leaves neither an object nor an open upload."""
    srv = request.getfixturevalue(server)
    name = srv.create_bucket()
    store = prepared(open_store(f"s3://{name}/prefix/run", options(srv.endpoint)))
    assert store.backend.multipart_create_only is honoured
    said = [r for r in logs.records if "completes a multipart upload over an existing object" in r.getMessage()]
    assert len(said) == (0 if honoured else 1)
    client = srv.boto3_client()
    assert [o["Key"] for o in client.list_objects_v2(Bucket=name).get("Contents", [])] == ["prefix/run/plan.json"]
    assert client.list_multipart_uploads(Bucket=name).get("Uploads", []) == []


def test_a_lost_response_on_a_multipart_claim_still_commits(s3_server, proxy, bucket, big_payload):
    """On RGW a large file's key is claimed by an empty create-only PUT first. aiohttp re-sends that PUT after the
    lost response, gets 412 from our own claim, and the commit takes the taken-name path: a copy under this
    attempt's name, which the manifest names and which verifies."""
    store = prepared(store_via(proxy, bucket))
    assert store.backend.multipart_create_only is False

    def empty_put(method, target, headers):
        return headers.get("Content-Length") == "0" and "big.bin" in target and "uploadId" not in target

    proxy.set_faults([Fault("reset_after_forward", methods={"PUT"}, when=empty_put, max_count=1)])
    commit(store, 1, files_for(1, big_payload))
    assert proxy.stats.injected["reset_after_forward"] == 1
    loaded = fresh(s3_server, bucket).load(1)
    assert loaded.files["big.bin"] == big_payload
    assert re.search(r"^big\.[0-9a-f]{12}\.bin$", loaded.info.manifest["files"]["big.bin"]["object"])


def test_probe_survives_a_lost_response_on_its_first_put(s3_server, proxy, bucket):
    proxy.set_faults([Fault("reset_after_forward", methods={"PUT"}, path_contains=".trainproof-probe/",
                            max_count=1)])
    store = store_via(proxy, bucket)
    commit(store, 1)
    assert fresh(s3_server, bucket).load_latest(contract=C, world=1).info.step == 1


# -- checksums per endpoint -------------------------------------------------------------------------------------
CHECKSUM_HEADERS = ("x-amz-checksum-", "x-amz-sdk-checksum-algorithm")


@pytest.mark.parametrize("mode, expect_sent", [("auto", False), ("when_supported", True)])
def test_checksum_headers_follow_the_endpoint_setting(proxy, bucket, big_payload, mode, expect_sent):
    """With a custom endpoint, ``auto`` means botocore's ``when_required``: no CRC headers on PutObject/UploadPart
    (which MinIO/Ceph may reject) and no x-amz-checksum-mode on GET; ``when_supported`` sends them."""
    seen = []

    def record(method, target, headers):
        seen.append((method, target, {k.lower() for k in headers.keys()}))
        return False

    proxy.set_faults([Fault("internal", when=record)])
    store = store_via(proxy, bucket, checksum=mode)
    commit(store, 1, files_for(1, big_payload))
    puts = [(t, h) for m, t, h in seen if m == "PUT" and "/step-00000001/" in t]
    assert any("partNumber=" in t for t, _ in puts) and any("training_state.pt" in t for t, _ in puts)
    for target, headers in puts:
        sent = any(h.startswith(CHECKSUM_HEADERS) for h in headers)
        assert sent == expect_sent, (target, sorted(headers))
    gets = [h for m, t, h in seen if m == "GET" and "/step-00000001/" in t]
    assert gets and all(("x-amz-checksum-mode" in h) == expect_sent for h in gets)


# -- multipart sweep -------------------------------------------------------------------------------------------
def _uploads(client, bucket):
    return sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def _start_upload(client, bucket, key):
    up = client.create_multipart_upload(Bucket=bucket, Key=key)
    client.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"x" * 1024)
    return up


def test_unfinished_multipart_uploads_under_the_run_are_swept_on_first_write(s3_server, bucket, logs):
    client = s3_server.boto3_client()
    mine = "prefix/run/step-00000001/training_state.pt"
    others = ["prefix/run2/step-00000001/training_state.pt", "elsewhere/x.bin"]  # a sibling run, another prefix
    for key in [mine, *others]:
        _start_upload(client, bucket, key)
    store = open_store(f"s3://{bucket}/prefix/run", options(s3_server.endpoint, sweep_multipart_older_than=0))
    store.scan()
    assert _uploads(client, bucket) == sorted([mine, *others])  # reading never sweeps
    store.write_file("plan.json", b"{}")
    assert _uploads(client, bucket) == sorted(others)
    assert any("aborted an unfinished multipart upload" in r.getMessage() and mine in r.getMessage()
               for r in logs.records)


def test_a_fresh_upload_is_left_alone_with_the_default_threshold(s3_server, bucket, monkeypatch):
    """With the default (3600 s), a live writer's upload is not touched.  moto reports every upload's
    ``Initiated`` as 2010-11-10T20:48:33Z, so the store's clock is set to 10 s after it (on moto the default
    would otherwise sweep everything; real S3 and MinIO report the real time)."""
    client = s3_server.boto3_client()
    key = "prefix/run/step-00000001/training_state.pt"
    _start_upload(client, bucket, key)
    initiated = client.list_multipart_uploads(Bucket=bucket)["Uploads"][0]["Initiated"].timestamp()
    monkeypatch.setattr(trainproof.storage.s3, "time", types.SimpleNamespace(time=lambda: initiated + 10.0))
    store = open_store(f"s3://{bucket}/prefix/run", options(s3_server.endpoint))
    assert store.options.sweep_multipart_older_than == 3600.0
    store.write_file("plan.json", b"{}")
    assert _uploads(client, bucket) == [key]
    # ...and the same upload, an hour and a bit later, is swept by the next store that writes.
    monkeypatch.setattr(trainproof.storage.s3, "time", types.SimpleNamespace(time=lambda: initiated + 3601.0))
    open_store(f"s3://{bucket}/prefix/run", options(s3_server.endpoint)).write_file("summary.json", b"{}")
    assert _uploads(client, bucket) == []


# -- discovery never trusts a listing cache ------------------------------------------------------------------------
def test_discovery_sees_another_clients_commit_at_once(s3_server, proxy, bucket):
    a = store_via(proxy, bucket)
    b = prepared(fresh(s3_server, bucket))
    assert a.scan() == [] and a.load_latest(contract=C, world=1) is None
    commit(b, 1)
    assert [(g.step, g.status) for g in a.scan()] == [(1, COMPLETE)]
    assert a.load_latest(contract=C, world=1).info.step == 1
    commit(b, 2)
    assert a.load_latest(contract=C, world=1).info.step == 2
    # and a generation deleted by the other client disappears from this one's view just as fast
    b.apply_retention(RetentionPolicy(keep=1, grace_seconds=0))
    assert [g.step for g in a.scan()] == [2]


# -- whole-operation retries and big multipart writes ----------------------------------------------------------------
def test_one_bad_part_does_not_fail_every_attempt(s3_server, proxy, bucket, big_payload):
    """Every upload meets one throttled part (the first try of part 2), as a P-part upload does whenever P x r >= 1.
    Retrying that part alone would succeed on the first attempt; retrying the whole upload never does."""
    store = prepared(store_via(proxy, bucket, attempts=4))
    first_tries = set()

    def first_try_of_part_2(method, target, headers):
        if "partNumber=2&" not in target and not target.endswith("partNumber=2"):
            return False
        upload = target.split("uploadId=", 1)[1].split("&", 1)[0]
        if upload in first_tries:
            return False
        first_tries.add(upload)
        return True

    proxy.set_faults([Fault("slowdown", methods={"PUT"}, when=first_try_of_part_2)])
    commit(store, 1, {"big.bin": big_payload})
    assert fresh(s3_server, bucket).load(1).files["big.bin"] == big_payload


@pytest.mark.parametrize("kind", ["slowdown", "reset"])
def test_parts_uploaded_while_the_file_is_written_are_retried_alone(s3_server, proxy, bucket, big_payload, logs,
                                                                   tmp_path, kind):
    """A state uploaded while its serialising thread writes it (``LiveSpool``, the trainer's S3 commits): faults on
    its parts are retried part by part, and the commit lands with the writer's bytes."""
    from trainproof.storage.spool import LiveSpool

    store = prepared(store_via(proxy, bucket, attempts=6, total=60.0, read_timeout=1.0))
    logs.clear()
    before = store.stats.retries
    proxy.set_faults([Fault(kind, methods={"PUT"}, path_contains="partNumber=", max_count=3)], seed=7)
    view = memoryview(big_payload)

    def fill(out):  # 1 MiB every 10 ms: the upload starts long before the file is whole
        for at in range(0, len(view), MiB):
            out.write(view[at:at + MiB])
            time.sleep(0.01)

    live = LiveSpool.serialise(fill, str(tmp_path), expected=len(view))
    try:
        commit(store, 1, {"training_state.pt": live})
    finally:
        live.unlink()
    assert proxy.stats.injected.get(kind, 0) == 3, proxy.fault_counts()
    assert store.stats.retries - before >= 1 and any("part" in r.getMessage() for r in retry_lines(logs))
    assert fresh(s3_server, bucket).load(1).files["training_state.pt"] == big_payload


@pytest.mark.parametrize("size, part, expected", [
    (1 * MiB, 8 * MiB, 8 * MiB),
    (10_000 * 8 * MiB, 8 * MiB, 8 * MiB),  # exactly 10 000 parts: the configured size still fits
    (10_000 * 8 * MiB + 1, 8 * MiB, 9 * MiB),
    (100 * 10**9, 8 * MiB, 10 * MiB),  # a 100 GB state (8 MiB parts would be 11 921)
    (5 * 2**40, 8 * MiB, 525 * MiB),  # S3's largest object
])
def test_the_part_size_grows_so_no_upload_needs_more_than_10000_parts(size, part, expected):
    got = trainproof.storage.s3.part_size_for(size, part)
    assert got == expected and -(-size // got) <= trainproof.storage.s3.MAX_PARTS and got % MiB == 0


def test_an_upload_over_the_part_limit_goes_up_in_larger_parts(s3_server, proxy, bucket, big_payload, monkeypatch):
    monkeypatch.setattr(trainproof.storage.s3, "MAX_PARTS", 3)  # 33 MiB in 8 MiB parts would be 5: 11 MiB parts instead
    store = prepared(store_via(proxy, bucket))
    commit(store, 1, {"big.bin": big_payload})
    parts = [e for e in requests(proxy, "PUT", "partNumber=") if "big.bin" in e.target]
    assert len(parts) == 3 and {e.status for e in parts} == {200}
    assert fresh(s3_server, bucket).load(1).files["big.bin"] == big_payload
