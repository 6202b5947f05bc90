"""The verifier's comparison of sharded states a group of entries at a time (trainproof.proof.compare ``compare_sections``,
trainproof.train.fsdp ``ShardedSections``): the same verdicts, largest differences and parameter distance as comparing the
states read whole, while no read holds more than one group of each side, and the reference's bytes are read once
whatever the number of states compared with it.

Sharded generations are written in this process (DCP, world 1, no process group: trainproof.train.sharded
``save_sharded``) into a local store, then read back through the verified reader, as the verifier reads a path.
"""

from __future__ import annotations

import math

import pytest
import torch

import trainproof.proof.compare as compare_module
from trainproof.errors import ConfigError
from trainproof.proof.compare import (SECTIONS, Diff, Tolerance, compare_all, compare_sections, diff_tree, group_bytes,
                               parameter_distance)
from trainproof.train import sharded
from trainproof.train.fsdp import ShardedSections
from trainproof.storage import open_store

CONTRACT = "c" * 64
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
NAMES = frozenset({"enc.weight", "enc.bias", "head.weight"})  # parameters; "norm.running_mean" is a buffer


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = {"enc.weight": torch.randn(64, 32, generator=g), "enc.bias": torch.randn(64, generator=g),
             "head.weight": torch.randn(8, 64, generator=g, dtype=torch.float64),
             "norm.running_mean": torch.randn(64, generator=g)}
    params = ["enc.weight", "enc.bias", "head.weight"]
    optim = {"state": {k: {"step": torch.tensor(3.0),
                           "exp_avg": torch.randn(model[k].shape, generator=g, dtype=model[k].dtype),
                           "exp_avg_sq": torch.rand(model[k].shape, generator=g, dtype=model[k].dtype)}
                       for k in params},
             "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": params}]}
    return {"model": model, "optim": optim}


def _save(tmp_path, step: int, state: dict) -> ShardedSections:
    store = open_store(str(tmp_path / "run"))
    sharded.save_sharded(store, step, state, contract=CONTRACT, world=1, code_version="t")
    return ShardedSections(store, step)


def _variants() -> dict[str, dict]:
    """Each a copy of _state() with one kind of difference."""
    out = {"same": _state()}
    s = _state()
    s["model"]["enc.weight"][63, 31] += 1e-3  # the last element: in the last slice and the last bytes
    out["parameter"] = s
    s = _state()
    s["model"]["norm.running_mean"][5] = float("nan")
    out["buffer_nan"] = s
    s = _state()
    s["optim"]["state"]["head.weight"]["exp_avg_sq"] *= 2
    out["moment"] = s
    s = _state()
    s["optim"]["param_groups"][0]["lr"] = 0.02
    out["lr"] = s
    s = _state()
    s["model"]["enc.bias"] = s["model"]["enc.bias"][:63].clone()
    moments = s["optim"]["state"]["enc.bias"]
    s["optim"]["state"]["enc.bias"] = {k: v[:63].clone() if v.dim() else v for k, v in moments.items()}
    out["shape"] = s
    return out


def _same(a: Diff, b: Diff) -> None:
    assert (a.within, a.exceeded, a.max_abs, a.problems, a.detail) == (b.within, b.exceeded, b.max_abs, b.problems,
                                                                       b.detail)


@pytest.mark.parametrize("budget", [1, 3000, 1 << 30])  # one entry a group (tiny), a few, everything at once
def test_streamed_comparison_gives_the_verdicts_of_the_whole_one(tmp_path, budget):
    ref = _save(tmp_path, 1, _state())
    others = {name: _save(tmp_path, 2 + i, state) for i, (name, state) in enumerate(_variants().items())}
    streamed = compare_sections(ref, others, Tolerance(), NAMES, budget=budget)
    model, optim = ref.whole()
    whole_ref = {"model": model, "optimizer": optim}
    for name, sections in others.items():
        m, o = sections.whole()
        whole_other = {"model": m, "optimizer": o}
        diffs, distance = streamed[name]
        for check, extract in (("parameters", lambda s: {k: v for k, v in s["model"].items() if k in NAMES}),
                               ("buffers", lambda s: {k: v for k, v in s["model"].items() if k not in NAMES}),
                               ("optimizer", lambda s: s["optimizer"])):
            _same(diffs[check], diff_tree(extract(whole_ref), extract(whole_other), Tolerance(), check))
        want = parameter_distance(whole_ref, whole_other, NAMES)
        assert (distance is None) == (want is None) and (want is None or distance == pytest.approx(want, rel=1e-12))
    verdicts = {n: {c: d.within for c, d in streamed[n][0].items()} for n in others}
    assert verdicts["same"] == {"parameters": True, "buffers": True, "optimizer": True}
    assert verdicts["parameter"] == {"parameters": False, "buffers": True, "optimizer": True}
    assert streamed["parameter"][0]["parameters"].detail.startswith("parameters.enc.weight: max |diff| 0.001")
    assert streamed["parameter"][1] == pytest.approx(1e-3, rel=1e-3)
    assert streamed["buffer_nan"][0]["buffers"].problems == ["buffers.norm.running_mean: non-finite values (compared)"]
    assert verdicts["moment"]["optimizer"] is False and "optimizer.state.head.weight.exp_avg_sq" in \
        streamed["moment"][0]["optimizer"].detail
    assert "optimizer.param_groups[0].lr: 0.01 vs 0.02" in streamed["lr"][0]["optimizer"].detail
    assert streamed["shape"][1] is None and "parameters.enc.bias: torch.float32(64,) vs torch.float32(63,)" in \
        streamed["shape"][0]["parameters"].problems
    assert streamed["same"][1] == 0.0


