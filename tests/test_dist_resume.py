"""Two ranks (gloo on the CPU): exact resume, preemption agreed across ranks, a rank killed mid-commit, the
epoch-plan refusal, and world-size changes. Every run is a real launch (trainproof's launcher or torchrun).

The reference is one continuous 2-rank run of ``TARGET`` steps; every interrupted chain must end bit for
bit equal to it, every rank's part (generators, data position) included.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from trainproof.train.data import epoch_plan, permutation_of
from trainproof.train.dist import rank_seed, rank_slice
from trainproof.errors import ConfigError, StateError
from trainproof.train.launch import world_exit_code
from trainproof.format.state import decode_generation, rank_file
from trainproof.storage import open_store
from tests.support.timing import budget
from tests.test_dist_helpers import load_world_state, rank_pids, read_until, start_torchrun, start_world
from tests.test_train_helpers import differences, finish, history_rows, run_all, trajectory

TARGET, CUT = 40, 13  # 21 rows in global batches of 8: 3 steps an epoch (8, 8, 5 split 3 + 2); 13 is mid-epoch
CONFIG = {"rows": 21}  # the regression fixture otherwise: dropout, noise and gain draw from every generator
STEP_DELAY = {"TPHOOK_STEP_DELAY": "0.02"}  # test-only: lets a signal land mid-run


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """The continuous reference (launcher) and a cut at step 13 (under torchrun) resumed to the target."""
    d = tmp_path_factory.mktemp("world2")
    (d / "cfg.json").write_text(json.dumps(CONFIG))
    common = ("--config", str(d / "cfg.json"))
    cont = start_world(d / "cont", *common, "--max-steps", str(TARGET))
    cut = start_torchrun(d / "cut", *common, "--max-steps", str(CUT))
    results = {"cont": finish(cont, timeout=budget(300)), "cut": finish(cut, timeout=budget(300))}
    assert [r.code for r in results.values()] == [0, 0], [r.stderr for r in results.values()]
    cut_state = load_world_state(d / "cut")
    spools = {"TRAINPROOF_SPOOL_DIR": str(d / "spools")}  # each rank fetches the generation ahead into it
    results["resume"] = finish(start_world(d / "cut", *common, "--max-steps", str(TARGET), env=spools),
                               timeout=budget(300))
    assert results["resume"].code == 0, results["resume"].stderr
    return {"dir": d, "common": common, "results": results, "cut_state": cut_state,
            "reference": trajectory(load_world_state(d / "cont"))}


def test_two_rank_resume_is_bitwise_equal(world2):
    resumed = load_world_state(world2["dir"] / "cut")
    assert differences(world2["reference"], trajectory(resumed)) == []
    assert world2["results"]["resume"].last("resume")["step"] == CUT
    assert world2["results"]["resume"].last("resume")["fetched_ahead"] is True
    # Every rank fetched it ahead, took it, and ended with os._exit (no exit hooks): none left a file behind.
    assert [n for n in os.listdir(world2["dir"] / "spools") if "trainproof-load-" in n] == []
    assert len(resumed["ranks"]) == 2 and [p["rank"] for p in resumed["ranks"]] == [0, 1]
    assert resumed["ranks"][0]["next_draws"] != resumed["ranks"][1]["next_draws"]  # per-rank streams


def test_the_cut_ran_under_torchrun_and_holds_every_rank_file(world2):
    cut = world2["cut_state"]
    assert cut["progress"]["step"] == CUT and cut["ranks"][0]["data"]["cursor"] == 8  # mid-epoch
    assert cut["ranks"][1]["data"] == {"epoch": cut["progress"]["epoch"], "cursor": 8}
    info = open_store(str(world2["dir"] / "cut")).scan()[0]
    assert info.manifest["world"] == 2
    assert set(info.manifest["files"]) == {"training_state.pt", "history.pt", rank_file(1)}


def _interrupt(store, world2, victim: str) -> tuple[object, list[int]]:
    """Start a chain link, SIGTERM the launcher or only rank 1 three steps in; return (result, rank pids)."""
    proc = start_world(store, *world2["common"], "--max-steps", str(TARGET), "--checkpoint-every", "7", env=STEP_DELAY)
    lines: list[str] = []
    pids = rank_pids(proc, lines)
    start = read_until(proc, lambda e: e.get("event") == "start", lines)
    read_until(proc, lambda e: e.get("event") == "step" and e["step"] >= start["step"] + 3, lines)
    if victim == "rank1":
        os.kill(pids[1], signal.SIGTERM)  # a single worker, as a node agent or a person might
    else:
        proc.send_signal(signal.SIGTERM)  # the launcher, as Kubernetes does: it forwards to every rank
    return finish(proc, timeout=budget(120)), pids


@pytest.mark.parametrize("victims", [("rank1", "launcher")], ids=["rank1-then-launcher"])
def test_sigterm_stops_every_rank_at_one_committed_step_and_resumes_exactly(world2, tmp_path, victims):
    store = tmp_path / "chain"
    stopped_at = [0]
    for victim in victims:
        result, _ = _interrupt(store, world2, victim)
        assert result.code == 75, result.stderr
        assert result.last("world_exit")["codes"] == [75, 75]  # every rank exited 75, so did the launcher
        stopped = result.last("stopped")
        # The launcher forwards to both ranks, but a rank blocked inside the stop-flag all-reduce runs its Python
        # signal handler only once the collective returns: the ranks may agree while one of them has not seen it
        # yet (then 1 is counted). Every rank still stops at that step and exits 75 (asserted above and below).
        assert stopped["reason"] == "signal"
        assert stopped["ranks_signalled"] == 1 if victim == "rank1" else stopped["ranks_signalled"] in (1, 2)
        state = load_world_state(store)  # both ranks' parts of one generation, at the step they agreed on
        assert state["progress"]["step"] == stopped["step"] > stopped_at[-1]
        assert [p["step"] for p in state["ranks"][1:]] == [stopped["step"]]
        stopped_at.append(stopped["step"])
    final = finish(start_world(store, *world2["common"], "--max-steps", str(TARGET)), timeout=budget(300))
    assert final.code == 0, final.stderr
    got = load_world_state(store)
    assert differences(world2["reference"], trajectory(got)) == []
    assert [r["step"] for r in history_rows(got)] == list(range(1, TARGET + 1))


def test_a_rank_killed_during_the_commit_fails_the_generation_without_a_hang(world2, tmp_path):
    store = tmp_path / "killed"
    hooks = {"TPHOOK_SAVE_DELAY": "3.0"}  # each rank's save pauses 3 s before handing over its part
    proc = start_world(store, *world2["common"], "--max-steps", str(TARGET), "--checkpoint-every", "5", env=hooks)
    lines: list[str] = []
    pids = rank_pids(proc, lines)
    read_until(proc, lambda e: e.get("event") == "checkpoint_begin" and e["step"] == 10, lines)
    part = store / "step-00000010" / rank_file(1)
    deadline = time.monotonic() + budget(60)
    while not part.exists():  # rank 1 wrote its part and sleeps (TPHOOK_SAVE_DELAY) before handing it over
        assert time.monotonic() < deadline and proc.poll() is None, "rank 1 never wrote its part of step 10"
        time.sleep(0.01)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    result = finish(proc, timeout=budget(120))
    assert time.monotonic() - t0 < budget(15), "rank 0 must give up at once (peer gone), well before any kill"
    assert result.code == 1 and result.last("world_exit")["codes"] == [1, -9], result.stderr
    assert "gather the rank parts of step 10" in result.stderr  # rank 0's own failure, not the launcher's kill
    assert not (store / "step-00000010" / "COMPLETE.json").exists()
    assert [g.step for g in open_store(str(store)).scan() if g.status == "complete"] == [5]
    restart = finish(start_world(store, *world2["common"], "--max-steps", str(TARGET)), timeout=budget(300))
    assert restart.code == 0 and restart.last("resume")["step"] == 5, restart.stderr
    assert differences(world2["reference"], trajectory(load_world_state(store))) == []


EPOCH_REFUSAL = (
    "epoch plan: 9 samples in global batches of 8 (2 ranks x 4) leave 1 sample(s) for the last step of each "
    "epoch, fewer than the 2 ranks (every rank needs at least one real sample; trainproof neither drops nor "
    "pads the tail). Set the task's per-rank batch_size (--config) to 3 or 5, use another world size, or a "
    "sample count whose remainder modulo 8 is 0 or at least 2")


def test_an_epoch_tail_smaller_than_the_world_is_refused_with_the_numbers(tmp_path):
    with pytest.raises(ConfigError) as caught:
        epoch_plan(9, 4, world=2)
    assert str(caught.value) == EPOCH_REFUSAL
    (tmp_path / "cfg.json").write_text(json.dumps({"rows": 9, "batch_size": 4}))
    result = finish(start_world(tmp_path / "run", "--config", str(tmp_path / "cfg.json")), timeout=budget(120))
    assert result.code == 2 and result.last("world_exit")["codes"] == [2, 2]
    assert f"trainproof: error: rank 0: {EPOCH_REFUSAL}\n" in result.stderr
    assert not (tmp_path / "run" / "plan.json").exists()  # refused before anything was written


def test_another_world_size_is_refused_unless_allowed_then_recorded(world2, tmp_path):
    for name in ("refused", "a", "b"):
        shutil.copytree(world2["dir"] / "cont", tmp_path / name)
    more = (*world2["common"], "--max-steps", str(TARGET + 3))
    refused, a, b = run_all((tmp_path / "refused", *more), *((tmp_path / n, *more, "--allow-world-change") for n in "ab"))
    assert refused.code == 2 and "world size 2 (step-00000040 was written by 2 rank(s))" in refused.stderr
    assert "--allow-world-change" in refused.stderr
    assert (a.code, b.code) == (0, 0), a.stderr + b.stderr
    assert a.last("resume")["world_change"] == {"step": TARGET, "from": 2, "to": 1}
    sa, sb = load_world_state(tmp_path / "a"), load_world_state(tmp_path / "b")
    assert differences(trajectory(sa), trajectory(sb)) == []  # re-derived streams are deterministic
    assert sa["meta"]["world"] == 1 and sa["meta"]["world_changes"] == [{"step": TARGET, "from": 2, "to": 1}]
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["bitwise_comparable"] is False and summary["world_changes"] == sa["meta"]["world_changes"]
    # The global data order carried over: step 41 takes the next 4 ids of the saved permutation.
    saved = world2["reference"]["ranks"][0]["data"]
    cursor = saved["cursor"]
    permutation = permutation_of(saved, saved["num_samples"])  # redrawn from the saved generator pair
    assert history_rows(sa)[TARGET]["sample_ids"] == permutation[cursor : cursor + 4].tolist()


# -- cheap unit checks ---------------------------------------------------------------------------------------

def test_rank_slices_are_contiguous_even_and_cover_the_batch():
    ids = list(range(100, 105))
    assert [rank_slice(ids, 2, r) for r in range(2)] == [[100, 101, 102], [103, 104]]
    assert [len(rank_slice(list(range(7)), 3, r)) for r in range(3)] == [3, 2, 2]
    assert sum((rank_slice(list(range(8)), 2, r) for r in range(2)), []) == list(range(8))


def test_rank_seeds_keep_rank_zero_and_differ_per_rank_and_step():
    assert rank_seed(1234, 0) == 1234
    seeds = {rank_seed(1234, r, s) for r in range(4) for s in (0, 40)}
    assert len(seeds) == 8 and all(0 <= x < 2**63 for x in seeds)


@pytest.mark.parametrize(("codes", "expected"), [([0, 0], 0), ([75, 75], 75), ([2, 1], 2), ([1, -9], 1), ([0, 75], 1)])
def test_world_exit_code(codes, expected):
    assert world_exit_code(codes) == expected


def test_rank_files_of_another_step_are_refused(world2):
    store = open_store(str(world2["dir"] / "cont"))
    files = dict(store.load(TARGET).files)
    files[rank_file(1)] = open_store(str(world2["dir"] / "cut")).load(CUT).files[rank_file(1)]
    with pytest.raises(StateError, match="another moment"):
        decode_generation(files)
    del files[rank_file(1)]
    with pytest.raises(StateError, match="no rank-00001.pt"):
        decode_generation(files)


def test_a_stranger_generation_at_the_step_two_ranks_commit_next_is_moved_aside(world2, tmp_path):
    """The step the restarted 2-rank run commits next holds a complete generation of another contract (a stranger's,
    which anyone with the bucket's token can write without a key): rank 0 moves it to quarantine once, before any
    rank writes its part, and the run ends bitwise equal to the uninterrupted one (before: every rank's part write
    refused the occupied step, exit 1 at every restart)."""
    store = tmp_path / "run"
    shutil.copytree(world2["dir"] / "cut", store)
    planted = store / f"step-{TARGET:08d}"
    manifest = json.loads((planted / "COMPLETE.json").read_text())
    manifest["contract"] = "0" * len(manifest["contract"])
    (planted / "COMPLETE.json").write_text(json.dumps(manifest))
    result = finish(start_world(store, *world2["common"], "--max-steps", str(TARGET)), timeout=budget(300))
    assert result.code == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.last("resume")["step"] == CUT
    assert differences(world2["reference"], trajectory(load_world_state(store))) == []
    [moved] = (store / "quarantine").iterdir()
    assert moved.name.startswith(f"step-{TARGET:08d}-") and "0000000000" in (moved / "COMPLETE.json").read_text()
