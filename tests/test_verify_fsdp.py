"""``trainproof verify --fsdp`` and ``trainproof export`` of a sharded run: the sharded model and optimizer read whole
in one process from the verified shards (``trainproof.train.fsdp.full_state``), then compared or exported like a replicated
run's state.

Real processes: the protocol with ``--fsdp --world 2`` (every path, the world-size equivalence runs and the objective
runs sharded over 2 gloo ranks; ``--steps 6 --cut 4`` as in tests/test_verify_world.py) must pass with the resume
bitwise and every negative control detected; ``verify --audit`` replays a 2-rank sharded run with two ranks. The export
of a sharded run and its tampered shards: tests/test_train_fsdp.py (on that module's runs).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from trainproof.proof.compare import SECTIONS
from trainproof.proof.paths import RunReader
from trainproof.proof.world_change import AFTER, RESTORED, SHARD_LOCAL
from trainproof.export.bundle import FP_FILE
from trainproof.train.fsdp import _check_tiling, _unflatten
from trainproof.train.sharded import ShardedLoadError
from trainproof.storage import open_store
from tests.test_train_helpers import differences, finish, run, start
from tests.test_verify_helpers import checks, read_report, trainproof

CONFIG = {"rows": 21}  # the regression fixture otherwise (dropout, noise, gain): 3 steps an epoch of global batch 8


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("verify-fsdp") / "run")
    # 2 KiB groups: the comparison reads the sharded states in many groups (trainproof.proof.compare), as it would a
    # model larger than the verifier's memory
    result = trainproof("verify", "--store", store, "--id", "f2", "--fsdp", "--world", "2", "--steps", "6",
                        "--cut", "4", "--cuts", "4", "--keep-evidence",
                        env={"TRAINPROOF_COMPARE_GROUP_MIB": str(2 / 1024)})
    return {"store": store, "result": result, "report": read_report(store, "f2")}


def test_verify_fsdp_world2_passes_with_the_resume_bitwise_and_every_negative_detected(verified):
    result, report = verified["result"], verified["report"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert report["completed"] and report["failing_checks"] == [], report["failing_checks"]
    assert all(report[k] is True for k in (
        "all_checks_passed", "positive", "negative_divergence_detected", "cut_checkpoint_ok", "export_reload_ok",
        "world_equivalence_passed", "world_negative_detected", "cuts_passed", "objective_equivalence_passed",
        "objective_negative_detected")), {k: v for k, v in report.items() if isinstance(v, bool)}
    assert report["settings"]["fsdp"] is True and report["settings"]["world"] == 2
    resume = checks(report, "resume")
    assert all(c["max_abs_diff"] == 0.0 and c["within_tolerance"] for c in resume.values())
    # the sharded sections were really compared: the negative control moves the parameters and Adam's moments
    negative = checks(report, "resume_without_rng")
    assert negative["parameters"]["max_abs_diff"] > 1e-6 and negative["optimizer"]["max_abs_diff"] > 1e-6


def test_every_process_the_verifier_starts_trains_sharded(verified):
    report = verified["report"]
    commands = {**{f"protocol/{k}": v["command"] for k, v in report["paths"].items()},
                **{f"world/{k}": v["command"] for k, v in report["world_equivalence"]["paths"].items()},
                **{f"objective/{k}": v["command"] for k, v in report["objective_equivalence"]["paths"].items()},
                **{f"cuts/{k}": v["command"] for k, v in report["cuts"]["paths"].items()},
                "world_change": report["world_change"]["path"]["command"]}
    assert len(commands) >= 11 and not report["cuts"]["paths"]  # --cuts 4: no extra cut
    assert [k for k, c in commands.items() if "--fsdp" not in c.split()] == []
    # the one-rank reference of the world-size check is sharded too (same state format as the 2-rank run)
    assert "--nproc-per-node" not in report["world_equivalence"]["paths"]["one_rank"]["command"]


def test_the_resumed_path_is_sharded_and_read_whole_from_its_shards(verified):
    url = f"{verified['store']}/verification/f2/resume"
    store = open_store(url)
    info = store.generation(6)
    assert info.manifest["extra"]["sharded"]["shards"] == ["shard-00000.distcp", "shard-00001.distcp"]
    lazy = RunReader("resume", url, open_store).state(6)  # what the comparison gets: shards opened, nothing read
    assert lazy["model"] == {} and lazy["optimizer"] == {} and set(lazy[SECTIONS].entries) >= {"model.0.weight"}
    state = RunReader("resume", url, open_store).state(6, whole=True)
    assert state["meta"]["fsdp"] is True
    assert set(state["model"]) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert set(state["optimizer"]["state"]) == set(state["model"])  # keyed by parameter name
    assert state["optimizer"]["param_groups"][0]["params"] == list(state["model"])
    # the cut's generation was copied into the resume path with its metadata digest
    seeded = store.generation(4).manifest
    assert seeded["dcp_metadata_sha256"] == seeded["files"]["dcp.metadata"]["sha256"]
    # the exported bundle holds exactly the gathered weights
    from safetensors.torch import load

    bundle = open_store(verified["report"]["export"]["location"].rsplit("/", 1)[0]).load(6)
    assert differences(load(bundle.files[FP_FILE]), state["model"]) == []


def test_the_two_rank_cut_resumed_on_one_rank_through_the_reshard_keeps_its_counters(verified):
    """The world change through DCP's reshard (2 -> 1): what does not depend on the layout restored and carried on
    exactly; a sharded live record fingerprints each rank's own shard, so the model and moments are not applicable
    there (the block says so)."""
    report = verified["report"]
    w = report["world_change"]
    assert report["world_change_passed"] is True and w["resumed_on_another_world"]["to"] == 1
    assert set(w["restored"]["not_applicable"]) == set(SHARD_LOCAL)
    assert set(w["restored"]["checks"]) == set(RESTORED) - set(SHARD_LOCAL) and set(w["after"]["checks"]) == set(AFTER)
    assert all(c["within_tolerance"] for b in ("restored", "after") for c in w[b]["checks"].values())
    assert w["worlds"]["exercised"] == [1, 2] and "worlds exercised: [1, 2]" in verified["result"].stdout


def test_a_reshard_that_zeroes_adams_step_counters_fails_naming_them(tmp_path):
    """The bug no other path sees (every other path keeps its world): the restore onto another world size zeroes
    Adam's step counters (tests/support/hooked.py, only on a world change). The smallest sharded protocol: exit 1,
    the world change's counters named, right after the restore and after the updates, and nothing else."""
    store = str(tmp_path / "run")
    result = trainproof("verify", "--store", store, "--id", "z", "--fsdp", "--world", "2", "--steps", "4", "--cut",
                        "2", "--cuts", "2", "--no-objective-check", "--no-export",
                        env={"TPHOOK_SABOTAGE": "reshard_zero_steps"})
    assert result.returncode == 1, result.stderr[-3000:]
    report = read_report(store, "z")
    assert report["failing_checks"] == ["world_change.restored.optimizer_counters",
                                        "world_change.after.optimizer_counters"], report["failing_checks"]
    assert report["positive"] is True and report["world_change_passed"] is False
    restored = report["world_change"]["restored"]["checks"]["optimizer_counters"]
    assert "step differs at step 2" in restored["detail"] and "vs restored float32 0.0" in restored["detail"]
    assert "failing checks: world_change.restored.optimizer_counters" in result.stdout