def test_an_entry_on_one_side_only_is_a_problem_of_its_check(tmp_path):
    ref = _save(tmp_path, 1, _state())
    s = _state()
    del s["optim"]["state"]["enc.bias"]["exp_avg_sq"]
    s["model"]["extra.weight"] = torch.ones(2)
    diffs, distance = compare_sections(ref, {"o": _save(tmp_path, 2, s)}, Tolerance(),
                                       NAMES | {"extra.weight"}, budget=1)["o"]
    assert diffs["optimizer"].problems == ["optimizer: entries ['optimizer.state.enc.bias.exp_avg_sq'] present on "
                                           "one side only"]
    assert diffs["parameters"].problems == ["parameters: entries ['parameters.extra.weight'] present on one side only"]
    assert distance is None and diffs["buffers"].within


def test_each_read_holds_one_group_and_the_reference_is_read_once_for_every_other_state(tmp_path, monkeypatch):
    ref = _save(tmp_path, 1, _state())
    others = {f"o{i}": _save(tmp_path, 2 + i, _state(seed=i)) for i in range(3)}
    reads: list[tuple[int, list[str]]] = []
    original = ShardedSections.read

    def counted(self, fqns):
        reads.append((self.step, list(fqns)))
        return original(self, fqns)

    monkeypatch.setattr(ShardedSections, "read", counted)
    budget = 9000  # bytes: enc.weight (8 KiB) alone, the rest in a few groups
    compare_sections(ref, others, Tolerance(), NAMES, budget=budget)
    largest = max(e.nbytes for e in ref.entries.values())
    for step, fqns in reads:
        held = sum(ref.entries[f].nbytes for f in fqns)
        assert held <= max(budget, largest), (step, fqns, held)
    of_ref = [f for step, fqns in reads if step == 1 for f in fqns]
    assert sorted(of_ref) == sorted(ref.entries)  # every entry of the reference read, each exactly once
    assert len([1 for step, _ in reads if step == 1]) >= 4  # in several groups
    for step in (2, 3, 4):
        assert sorted(f for s, fqns in reads if s == step for f in fqns) == sorted(ref.entries)


def test_compare_all_reads_sharded_states_by_groups_and_whole_ones_as_before(tmp_path):
    ref_sections, other_sections = _save(tmp_path, 1, _state()), _save(tmp_path, 2, _variants()["parameter"])
    common = {"meta": {"fsdp": True}, "history": {}, "progress": {}, "ranks": [], "scheduler": {}, "scaler": {}}
    ref = {**common, "model": {}, "optimizer": {}, SECTIONS: ref_sections}
    other = {**common, "model": {}, "optimizer": {}, SECTIONS: other_sections}
    (diffs, distance), = compare_all(ref, {"o": other}, Tolerance(), NAMES).values()
    m, o = other_sections.whole()
    whole_other = {**common, "model": m, "optimizer": o}  # one side whole: the sharded side is read whole too
    (diffs_mixed, distance_mixed), = compare_all(ref, {"o": whole_other}, Tolerance(), NAMES).values()
    assert set(diffs) == set(diffs_mixed) == set(compare_module.EXTRACTORS)
    for check in ("parameters", "buffers", "optimizer"):
        assert diffs[check].within == diffs_mixed[check].within and diffs[check].max_abs == diffs_mixed[check].max_abs
    assert not diffs["parameters"].within and distance == pytest.approx(distance_mixed, rel=1e-12)
    assert compare_all(ref, {}, Tolerance(), NAMES) == {}


def test_a_tensor_is_compared_a_slice_at_a_time_with_the_same_result(monkeypatch):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(10, 13, generator=g)
    cases = {"equal": a.clone(), "last": a.clone(), "first": a.clone(), "nan_last": a.clone(),
             "t": a.t().contiguous().t()}
    cases["last"][9, 12] += 0.5
    cases["first"][0, 0] -= 0.25
    cases["nan_last"][9, 12] = float("inf")
    whole = {k: diff_tree(a, v, Tolerance(atol=1e-3), "x") for k, v in cases.items()}
    monkeypatch.setattr(compare_module, "SLICE", 7)
    sliced = {k: diff_tree(a, v, Tolerance(atol=1e-3), "x") for k, v in cases.items()}
    for k in cases:
        _same(whole[k], sliced[k])
    assert sliced["last"].detail == "x: max |diff| 0.5" and sliced["nan_last"].problems == [
        "x: non-finite values (compared)"]
    assert sliced["nan_last"].max_abs == 0.0  # as whole: a side with inf or NaN gives no difference, a problem
    ints = torch.arange(20)
    other = ints.clone()
    other[19] = 40
    _same(diff_tree(ints, other, Tolerance(), "i"),
          Diff(max_abs=21.0, exceeded=True, detail="i: 1 of 20 values differ"))
    moved = float(cases["last"][9, 12].double() - a[9, 12].double())  # 0.5 in float32's rounding
    assert compare_module._squared_distance(a, cases["last"]) == moved**2


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "lots"])
def test_a_bad_group_size_is_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv("TRAINPROOF_COMPARE_GROUP_MIB", raw)
    with pytest.raises(ConfigError, match="TRAINPROOF_COMPARE_GROUP_MIB"):
        group_bytes()


def test_the_group_size_defaults_to_256_mib_and_takes_fractions(monkeypatch):
    monkeypatch.delenv("TRAINPROOF_COMPARE_GROUP_MIB", raising=False)
    assert group_bytes() == 256 << 20
    monkeypatch.setenv("TRAINPROOF_COMPARE_GROUP_MIB", "0.5")
    assert group_bytes() == 1 << 19
    assert math.isclose(group_bytes() / 2**20, 0.5)
