"""A generation fetched ahead (``GenerationStore.fetch_ahead``) is used only when it is the one the load reaches.

The load that asks takes it when it reaches the same generation with the same manifest, the same files and spool
settings, and then reads none of its files again; any other case (a generation committed after the fetch, the same
step committed again with other bytes, other files wanted, a fetch that failed or whose content check refuses)
ends exactly as a load without it, and leaves no file of the fetch behind. Every backend (memory://, a local folder,
S3 over HTTP on loopback) for the first; the others on a local folder, where the paths are the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import replace

import pytest

from trainproof.storage import CorruptGenerationError, StoreOptions, open_store
from trainproof.storage.ahead import FetchCancelled
from trainproof.storage.spool import Spool
from tests.support.timing import budget
from tests.test_storage_spool import _spool

PART = 5 * 2**20
C = "contract-ahead"
STATE = "training_state.pt"


def _store(url: str):
    return open_store(url, replace(StoreOptions.from_env(), part_size=PART, concurrency=2))


def _commit(store, step: int, tmp_path, seed: int | None = None, size: int = 11 * 2**20 + 7,
            contract: str = C) -> dict[str, bytes]:
    """Generation ``step``: a state of a few parts and a small file; what each holds."""
    spool = _spool(tmp_path, size, step if seed is None else seed)
    small = f"small of {step} {seed}".encode()
    store.commit(step, {STATE: spool, "history.pt": small}, contract=contract, world=1, code_version="t")
    with open(spool.path, "rb") as fh:
        state = fh.read()
    spool.unlink()
    return {STATE: state, "history.pt": small}


class Reads:
    """Counts the bytes of ranged reads by path on a store's backend; ``hold`` (a path fragment) makes reads of
    matching paths wait for ``go`` (``entered`` is set when one waits)."""

    def __init__(self, store, hold: str | None = None) -> None:
        self.bytes: dict[str, int] = {}
        self.hold, self.go, self.entered = hold, threading.Event(), threading.Event()
        inner, lock = store.backend.read_range, threading.Lock()

        def read_range(path, start, end):
            if self.hold and self.hold in path:
                self.entered.set()
                assert self.go.wait(budget(30)), "the held read was never released"
            data = inner(path, start, end)
            with lock:
                self.bytes[path] = self.bytes.get(path, 0) + len(data)
            return data

        store.backend.read_range = read_range

    def of(self, step: int) -> int:
        return sum(n for p, n in self.bytes.items() if f"step-{step:08d}/" in p and p.endswith(STATE))


def _contents(loaded) -> dict[str, bytes]:
    out = {}
    for name, data in loaded.files.items():
        if isinstance(data, Spool):
            with open(data.path, "rb") as fh:
                out[name] = fh.read()
        else:
            out[name] = bytes(data)
    return out


def _first(store, spool_dir, check=None, **kw):
    return next(store.usable(contract=C, check=check, spool_dir=str(spool_dir), spool_from=0, **kw))


def _read_itself(store, spool_dir, step: int, wrote: dict[str, bytes], **kw) -> None:
    """The first usable generation is ``step``, holding ``wrote``, read by the load itself (not fetched ahead)."""
    loaded = _first(store, spool_dir, **kw)
    try:
        assert loaded.info.name == f"step-{step:08d}" and store.fetched_ahead is None
        assert _contents(loaded) == wrote
    finally:
        loaded.close()


def test_the_load_takes_the_generation_fetched_ahead_and_reads_none_of_it_again(store_url, tmp_path):
    store = _store(store_url)
    _commit(store, 1, tmp_path)
    wrote = _commit(store, 2, tmp_path)
    reads, spools = Reads(store), tmp_path / "spools"
    store.fetch_ahead(lambda: C, spool_dir=str(spools), spool_from=0)
    ahead = store._ahead
    ahead._thread.join(budget(60))
    fetched = reads.of(2)
    assert fetched >= len(wrote[STATE]) and ahead.error is None, ahead.error
    checked = []
    loaded = _first(store, spools, check=lambda name, data: checked.append((name, type(data).__name__)))
    try:
        assert loaded.info.name == "step-00000002" and store.fetched_ahead == "step-00000002"
        assert reads.of(2) == fetched, "the load read the fetched state again"
        assert reads.of(1) == 0
        assert _contents(loaded) == wrote
        assert sorted(checked) == [("history.pt", "Spool"), (STATE, "Spool")], "the content check ran on each file"
    finally:
        loaded.close()
    assert os.listdir(spools) == []
    assert store._ahead is None, "taken once"


def test_a_generation_committed_after_the_fetch_began_is_loaded_and_the_fetch_is_cancelled(tmp_path):
    store = _store(str(tmp_path / "run"))
    _commit(store, 1, tmp_path)
    reads, spools = Reads(store, hold="step-00000001/"), tmp_path / "spools"
    store.fetch_ahead(lambda: C, spool_dir=str(spools), spool_from=0)
    ahead = store._ahead
    assert reads.entered.wait(budget(30)), "the fetch never began reading step 1"
    wrote = _commit(store, 2, tmp_path)  # committed while the fetch of step 1 is under way
    try:
        _read_itself(store, spools, 2, wrote)
    finally:
        reads.go.set()
    ahead._thread.join(budget(30))
    assert isinstance(ahead.error, FetchCancelled), ahead.error
    assert os.listdir(spools) == [], "the cancelled fetch deleted its partial file"


def test_the_same_step_committed_again_with_other_bytes_is_read_again(tmp_path):
    """A fetch of step 2, then step 2 quarantined and committed again (another manifest at the same name): the
    load reads the new one, never the fetched bytes, though they verified against the old manifest."""
    store = _store(str(tmp_path / "run"))
    _commit(store, 1, tmp_path)
    _commit(store, 2, tmp_path)
    spools = tmp_path / "spools"
    store.fetch_ahead(lambda: C, spool_dir=str(spools), spool_from=0)
    store._ahead._thread.join(budget(60))
    store.quarantine(2, "test: committed again")
    wrote = _commit(store, 2, tmp_path, seed=99)
    _read_itself(store, spools, 2, wrote)
    assert os.listdir(spools) == []


@pytest.mark.parametrize("differs", ["files", "spool_dir"])
def test_a_load_of_other_files_or_into_another_folder_reads_them_itself(tmp_path, differs):
    store = _store(str(tmp_path / "run"))
    wrote = _commit(store, 1, tmp_path)
    spools = tmp_path / "spools"
    store.fetch_ahead(lambda: C, spool_dir=str(spools), spool_from=0)
    store._ahead._thread.join(budget(60))
    reads = Reads(store)
    if differs == "files":
        loaded = _first(store, spools, skip=lambda name: name == "history.pt")
        wanted = {STATE: wrote[STATE]}
    else:
        loaded = _first(store, tmp_path / "elsewhere")
        wanted = wrote
    try:
        assert store.fetched_ahead is None and reads.of(1) >= len(wrote[STATE])
        assert _contents(loaded) == wanted
    finally:
        loaded.close()
    assert os.listdir(spools) == [], "what was fetched and not taken is deleted"


@pytest.mark.parametrize("fault", ["damaged", "refused"])
def test_a_fetch_that_fails_or_is_refused_ends_as_a_load_without_it(tmp_path, fault):
    """A state damaged after its commit (the fetch fails its sha256) or refused by the caller's content check (the
    fetch verified it): generation 2 is skipped and quarantined, generation 1 loaded, as without a fetch ahead."""
    store = _store(str(tmp_path / "run"))
    wrote = _commit(store, 1, tmp_path)
    _commit(store, 2, tmp_path)
    if fault == "damaged":
        path = tmp_path / "run" / "step-00000002" / STATE
        data = bytearray(path.read_bytes())
        data[PART + 3] ^= 1
        path.write_bytes(bytes(data))
    spools, reads = tmp_path / "spools", Reads(store)
    store.fetch_ahead(lambda: C, spool_dir=str(spools), spool_from=0)
    ahead = store._ahead
    ahead._thread.join(budget(60))
    assert isinstance(ahead.error, CorruptGenerationError) == (fault == "damaged"), ahead.error
    size = len(wrote[STATE])
    assert reads.of(2) == size  # a mismatch is not read again by the fetch: the resume's own reads judge it

    def check(name, data):
        if fault == "refused" and name == STATE and data.size == len(wrote[STATE]) and \
                open(data.path, "rb").read() != wrote[STATE]:
            raise ValueError("not a state of this run")

    loaded = _first(store, spools, check=check)
    try:
        assert loaded.info.name == "step-00000001" and _contents(loaded) == wrote
    finally:
        loaded.close()
    # The load read the damaged state twice itself (once more after a mismatch), the refused one not again.
    assert reads.of(2) == (3 if fault == "damaged" else 1) * size
    assert [name for name, _ in store.quarantined()] and not (tmp_path / "run" / "step-00000002").exists()
    assert os.listdir(spools) == []


def test_only_the_runs_own_contract_is_fetched_and_a_fresh_run_fetches_nothing(tmp_path):
    """A newer complete generation of another contract (planted in an unsigned bucket, say) is never downloaded:
    the fetch takes the newest of the contract the caller names, and nothing when it names none (no plan yet)."""
    store = _store(str(tmp_path / "run"))
    wrote = _commit(store, 1, tmp_path)
    _commit(store, 9, tmp_path, contract="someone-else")
    reads, spools = Reads(store), tmp_path / "spools"
    os.makedirs(spools)
    store.fetch_ahead(lambda: None, spool_dir=str(spools), spool_from=0)
    store._ahead._thread.join(budget(60))
    assert store._ahead.info is None and reads.bytes == {} and os.listdir(spools) == []
    store.discard_ahead()
    store.fetch_ahead(lambda: C, spool_dir=str(spools), spool_from=0)
    store._ahead._thread.join(budget(60))
    assert reads.of(9) == 0 and reads.of(1) >= len(wrote[STATE])
    loaded = _first(store, spools)
    try:
        assert loaded.info.name == "step-00000001" and store.fetched_ahead == "step-00000001"
        assert _contents(loaded) == wrote
    finally:
        loaded.close()


def test_a_load_refuses_a_generation_of_another_contract_though_it_was_fetched(tmp_path):
    """``load(step, contract=...)`` of a generation that is not this contract's raises as without a fetch ahead."""
    store = _store(str(tmp_path / "run"))
    _commit(store, 1, tmp_path)
    spools = tmp_path / "spools"
    store.fetch_ahead(lambda: C, spool_dir=str(spools), spool_from=0)
    store._ahead._thread.join(budget(60))
    with pytest.raises(CorruptGenerationError, match="contract"):
        store.load(1, contract="another", spool_dir=str(spools), spool_from=0)
    assert store.fetched_ahead is None and os.listdir(spools) == []


