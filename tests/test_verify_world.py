"""``trainproof verify --world 2``: the four-path protocol with every path launched as 2 ranks (trainproof's
launcher, gloo on the CPU), the resume still bitwise, plus the world-size equivalence check (2 ranks vs 1 rank
with the same global batch, float64, within trainproof.proof.world.TOLERANCE) and its negative control (the loss
normalised per rank on steps with uneven target counts), which must be detected.

Runtime: each path is a launcher plus two ranks (several seconds each), so the protocol runs with fewer steps
than the default (``--steps 6 --cut 4``: 24 rows in global batches of 8, the cut mid-epoch, the run crossing
into the second epoch).
"""

from __future__ import annotations

import pytest

from trainproof.proof.compare import Diff
from trainproof.proof.world import TOLERANCE, WorldEquivalence, equivalence_config
from trainproof.proof.world_change import (
    AFTER,
    RESTORED,
    SHARD_LOCAL,
    compare_restored,
    data_order,
    fitting_world,
    target_world,
)
from trainproof.storage import open_store
from tests.test_verify_helpers import checks, cli, read_report, trainproof  # noqa: F401  (cli: a fixture)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("verify-world") / "run")
    # --cuts 4: the protocol's cut only (the extra cuts are the same code for any world: tests/test_verify.py)
    result = trainproof("verify", "--store", store, "--id", "w2", "--world", "2", "--steps", "6", "--cut", "4",
                        "--cuts", "4", "--keep-evidence",  # a test below reads the resume path's generation
                        # the objective check over 2 ranks: the --fsdp protocol (tests/test_verify_fsdp.py)
                        "--no-objective-check")
    return {"store": store, "result": result, "report": read_report(store, "w2")}


