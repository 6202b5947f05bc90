"""Asynchronous checkpoints with world > 1 (DDP and ``--fsdp``), two gloo ranks on the CPU, real launches.

Training is blocked only for the host snapshot of what each rank commits (rank 0: the training state; every rank:
its part, and in a sharded run its own shards); each rank's save thread then runs the cross-rank commit over the
run's checkpoint group. Shown here: the generations are the ones a ``--sync-checkpoint`` run writes, file for
file; training went on while a save was in flight; a sharded snapshot copies only the local shard and is not
touched by the steps after it; a save that fails on one rank stops every rank at one step boundary with exit 1
(no rank left waiting in a collective), and the restart resumes the last committed generation.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from trainproof.storage import open_store
from tests.support.timing import budget
from tests.test_dist_helpers import load_world_state, read_until, start_world
from tests.test_train_helpers import differences, finish, parse_events, trajectory

TARGET = 20
CONFIG = {"rows": 21}  # the regression fixture otherwise: dropout, noise and gain draw from every generator
SLOW_SAVE = {"TPHOOK_STEP_DELAY": "0.03", "TPHOOK_SAVE_DELAY": "0.5"}  # test-only: saves far slower than steps


def _config(tmp_path) -> tuple[str, ...]:
    (tmp_path / "cfg.json").write_text(json.dumps(CONFIG))
    return ("--config", str(tmp_path / "cfg.json"))


def _files(store, step: int) -> dict[str, str]:
    return {n: f["sha256"] for n, f in open_store(str(store)).generation(step).manifest["files"].items()}


def test_a_sharded_snapshot_copies_the_local_shard_keeps_its_placement_and_is_not_touched_by_training():
    """In this process, a one-process FSDP world: every DTensor of the snapshot is a DTensor with the same mesh,
    placements and global shape whose local shard is a host copy (not the live storage); two more optimizer steps
    change the live shards and leave the snapshot as it was."""
    from torch.distributed.tensor import DTensor

    from trainproof.train import dist

    cpu = torch.device("cpu")
    try:
        _snapshot_checks(dist, cpu, DTensor)
    finally:  # a failed check must not leave this worker's later tests a process group
        from torch import distributed as tdist

        if tdist.is_initialized():
            tdist.destroy_process_group()


def _snapshot_checks(dist, cpu, DTensor) -> None:
    from trainproof.tasks import load_task
    from trainproof.train.async_save import snapshot
    from trainproof.train.fsdp import sharded_state
    from trainproof.format.layout import Layout
    from trainproof.train.run import build_run, train_step

    with dist.session(dist.DistEnv(), cpu, group_of_one=True) as sync:
        run = build_run(load_task("regression", {}), cpu, 1234, env=sync.env, sync=sync,
                        layout=Layout.choose(world=1, fsdp=True))
        for _ in range(3):
            train_step(run)
        live = _flat(sharded_state(run.model, run.optimizer))
        snap = _flat(snapshot(sharded_state(run.model, run.optimizer)))
        before = {k: v.to_local().clone() if isinstance(v, DTensor) else v for k, v in snap.items()}
        dtensors = [k for k, v in live.items() if isinstance(v, DTensor)]
        assert len(dtensors) >= 4, sorted(live)  # weights, biases and their Adam moments
        for key in dtensors:
            got, src = snap[key], live[key]
            assert isinstance(got, DTensor), key
            assert (got.device_mesh, got.placements, got.shape) == (src.device_mesh, src.placements, src.shape), key
            assert got.to_local().shape == src.to_local().shape, key  # the local shard, nothing gathered
            assert got.to_local().untyped_storage().data_ptr() != src.to_local().untyped_storage().data_ptr(), key
            assert torch.equal(got.to_local(), src.to_local()), key
        for _ in range(2):
            train_step(run)
        moved = _flat(sharded_state(run.model, run.optimizer))
        assert any(not torch.equal(moved[k].to_local(), before[k]) for k in dtensors), "training changed nothing?"
        assert all(torch.equal(snap[k].to_local(), before[k]) for k in dtensors), "the snapshot moved with training"


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out: dict = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}.{i}").items()}
    return {prefix: value}


# Every other 2-rank DDP test runs with background saves too (the default); the sharded case adds the DTensor
# snapshot (whose own memory the shard files are written from), so only it runs by default.
@pytest.mark.parametrize("mode", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_two_rank_async_saves_overlap_training_and_write_the_same_generations_as_sync(tmp_path, mode):
    """Saves slowed to ~0.5 s against 0.03 s steps: rank 0 logs steps past a save's step before that save's
    ``checkpoint`` event, and every generation holds the files a ``--sync-checkpoint`` run writes (shards, rank
    parts, history: the same bytes; the training state: the same trajectory, its recorded settings aside)."""
    common = (*_config(tmp_path), *(("--fsdp",) if mode == "fsdp" else ()), "--max-steps", str(TARGET),
              "--checkpoint-every", "5", "--keep", "0")
    a, s = tmp_path / "async", tmp_path / "sync"
    ra = finish(start_world(a, *common, env=SLOW_SAVE), timeout=budget(300))
    rs = finish(start_world(s, *common, "--sync-checkpoint"), timeout=budget(300))
    assert (ra.code, rs.code) == (0, 0), (ra.stderr, rs.stderr)
    assert ra.last("start")["checkpoint"] == "async" and rs.last("start")["checkpoint"] == "sync"
    names = [(e["event"], e.get("step")) for e in ra.events]
    begun, landed = names.index(("checkpoint_begin", 10)), names.index(("checkpoint", 10))
    assert [st for ev, st in names[begun:landed] if ev == "step" and st > 10], "training waited for the save"
    assert [e["step"] for e in ra.events if e["event"] == "checkpoint"] == [5, 10, 15, 20]
    # A record's seconds cover the whole cross-rank commit: rank 1's delayed part and rank 0's delayed check.
    assert all(e["seconds"] >= 1.0 for e in ra.events if e["event"] == "checkpoint"), ra.events
    for step in (5, 10, 15, 20):
        fa, fs = _files(a, step), _files(s, step)
        assert set(fa) == set(fs) and {"rank-00001.pt", "history.pt"} <= set(fa), (step, sorted(fa))
        if mode == "fsdp":
            assert {"shard-00000.distcp", "shard-00001.distcp", "dcp.metadata"} <= set(fa), sorted(fa)
        same = {n for n in fa if n != "training_state.pt"}
        assert {n: fa[n] for n in same} == {n: fs[n] for n in same}, step
        assert differences(trajectory(load_world_state(a, step)), trajectory(load_world_state(s, step))) == [], step


def test_a_save_failing_on_rank_0_stops_both_ranks_at_one_boundary_and_the_restart_resumes(tmp_path):
    """The run's spool folder (``<run>/.spool``) turns into a file after the first commit, so rank 0's next save fails
    while it serialises (inside the cross-rank commit, so rank 1's save thread learns it at once): both ranks exit 1
    naming the step, no rank hangs in a collective, that step has no COMPLETE.json, and a restart (which moves the
    file aside) resumes the last commit to the same end as an uninterrupted run."""
    common = (*_config(tmp_path), "--max-steps", str(TARGET), "--checkpoint-every", "5", "--keep", "0")
    store, ref = tmp_path / "run", tmp_path / "ref"
    spool = store / ".spool"
    reference = start_world(ref, *common)
    proc = start_world(store, *common, env={"TPHOOK_STEP_DELAY": "0.1"})
    lines: list[str] = []
    read_until(proc, lambda e: e.get("event") == "checkpoint" and e["step"] == 5, lines)
    shutil.rmtree(spool)
    spool.write_text("not a folder\n")
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=budget(120))
    assert time.monotonic() - t0 < budget(30), "a rank waited for the failed commit's collectives"
    events = [e for line in lines for e in parse_events(line)] + parse_events(out)
    assert proc.returncode == 1 and [e for e in events if e["event"] == "world_exit"][-1]["codes"] == [1, 1], err
    complete = [g.step for g in open_store(str(store)).scan() if g.status == "complete"]
    failed = complete[-1] + 5
    assert f"rank 0: background checkpoint of step {failed} failed: FileExistsError" in err, err
    assert f"rank 1: background checkpoint of step {failed} failed: step {failed} was not committed by rank 0" in err
    assert not (store / f"step-{failed:08d}" / "COMPLETE.json").exists()
    restart = finish(start_world(store, *common), timeout=budget(300))
    assert restart.code == 0 and restart.last("resume")["step"] == complete[-1], restart.stderr
    assert finish(reference, timeout=budget(300)).code == 0
    assert differences(trajectory(load_world_state(ref)), trajectory(load_world_state(store))) == []
    assert spool.is_dir() and not os.listdir(spool), "a spool file was left behind"
    (moved,) = [p for p in (store / "quarantine").iterdir() if p.name.startswith(".spool")]
    assert (moved / "OCCUPANT").read_text() == "not a folder\n"


def test_on_s3_a_refused_shard_upload_fails_both_ranks_and_the_restart_resumes_the_previous_bitwise(
        tmp_path, s3_env, s3_server):
    """A sharded 2-rank run on S3 (s3fs over HTTP to the loopback server, through a fault proxy) whose rank 1 is
    refused every PUT of its step-10 shard: DCP reports rank 1's failure to both save threads, both ranks exit 1
    naming step 10 and rank 1, step 10 is never marked usable, and the restart (no faults) resumes step 5 and ends
    with the model, Adam state and every rank's part of an uninterrupted run on a local folder."""
    from tests.support.faultproxy import Fault, FaultProxy
    from tests.test_train_fsdp import full_state

    url, ref = f"s3://{s3_env}/run", tmp_path / "ref"
    common = (*_config(tmp_path), "--fsdp", "--max-steps", "15", "--checkpoint-every", "5", "--keep", "0")
    reference = start_world(ref, *common)
    with FaultProxy(s3_server.endpoint) as proxy:
        proxy.set_faults([Fault("forbidden", methods={"PUT"}, path_contains="step-00000010/shard-00001")])
        result = finish(start_world(url, *common, env={"AWS_ENDPOINT_URL": proxy.endpoint,
                                                       "TPHOOK_STEP_DELAY": "0.05"}), timeout=budget(300))
        refused = proxy.stats.injected.get("forbidden", 0)
    assert refused >= 1 and result.code == 1, result.stderr[-3000:]
    assert result.last("world_exit")["codes"] == [1, 1], result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "background checkpoint of step 10 failed" in line]
    assert len(lines) == 2 and all("rank 1" in line for line in lines), result.stderr[-3000:]
    assert [g.step for g in open_store(url).scan() if g.status == "complete"] == [5]
    restart = finish(start_world(url, *common), timeout=budget(300))
    assert restart.code == 0 and restart.last("resume")["step"] == 5, restart.stderr[-3000:]
    assert finish(reference, timeout=budget(300)).code == 0
    assert differences(full_state(ref), full_state(url)) == []
    assert differences(trajectory(load_world_state(ref)), trajectory(load_world_state(url))) == []
