"""The bounded per-generation history and its hash chain: a generation holds only the rows since the previous
committed one, and the full history is reassembled from the run's generations and checked end to end
(trainproof.format.history). In-process over the real trainer code, then through real processes and the store: a changed
row in an older generation is refused by name; an export after retention deleted old generations says which
steps it covers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from trainproof.errors import StateError
from trainproof.tasks import load_task
from trainproof.format.history import MissingGeneration, assemble, from_store
from trainproof.train.run import build_run, capture_state, restore_state, train_step
from trainproof.format.state import (HISTORY_FILE, HISTORY_GENESIS, STATE_FILE, History, check_history, decode, decode_history,
                             encode, runtime_versions)
from trainproof.storage import open_store
from tests.test_train_helpers import differences, history_rows, load_state, run
from tests.test_verify_helpers import trainproof

CPU = torch.device("cpu")


def _meta() -> dict:
    return {"contract": "c" * 64, "world": 1, "code_version": "trainproof test", "data_identity": "d" * 64,
            "versions": runtime_versions()}


def _generations(total: int, every: int) -> tuple[dict[int, dict], dict]:
    """States committed every ``every`` steps of one run (each after the commit of the previous: its rows only),
    and the state of a run that never committed (all its rows)."""
    run_ = build_run(load_task("regression"), CPU, 3)
    gens = {}
    for _ in range(total):
        train_step(run_)
        if run_.step % every == 0:
            gens[run_.step] = decode(encode(capture_state(run_, _meta())))
            run_.history.committed(run_.step)
    whole = build_run(load_task("regression"), CPU, 3)
    for _ in range(total):
        train_step(whole)
    return gens, decode(encode(capture_state(whole, _meta())))


@pytest.fixture(scope="module")
def gens():
    return _generations(12, 4)


def test_each_generation_holds_only_its_own_rows_and_chains_to_the_previous(gens):
    g, whole = gens
    assert [(s["history_chain"]["first"], s["history"]["step"].tolist()) for s in g.values()] == [
        (1, [1, 2, 3, 4]), (5, [5, 6, 7, 8]), (9, [9, 10, 11, 12])]
    assert g[4]["history_chain"]["before"] == HISTORY_GENESIS
    assert g[8]["history_chain"]["before"] == g[4]["history_chain"]["digest"]
    assert g[12]["history_chain"]["digest"] == whole["history_chain"]["digest"]  # same rows, same chain value


def test_the_full_history_reassembled_equals_the_uncut_runs(gens):
    g, whole = gens
    found = assemble(g[12], g.get)
    assert (found.first, found.step, found.generations, found.stopped) == (1, 12, [12, 8, 4], None)
    assert differences(whole["history"], found.state["history"]) == []
    assert found.state["history_chain"] == whole["history_chain"]
    since = assemble(g[12], g.get, since=6).state  # only what is asked for: steps 6..12
    assert since["history"]["step"].tolist() == list(range(6, 13))
    assert since["history_chain"]["before"] == History.from_state_dict(whole["history"]).since(6).before


def test_a_changed_row_in_an_older_generation_is_refused(gens):
    g, _ = gens
    forged = {**g, 4: {**g[4], "history": {**g[4]["history"], "loss": g[4]["history"]["loss"].clone()}}}
    forged[4]["history"]["loss"][2] += 1e-9
    with pytest.raises(StateError, match=r"step-00000004: history rows 1\.\.4 do not hash"):
        assemble(g[12], forged.get)
    # A forger who also recomputes the older generation's own digest breaks the link to the next one instead.
    rows = History.from_state_dict(forged[4]["history"])
    forged[4]["history_chain"] = {**forged[4]["history_chain"], "digest": rows.digest}
    check_history(forged[4])  # consistent on its own
    with pytest.raises(StateError, match=r"history chain broken: the rows of step-00000004 .* step-00000008 chains"):
        assemble(g[12], forged.get)


def test_a_missing_generation_is_refused_unless_partial(gens):
    g, _ = gens
    kept = {12: g[12], 8: g[8]}  # retention deleted step 4
    with pytest.raises(MissingGeneration, match="step-00000004"):
        assemble(g[12], kept.get)
    found = assemble(g[12], kept.get, partial=True)
    assert (found.first, found.to_json()["complete"]) == (5, False) and "step-00000004" in found.stopped
    assert found.state["history"]["step"].tolist() == list(range(5, 13))


def test_a_state_whose_rows_do_not_hash_to_its_digest_is_refused(gens):
    g, _ = gens
    state = {**g[8], "history": {**g[8]["history"], "lr": g[8]["history"]["lr"] * 2}}
    with pytest.raises(StateError, match="do not hash"):
        check_history(state)


def test_a_resumed_run_records_from_the_next_step_and_keeps_the_chain(gens):
    g, whole = gens
    resumed = build_run(load_task("regression"), CPU, 3)
    restore_state(resumed, g[8])
    assert (len(resumed.history), resumed.history.first, resumed.history.last_row["step"]) == (0, 9, 8)
    for _ in range(4):
        train_step(resumed)
    state = capture_state(resumed, _meta())
    assert state["history_chain"]["digest"] == whole["history_chain"]["digest"]
    assert differences(whole["history"], assemble(state, g.get).state["history"]) == []


def test_a_history_keeps_rows_not_yet_committed():
    """Asynchronous saves: the commit of step 2 lands while step 3 was already trained; row 3 stays."""
    h = History()
    for step in (1, 2, 3):
        h.append(step=step, epoch=0, loss=float(step), lr=0.1, targets=4, sample_ids=[step])
    full_digest = h.digest
    h.committed(2)
    assert (h.first, h.column("step"), h.digest) == (3, [3], full_digest)
    h.committed(3)
    assert (len(h), h.last_row["step"], h.digest) == (0, 3, full_digest)


# -- through real processes and the store ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def kept_run(tmp_path_factory):
    """12 steps, a generation every 2 steps, all kept."""
    d = tmp_path_factory.mktemp("history")
    result = run(d / "run", "--max-steps", "12", "--checkpoint-every", "2", "--keep", "0")
    assert result.code == 0, result.stderr
    return d


def test_the_store_reassembles_every_step(kept_run):
    state = load_state(kept_run / "run")
    assert [r["step"] for r in history_rows(state)] == list(range(1, 13))
    own = load_state(kept_run / "run", history="own")
    assert own["history"]["step"].tolist() == [11, 12] and own["history_chain"]["first"] == 11


def _recommit_step_6(kept_run, tmp_path, alter):
    """A copy of the run whose generation 6 was deleted and committed again with ``alter(its files)``: valid
    checksums, changed content (what anyone with write access to the bucket could do). Returns its store."""
    shutil.copytree(kept_run / "run", tmp_path / "run")
    store = open_store(str(tmp_path / "run"))
    loaded = store.load(6)
    files = alter(loaded.files)
    shutil.rmtree(tmp_path / "run" / "step-00000006")
    manifest = loaded.info.manifest
    store.commit(6, files, contract=manifest["contract"], world=1, code_version=manifest["code_version"],
                 extra=manifest.get("extra"))
    return store


def test_a_row_changed_in_an_older_committed_generation_is_refused_loudly(kept_run, tmp_path):
    """Re-committed with valid checksums (the store cannot tell): the chain can."""

    def alter(files: dict) -> dict:
        state = decode(files[STATE_FILE])
        state["history"]["sample_ids"][0] += 1
        return {STATE_FILE: encode(state)}  # as a generation written before history.pt existed

    store = _recommit_step_6(kept_run, tmp_path, alter)
    newest = decode(store.load(12).files[STATE_FILE])
    with pytest.raises(StateError, match="step-00000006: history rows 5..6 do not hash"):
        from_store(store, newest)
    result = trainproof("export", "--store", str(tmp_path / "run"))
    assert result.returncode == 2 and "step-00000006" in result.stderr, result.stderr


def test_reassembly_reads_each_older_generation_s_history_file_never_its_state(kept_run):
    """The rows of generations 2..10 come from their small ``history.pt``: not one byte of an older
    ``training_state.pt`` (the model and optimizer, gigabytes for a real model) is read."""
    from tests.support.tamper import wrap

    read: list[str] = []
    store = wrap(open_store(str(kept_run / "run")), alter_read=lambda path, data: read.append(path) or data)
    newest = decode(store.load(12).files[STATE_FILE])
    read.clear()
    found = from_store(store, newest)
    assert found.first == 1 and found.generations == [12, 10, 8, 6, 4, 2]
    files = [p.rsplit("/", 2)[-2:] for p in read if "/step-" in p]
    assert sorted({tuple(f) for f in files if f[1] != "COMPLETE.json"}) == [
        (f"step-{s:08d}", HISTORY_FILE) for s in (2, 4, 6, 8, 10)]


def test_a_changed_history_file_is_refused_by_the_chain(kept_run, tmp_path):
    """history.pt re-committed with a changed row and valid checksums: the chain refuses it, as for the state."""

    def alter(files: dict) -> dict:
        section = decode_history(files[HISTORY_FILE])
        section["history"]["loss"][0] += 1.0
        return {STATE_FILE: files[STATE_FILE], HISTORY_FILE: encode(section)}

    store = _recommit_step_6(kept_run, tmp_path, alter)
    with pytest.raises(StateError, match="step-00000006: history rows 5..6 do not hash"):
        from_store(store, decode(store.load(12).files[STATE_FILE]))


def test_an_export_after_retention_says_which_steps_its_history_covers(kept_run, tmp_path):
    shutil.copytree(kept_run / "run", tmp_path / "run")
    for step in (2, 4, 6):  # what --keep 3 would have deleted
        shutil.rmtree(tmp_path / "run" / f"step-{step:08d}")
    result = trainproof("export", "--store", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert "covers steps 7..12 only" in result.stderr and "step-00000006" in result.stderr
    metrics = json.loads((tmp_path / "run" / "exports" / "step-00000012" / "metrics.json").read_text())
    assert metrics["history"]["first_step"] == 7 and metrics["history"]["last_step"] == 12
    assert metrics["history"]["complete"] is False and "step-00000006" in metrics["history"]["stopped"]
    assert metrics["step"] == 12 and metrics["final_loss"] == load_state(kept_run / "run")["history"]["loss"][-1].item()


def test_only_a_commit_that_landed_drops_history_rows():
    """A background save that fails leaves every row in memory: the next generation (after a restart, the resume
    point's successor) still holds the rows since the last *committed* generation."""
    from trainproof.errors import TrainError
    from trainproof.format.state import encode_spool
    from trainproof.train.async_save import BackgroundSaver
    from trainproof.train.progress import Reporter

    class Flaky:
        reporter = None
        spool_dir = None
        world = 1
        fail = True

        def encode(self, state):
            return encode_spool(state, self.spool_dir)

        def commit(self, capture):
            capture.encoded.unlink()  # the serialised state (a spool file), as the real checkpointer deletes it
            if self.fail:
                raise OSError("the store went away")

    h = History()
    for step in (1, 2, 3):
        h.append(step=step, epoch=0, loss=0.5, lr=0.1, targets=1, sample_ids=[step])
    flaky = Flaky()
    saver = BackgroundSaver(flaky, Reporter(), lambda s: None, h.committed)
    saver.submit(2, {"x": 1}, extra={}, blocked_s=0.0)
    with pytest.raises(TrainError, match="step 2.*the store went away"):
        saver.wait()
    assert (h.first, h.column("step")) == (1, [1, 2, 3])  # nothing dropped
    flaky.fail = False
    saver.submit(3, {"x": 1}, extra={}, blocked_s=0.0)
    saver.wait()
    assert (h.first, len(h), h.last_row["step"]) == (4, 0, 3)