def test_world2_protocol_and_equivalence_pass(world2):
    result, report = world2["result"], world2["report"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert report["completed"] and report["failing_checks"] == [], report["failing_checks"]
    assert (report["all_checks_passed"], report["positive"], report["negative_divergence_detected"],
            report["cut_checkpoint_ok"], report["export_reload_ok"]) == (True,) * 5
    assert report["world_equivalence_passed"] is True and report["world_negative_detected"] is True
    assert report["settings"]["world"] == 2
    # the resume stays bitwise with 2 ranks on the CPU
    assert all(c["max_abs_diff"] == 0.0 and c["within_tolerance"] for c in checks(report, "resume").values())
    assert "world_equivalence_passed: true" in result.stdout and "world_negative_detected: true" in result.stdout
    assert "world-size equivalence" in result.stdout


def test_every_path_ran_with_two_ranks_and_was_read_back_with_its_rank_files(world2):
    report = world2["report"]
    for name in ("continuous", "cut", "resume", "resume_without_rng"):
        assert "--nproc-per-node 2" in report["paths"][name]["command"], name
    assert (report["paths"]["resume"]["resumed_from"], report["paths"]["resume"]["rng_restored"]) == (4, True)
    assert report["paths"]["resume_without_rng"]["rng_restored"] is False
    gen = open_store(f"{world2['store']}/verification/w2/resume").load(6)
    assert gen.info.manifest["world"] == 2 and "rank-00001.pt" in gen.files


def test_world_equivalence_block(world2):
    w = world2["report"]["world_equivalence"]
    assert w["world"] == 2 and w["passed"] is True and w["tolerance"] == {"atol": TOLERANCE, "rtol": 0.0,
                                                                          "dtype": "float64"}
    assert set(w["max_abs_diff"]) == {"parameters", "optimizer", "losses"}
    assert all(v <= TOLERANCE for v in w["max_abs_diff"].values()), w["max_abs_diff"]
    assert "not bitwise" in w["reason"] and w["same_experience"] is True
    cfg = w["configuration"]
    assert (cfg["dropout"], cfg["gain"], cfg["noise"], cfg["global_batch_size"]) == (0.0, 0.0, 0.0, 8)
    neg = w["negative_control"]
    assert neg["detected"] is True
    assert neg["max_abs_diff"]["parameters"] > 1e3 * max(w["max_abs_diff"]["parameters"], 1e-15)
    assert "--nproc-per-node 2" in w["paths"]["w_ranks"]["command"]
    assert "--nproc-per-node" not in w["paths"]["one_rank"]["command"]


def test_a_resume_on_one_rank_carries_over_exactly_what_the_layout_does_not_change(world2):
    """The 2-rank cut resumed on one rank (``--allow-world-change``): replicated, so everything restored is compared
    exactly (model and Adam's moments too), and after the updates the counters, schedule and data order."""
    report = world2["report"]
    w = report["world_change"]
    assert report["world_change_passed"] is True and w["passed"] is True
    assert w["resumed_on_another_world"] == {"from": 2, "to": 1, "at_step": 4, "compared_at_step": 6}
    for block, names in ((w["restored"], RESTORED), (w["after"], AFTER)):
        assert set(block["checks"]) == set(names), block
        assert all(c["within_tolerance"] and c["max_abs_diff"] == 0.0 for c in block["checks"].values()), block
    assert w["restored"]["not_applicable"] == {} and w["restored"]["not_compared"] is None
    assert w["worlds"]["exercised"] == [1, 2] and w["worlds"]["by_path"]["world_change"] == 1
    assert w["worlds"]["by_path"]["continuous"] == 2 and w["worlds"]["by_path"]["one_rank"] == 1
    assert "--allow-world-change" in w["path"]["command"] and "--nproc-per-node" not in w["path"]["command"]
    assert w["path"]["resumed_from"] == 4 and w["path"]["rng_restored"] is True
    assert "worlds exercised: [1, 2] (world_change: the 2-rank cut at step 4 resumed on 1)" in world2["result"].stdout


def _record(step: str, weight: str) -> dict:
    return {"optimizer": {"state.0.step": step, "state.0.exp_avg": weight, "param_groups.0.lr": "float 0.1"},
            "parameters": {"w": weight}, "scheduler": {"last_epoch": "int 4"}}


def test_the_restored_comparison_splits_counters_from_moments_and_skips_shards():
    live = _record("float32 4.0", "sha:a")
    assert all(d.within for d in compare_restored(live, _record("float32 4.0", "sha:a"), sharded=False,
                                                  step=4).values())
    zeroed = compare_restored(live, _record("float32 0.0", "sha:a"), sharded=True, step=4)
    assert set(zeroed) == set(RESTORED) - set(SHARD_LOCAL)  # a shard's fingerprint depends on the world
    assert [n for n, d in zeroed.items() if not d.within] == ["optimizer_counters"]
    assert "state.0.step" in zeroed["optimizer_counters"].detail
    moved = compare_restored(live, _record("float32 4.0", "sha:b"), sharded=False, step=4)
    assert sorted(n for n, d in moved.items() if not d.within) == ["optimizer_moments", "parameters"]


def _history(*steps: list[int]) -> dict:
    import torch

    offsets = [0]
    for ids in steps:
        offsets.append(offsets[-1] + len(ids))
    return {"history": {"sample_ids": torch.tensor([i for ids in steps for i in ids]),
                        "sample_offsets": torch.tensor(offsets)}}


def test_the_data_order_after_the_change_is_the_continuous_streams_prefix():
    continuous = _history([0, 1], [2, 3, 4, 5], [6, 7, 8, 9])  # 2 ranks x 2 after the cut at step 1
    assert data_order(continuous, _history([0, 1], [2, 3], [4, 5]), 1).within  # one rank: 2 a step, same order
    assert not data_order(continuous, _history([0, 1], [2, 3], [2, 3]), 1).within  # a repeated batch
    assert not data_order(continuous, _history([0, 1]), 1).within  # nothing trained after the cut
    assert isinstance(data_order(continuous, _history([0, 1], [2, 3, 4, 5, 6, 7, 8, 9, 10]), 1), Diff)
    assert not data_order(continuous, _history([0, 1], [2, 3, 4, 5, 6, 7, 8, 9, 10]), 1).within  # more than it


def test_the_world_change_halves_the_world_or_falls_back_to_one_rank_where_train_would_refuse_it():
    assert [target_world(w) for w in (2, 3, 4, 8)] == [1, 1, 2, 4]
    # 4 ranks cut mid-epoch; on 2 ranks x 4 the epoch's 30 samples left end in a step of 6: fine
    assert fitting_world({"drawn": True, "cursor": 10, "num_samples": 40}, 2, 4) == 2
    # 33 left: the last step would hold 1 sample for 2 ranks (train exits 2): one rank instead
    assert fitting_world({"drawn": True, "cursor": 7, "num_samples": 40}, 2, 4) == 1


def test_equivalence_config_splits_the_tail_unevenly():
    for world in (2, 3, 4):
        rows, global_batch = equivalence_config(world)["rows"], 4 * world
        tail = rows % global_batch
        assert world <= tail < global_batch and tail % world != 0


def _verdicts(diffs, same=True):
    w = WorldEquivalence(world=2, root_url="unused", seed=1, device="cpu", store_args=[], opener=None)
    w.diffs, w.same_experience = diffs, {"w_ranks": same, "per_rank_mean": same}
    return w.passed, w.negative_detected, w.failing()


def test_verdicts_fail_on_a_difference_or_an_undetected_negative():
    small, big = dict.fromkeys(("parameters", "optimizer", "losses"), 1e-15), dict.fromkeys(
        ("parameters", "optimizer", "losses"), 1e-2)
    assert _verdicts({"w_ranks": small, "per_rank_mean": big}) == (True, True, [])
    passed, detected, failing = _verdicts({"w_ranks": big, "per_rank_mean": big})
    assert (passed, detected) == (False, True) and "world_equivalence.parameters" in failing
    passed, detected, failing = _verdicts({"w_ranks": small, "per_rank_mean": small})
    assert (passed, detected) == (True, False) and failing == ["world_negative: per-rank mean not detected"]
    assert _verdicts({"w_ranks": small, "per_rank_mean": big}, same=False)[:2] == (False, False)


def _sgd_state(world: int, lr: float, *, steps: int = 2) -> dict:
    """A final state of plain SGD without momentum (its optimizer keeps no per-parameter state), as a run's."""
    import torch

    from trainproof.format.state import History

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    history = History()
    x = torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(4, 2)
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        history.append(step=step, epoch=0, loss=loss.item(), lr=lr, targets=4, sample_ids=[0, 1, 2, 3])
    assert opt.state_dict()["state"] == {}
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "history": history.state_dict(),
            "meta": {"world": world}}