def test_a_fetch_no_load_took_is_deleted_when_the_caller_is_done_loading(tmp_path):
    store = _store(str(tmp_path / "run"))
    _commit(store, 1, tmp_path)
    spools = tmp_path / "spools"
    store.fetch_ahead(lambda: C, spool_dir=str(spools), spool_from=0)
    ahead = store._ahead
    ahead._thread.join(budget(60))
    assert len(os.listdir(spools)) == 2
    store.discard_ahead()
    assert os.listdir(spools) == [] and store._ahead is None
    store.discard_ahead()  # nothing left to discard: no error


SCRIPT = """
import os, sys, time
from dataclasses import replace
from trainproof.storage import StoreOptions, open_store
from trainproof.storage.ahead import wind_up
store = open_store(sys.argv[1], replace(StoreOptions.from_env(), part_size=5 * 2**20, concurrency=2))
inner, when = store.backend.read_range, sys.argv[3]
def slow(path, a, b):
    time.sleep(0 if when == "done" else 0.3)
    return inner(path, a, b)
store.backend.read_range = slow
store.fetch_ahead(lambda: "contract-ahead", spool_dir=sys.argv[2], spool_from=0)
if when == "done":
    store._ahead._thread.join(60)
    assert store._ahead.error is None and store._ahead._loaded is not None
else:  # until the download's file exists: the fetch is under way (40 MiB at 0.3 s a 5 MiB read, 2 at once)
    deadline = time.monotonic() + 30
    while not os.listdir(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.listdir(sys.argv[2]) and store._ahead._thread.is_alive()
if when.startswith("discarded"):  # as the resume does when it took nothing: cancelled, still running
    store.discard_ahead()
print("exiting", flush=True)
if when == "discarded, os._exit":  # a rank of a world > 1 ends so: no exit hooks
    wind_up()
    os._exit(0)
"""