def test_verify_audit_refuses_fsdp():
    result = trainproof("verify", "--store", "/nonexistent", "--audit", "--fsdp")
    assert result.returncode == 2 and "--fsdp is for the protocol" in result.stderr


@pytest.mark.slow  # the two-rank sharded audit below covers this and the launcher
def test_audit_of_a_sharded_run_replays_it_sharded_and_catches_another_trajectory(tmp_path):
    """A one-process ``--fsdp`` run trained to 3, then (a second process) to 6; a copy whose 3 -> 6 resumed with
    re-seeded generators. The audit replays 3 -> 6 sharded (plan.json says fsdp) and compares the model and Adam
    state read whole from both runs' shards: bitwise equal for the honest run, caught for the other."""
    (tmp_path / "cfg.json").write_text(json.dumps(CONFIG))
    common = ("--fsdp", "--config", str(tmp_path / "cfg.json"))
    first = run(tmp_path / "run", *common, "--max-steps", "3")
    assert first.code == 0, first.stderr
    shutil.copytree(tmp_path / "run", tmp_path / "sabotaged")
    procs = [start(tmp_path / "run", *common, "--max-steps", "6"),
             start(tmp_path / "sabotaged", *common, "--max-steps", "6", env={"TPHOOK_SABOTAGE": "reseed_rng"})]
    assert [finish(p).code for p in procs] == [0, 0]

    honest = trainproof("verify", "--store", str(tmp_path / "run"), "--audit", "--id", "audit")
    assert honest.returncode == 0, honest.stderr[-3000:]
    report = read_report(str(tmp_path / "run"), "audit")
    assert (report["settings"]["from"], report["settings"]["to"], report["all_checks_passed"]) == (3, 6, True)
    assert "--fsdp" in report["paths"]["replay"]["command"]
    compared = {c["name"]: c for c in report["checks"]["replay"]}
    assert compared["parameters"]["max_abs_diff"] == 0.0 and compared["optimizer"]["max_abs_diff"] == 0.0

    other = trainproof("verify", "--store", str(tmp_path / "sabotaged"), "--audit", "--id", "audit")
    assert other.returncode == 1, other.stderr[-3000:]
    failing = read_report(str(tmp_path / "sabotaged"), "audit")["failing_checks"]
    assert {"replay.parameters", "replay.rng_next_draws"} <= set(failing)