def test_an_optimizer_without_state_is_compared_not_crashed_on():
    """Plain SGD keeps no optimizer state: the world-size comparison gives a result (optimizer difference 0) instead
    of raising on an empty maximum, and its verdicts follow from the parameters and losses."""
    from trainproof.proof.world import max_differences  # the name the world-size check compares with

    one, same = _sgd_state(1, 0.1), _sgd_state(2, 0.1)
    assert max_differences(one, _sgd_state(2, 0.2))["optimizer"] == 0.0
    w = WorldEquivalence(world=2, root_url="unused", seed=1, device="cpu", store_args=[], opener=None)
    w.compare_states({"one_rank": one, "w_ranks": same, "per_rank_mean": _sgd_state(2, 0.1)})
    assert w.diffs["w_ranks"] == {"parameters": 0.0, "optimizer": 0.0, "losses": 0.0}
    assert w.passed and not w.negative_detected  # the negative control differs in the optimizer too, or is missed
    assert w.failing() == ["world_negative: per-rank mean not detected"]


def test_world_option_is_validated(cli, tmp_path):
    result = cli("verify", "--store", str(tmp_path / "run"), "--world", "0")
    assert result.exit_code == 2
    result = cli("verify", "--store", str(tmp_path / "run"), "--audit", "--world", "2")
    assert result.exit_code == 2


@pytest.mark.slow  # 4 two-rank paths; the verdict logic is covered by test_verdicts_fail_on_a_difference...
def test_a_per_rank_normalisation_fails_the_equivalence_with_exit_1(tmp_path):
    """The sabotage the check exists for: every W-rank run normalises per rank (the hook inherited by every
    process). The protocol still passes (every path is equally wrong), the equivalence does not: exit 1."""
    store = str(tmp_path / "run")
    result = trainproof("verify", "--store", store, "--id", "bad", "--world", "2", "--steps", "4", "--cut", "2",
                        "--no-export", env={"TPHOOK_PER_RANK_MEAN": "1"})
    assert result.returncode == 1, result.stderr[-3000:]
    report = read_report(store, "bad")
    assert report["positive"] is True and report["all_checks_passed"] is False
    assert report["world_equivalence_passed"] is False
    assert "world_equivalence.parameters" in report["failing_checks"]
    assert report["world_equivalence"]["max_abs_diff"]["parameters"] > TOLERANCE