@pytest.mark.parametrize("when", ["midway", "done", "discarded", "discarded, os._exit"])
def test_a_process_that_never_takes_the_fetch_leaves_no_file_of_it(tmp_path, when):
    """A start that ends before its resume (a refused option, a signal), or a resume that took nothing and cancelled
    the fetch while its download still ran: the fetch's file, whole or partial, is deleted by the exit, with or
    without exit hooks."""
    store = _store(str(tmp_path / "run"))
    _commit(store, 1, tmp_path, size=40 * 2**20)
    spools = tmp_path / "spools"
    os.makedirs(spools)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run"), str(spools), when],
                          capture_output=True, text=True, timeout=budget(120))
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr
    assert os.listdir(spools) == []


def test_the_resume_deletes_a_fetch_it_did_not_take(tmp_path, monkeypatch):
    """The real trainer, in-process: its generation was fetched ahead and then moved to quarantine before the resume,
    which finds none and starts afresh. The fetched copy is deleted when the resume is over, not at exit: a run never
    keeps a second copy of the state on disk for its length."""
    from trainproof.train.config import TrainConfig
    from trainproof.train.fetch import fetch_ahead
    from trainproof.train.loop import train
    from trainproof.train.progress import Reporter

    spools = tmp_path / "spools"
    monkeypatch.setenv("TRAINPROOF_SPOOL_DIR", str(spools))
    cfg = TrainConfig(store=str(tmp_path / "run"), max_steps=2, log_format="json", tensorboard="off")
    assert train(cfg, reporter=Reporter()).exit_code == 0
    store = open_store(cfg.store)
    fetch_ahead(store)
    store._ahead._thread.join(budget(60))
    assert store._ahead.info.step == 2 and len([n for n in os.listdir(spools) if "load" in n]) == 2
    store.quarantine(2, "test: gone before the resume")
    assert train(cfg, store=store, reporter=Reporter()).exit_code == 0
    assert store.fetched_ahead is None and store._ahead is None
    assert [n for n in os.listdir(spools) if "load" in n] == []