def test_audit_of_a_two_rank_sharded_run_replays_it_with_two_ranks_and_catches_another_trajectory(verified):
    """The same with ``--nproc-per-node 2``, on two runs the protocol above kept (``--keep-evidence``): its resume
    path (trained to the cut 4, resumed by a second launch to 6) and its negative path (the same, resumed without
    restoring the generators). The audit reads each run's world (2) from plan.json and replays 4 -> 6 with two ranks
    (trainproof's launcher), comparing the shards and every rank's part: the honest run is reproduced bitwise, the
    other is caught."""
    root = f"{verified['store']}/verification/f2"
    honest = trainproof("verify", "--store", f"{root}/resume", "--audit", "--from", "4", "--to", "6", "--id", "audit")
    assert honest.returncode == 0, honest.stderr[-3000:]
    report = read_report(f"{root}/resume", "audit")
    assert (report["settings"]["from"], report["settings"]["to"], report["all_checks_passed"]) == (4, 6, True)
    assert "--nproc-per-node 2" in report["paths"]["replay"]["command"] and "--fsdp" in report["paths"]["replay"]["command"]
    compared = {c["name"]: c for c in report["checks"]["replay"]}
    assert compared["parameters"]["max_abs_diff"] == 0.0 and compared["optimizer"]["max_abs_diff"] == 0.0
    assert compared["rng_next_draws"]["within_tolerance"] and compared["data_position"]["within_tolerance"]

    other = trainproof("verify", "--store", f"{root}/resume_without_rng", "--audit", "--from", "4", "--to", "6",
                       "--id", "audit")
    assert other.returncode == 1, other.stderr[-3000:]
    failing = read_report(f"{root}/resume_without_rng", "audit")["failing_checks"]
    assert {"replay.parameters", "replay.rng_next_draws"} <= set(failing)


def _chunks(*boxes):
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in boxes]


def test_chunks_must_tile_the_tensor_exactly():
    _check_tiling("g", "w", (4, 2), _chunks(((0, 0), (2, 2)), ((2, 0), (2, 2))))
    _check_tiling("g", "step", (), _chunks(((), ())))
    for bad in (_chunks(((0, 0), (2, 2))),                                      # a gap
                _chunks(((0, 0), (3, 2)), ((2, 0), (1, 2))),                    # an overlap (sizes add up)
                _chunks(((0, 0), (2, 2)), ((3, 0), (2, 2))),                    # outside the tensor
                _chunks(((0,), (8,)))):                                         # another rank
        with pytest.raises(ShardedLoadError, match="do not tile"):
            _check_tiling("g", "w", (4, 2), bad)


def test_unflatten_nests_by_the_metadata_and_refuses_what_does_not_nest():
    flat = {"model.a": 1, "optim.state.a.step": 2, "optim.param_groups.0.lr": 0.1, "optim.param_groups.0.params": ["a"]}
    mapping = {"model.a": ("model", "a"), "optim.state.a.step": ("optim", "state", "a", "step"),
               "optim.param_groups.0.lr": ("optim", "param_groups", 0, "lr"),
               "optim.param_groups.0.params": ("optim", "param_groups", 0, "params")}
    assert _unflatten("g", flat, mapping) == {"model": {"a": 1}, "optim": {"state": {"a": {"step": 2}},
                                                                           "param_groups": [{"lr": 0.1, "params": ["a"]}]}}
    for bad in ({**mapping, "model.a": ("model", 10**9)}, {**mapping, "model.a": "model.a"},
                {k: v for k, v in mapping.items() if k != "model.a"},
                {**mapping, "optim.param_groups.0.lr": ("optim", "state", "a", "step", "x")}):
        with pytest.raises(ShardedLoadError):
            _unflatten("g", flat, bad)
