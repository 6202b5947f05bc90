"""Each safety check of the commit, proven on every backend by a store whose layer below misbehaves
(tests/support/tamper.py wraps the real backend): the read-back sha256 comparison, the read-back of
COMPLETE.json after a 412, and credentials never reaching a message."""

from __future__ import annotations

import json
import logging

import pytest

from trainproof.storage import (INCOMPLETE, CommitConflictError, CorruptGenerationError, RetryPolicy, StoreConfigError,
                     StoreOptions, StoreUnavailableError, open_store)
from trainproof.storage.backend import join
from trainproof.storage.limits import redact_url
from trainproof.storage.manifest import MARKER
from tests.support.tamper import flip_first_byte, wrap

C = "contract-s"
FILES = {"training_state.pt": b"precious state " * 200, "meta.json": b'{"step": 1}'}


def commit(store, step=1, **kw):
    return store.commit(step, dict(FILES), contract=C, world=1, code_version="t", **kw)


def only_state(alter):
    return lambda path, data: alter(path, data) if path.endswith("training_state.pt") else data


@pytest.mark.parametrize("with_check", [False, True], ids=["no-check", "with-a-content-check"])
def test_read_back_that_differs_from_what_was_written_is_never_marked_usable(store_url, with_check):
    """The store hands back other bytes of the same size (a faulty disk or proxy): the commit refuses and no
    COMPLETE.json is written, with or without a content check (the read-back is compared with the written bytes)."""
    store = wrap(open_store(store_url), alter_read=only_state(flip_first_byte))
    check = (lambda name, data: None) if with_check else None
    with pytest.raises(CorruptGenerationError, match="read back from the store differs"):
        commit(store, check=check)
    assert not store.backend.inner.exists(join(store.root, "step-00000001", MARKER))
    assert [g.status for g in open_store(store_url).scan()] == [INCOMPLETE]


def test_read_back_that_is_longer_than_written_is_refused(store_url):
    store = wrap(open_store(store_url), alter_read=only_state(lambda p, d: d + b"!"))
    with pytest.raises(CorruptGenerationError, match="differs"):
        commit(store)
    assert not store.backend.inner.exists(join(store.root, "step-00000001", MARKER))


def lose_marker_response(path, create_only, write):
    """The create-only PUT of COMPLETE.json lands, its response is lost, and the re-send gets 412."""
    if path.endswith(MARKER) and create_only:
        write()
        raise FileExistsError(path)
    return write()


def test_a_412_on_our_own_marker_is_read_back_and_recognised(store_url):
    store = wrap(open_store(store_url), on_write=lose_marker_response)
    info = commit(store)
    stored = json.loads(store.backend.inner.read(join(store.root, "step-00000001", MARKER)))
    assert stored["attempt"] == info.manifest["attempt"]
    assert open_store(store_url).load_latest(contract=C, world=1).info.step == 1


def test_a_412_on_another_writers_marker_is_a_conflict(store_url):
    theirs = {}

    def another_writer_wins(path, create_only, write):
        if path.endswith(MARKER) and create_only and not theirs:
            winner = open_store(store_url)
            theirs["info"] = winner.commit(1, {"training_state.pt": b"winner"}, contract=C, world=1, code_version="t")
        return write()

    store = wrap(open_store(store_url), on_write=another_writer_wins)
    with pytest.raises(CommitConflictError, match="committed by another writer"):
        commit(store)
    assert open_store(store_url).load(1).files["training_state.pt"] == b"winner"


def test_a_412_with_an_unreadable_marker_is_a_conflict(store_url):
    """Someone else's junk where our marker should be: never taken for our own commit."""
    def junk_marker(path, create_only, write):
        if path.endswith(MARKER) and create_only:
            store.backend.inner.write(path, b"[" * 50_000)
            raise FileExistsError(path)
        return write()

    store = wrap(open_store(store_url), on_write=junk_marker)
    with pytest.raises(CommitConflictError):
        commit(store)


@pytest.mark.parametrize("url, expected", [
    ("s3://AKIAKEY:sekrit/with+chars@bucket/prefix/run", "s3://***@bucket/prefix/run"),
    ("s3://AKIAKEY:sekrit@bucket/prefix/run", "s3://***@bucket/prefix/run"),
    ("s3://token@bucket/run", "s3://***@bucket/run"),
    ("http://user:pw@minio:9000", "http://***@minio:9000"),
    ("s3://bucket/prefix/run", "s3://bucket/prefix/run"),
    ("s3://bucket/we@ird/key", "s3://bucket/we@ird/key"),
    ("/data/runs/a@b", "/data/runs/a@b"),
    ("memory://name/run", "memory://name/run"),
    ("s3://k:s@[bad/run", "s3://***@[bad/run"),
    ("http://minio:9000/a@b", "http://minio:9000/a@b"),
    ("s3://AKIA:ab/cd@bucket/we@ird", "s3://***@bucket/we@ird"),
])
def test_redact_url_strips_user_info(url, expected):
    assert redact_url(url) == expected


@pytest.mark.parametrize("userinfo", ["AKIAKEY:sekrit-value", "AKIAKEY:sekrit/value+x", "AKIAKEY"])
def test_credentials_in_an_s3_url_are_refused_without_being_printed(s3_env, userinfo):
    with pytest.raises(StoreConfigError) as err:
        open_store(f"s3://{userinfo}@{s3_env}/run")
    assert "sekrit" not in str(err.value) and "AKIAKEY" not in str(err.value)
    assert "***@" in str(err.value)


def test_store_messages_never_carry_user_info(caplog):
    """A retry budget running out names the store: with the URL redacted."""
    store = open_store("memory://user:sekrit-pw@tp-redact/run",
                       StoreOptions(retry=RetryPolicy(attempts=2, total_seconds=5, initial_wait=0.0, max_wait=0.0)))
    assert "sekrit-pw" not in repr(store)

    def unreachable(path):
        raise ConnectionResetError("reset by peer")

    store.backend.read = unreachable
    with caplog.at_level(logging.WARNING, logger="trainproof.storage"), pytest.raises(StoreUnavailableError) as err:
        store.read_file("plan.json")
    assert "***@" in str(err.value) and "sekrit-pw" not in str(err.value)
    assert all("sekrit-pw" not in r.getMessage() for r in caplog.records)


def test_a_wrong_sized_object_is_refused_from_the_listing_without_reading_it(store_url):
    """The object in the store is not the size that was written (a racing writer appended): the listing says so
    and the commit refuses before reading a byte of it."""
    def append_after_writing(path, create_only, write):
        out = write()
        if path.endswith("training_state.pt"):
            store.backend.inner.write(path, FILES["training_state.pt"] + b"appended")
        return out

    store = wrap(open_store(store_url), on_write=append_after_writing)
    with pytest.raises(CorruptGenerationError, match="were written"):
        commit(store)
    assert store.backend.bytes_read.get(join(store.root, "step-00000001", "training_state.pt"), 0) == 0
    assert not store.backend.inner.exists(join(store.root, "step-00000001", MARKER))
