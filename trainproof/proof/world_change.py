"""What must not matter is varied: with ``verify --world W`` (W > 1), one more resumed path continues the W-rank cut
on another world size, through the reshard.

Every other path keeps the world it started with, so a restore that is right for W ranks and wrong across a world
change (``train --allow-world-change``: DCP reshards a sharded model and optimizer, every rank's generators are
re-derived) passed: a reshard 2 -> 1 that zeroes Adam's step counters passed every comparison of
``verify --world 2 --fsdp``, while such a run's losses part from the uninterrupted run's.

So :class:`WorldChange` seeds one path (``<id>/world_change/resume_on_<V>``) with a copy of the cut's generation and
resumes it on ``V = W // 2`` ranks (one process for W = 2 or 3; one rank too when the trainer would refuse V ranks at
the cut, an epoch ending in a step with fewer samples than ranks), to the continuous path's last step. The task's
``batch_size`` is per rank, so after the change each step trains ``V * batch_size`` samples instead of ``W *
batch_size``: the trajectory after the change is another experiment, and its parameters, moments and losses are not
compared with the continuous path's (no tolerance could make them comparable). What must be **exactly** equal:

- ``restored``: right after the restore, before the first update, the path's live record (trainproof.train.live)
  against the continuous path's at the cut: the optimizer's step counters and hyper-parameters
  (``optimizer_counters``), the scheduler, the GradScaler, the data position (the global cursor and the data
  generator pair carry over), progress, the task's state; and for a replicated layout the parameters, buffers and
  the optimizer's moments too (a sharded layout's record fingerprints each rank's own shard, which another world
  splits otherwise: not applicable there, and the block says so);
- ``after``: the final states: the step counters and hyper-parameters, the scheduler, the GradScaler, every step's
  learning rate, the next one, the step count, and the data order (the samples the path consumed after the cut
  are the next ones of the continuous path's stream: fewer a step, in the same order).

Never compared: the per-rank generators (re-derived from (seed, rank, step) by design) and ``meta`` (its world).
The block ``world_change`` also lists the world every process of the verification ran with (its ``start`` event);
with ``--world 1`` it has no path and says so.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from trainproof.errors import ContractError
from trainproof.format.shard_files import is_sharded_file
from trainproof.format.state import STATE_FILE, decode
from trainproof.proof.check import COMPARE, RESUMED, Check, Job, Results
from trainproof.proof.compare import EXTRACTORS, SECTIONS, Diff, Tolerance, diff_tree
from trainproof.proof.four_paths import FourPaths
from trainproof.proof.live import compare_records, records
from trainproof.proof.paths import (
    Opener,
    PathResult,
    RunReader,
    VerificationIncomplete,
    require_success,
    seed_copy,
)
from trainproof.proof.settings import ProtocolSettings, train_argv
from trainproof.storage import GenerationStore
from trainproof.train.resume import check_transition

NAME = "world_change"
EXACT = Tolerance.exact("layout-independent state: a world change must carry it over unchanged")
RESTORED = ("optimizer_counters", "parameters", "buffers", "optimizer_moments", "scheduler", "grad_scaler",
            "data_position", "progress", "task_state")
"""Compared right after the restore, before the first update (the live records of trainproof.train.live)."""
SHARD_LOCAL = ("parameters", "buffers", "optimizer_moments")
"""A sharded layout's live record fingerprints each rank's own shard of these: another world, other shards."""
AFTER = ("optimizer_counters", "scheduler", "grad_scaler", "learning_rates", "next_lr", "steps", "data_order")
"""Compared in the final state, after the updates on the new world."""
NOT_COMPARED = {
    "parameters, optimizer moments and losses after the change": (
        "the task's batch_size is per rank: on V ranks each step trains V * batch_size samples instead of W * "
        "batch_size, another experiment (their restored values are compared exactly, before the first update)"),
    "samples seen, epoch and cursor after the change": "fewer samples a step, as above (the order is data_order)",
    "rng_states, rng_next_draws": "every rank's generators are re-derived from (seed, rank, step) on a world change "
                                  "(by design; the data generator carries over: data_position)",
    "configuration": "meta records the world and the world change, which differ by design",
}
COUNTER_KEYS = frozenset({"step"})
"""Per-parameter optimizer state that counts rather than measures (torch's Adam, AdamW, NAdam, Adagrad ...)."""


def target_world(world: int) -> int:
    """The world the path resumes on: half of W (at least one rank), so it always differs from W."""
    return max(1, world // 2)


def fitting_world(data: dict[str, Any], world: int, per_rank_batch: int) -> int:
    """``world``, or one rank when, from the data position ``data``, the epoch would end in a step with fewer samples
    than ``world`` ranks (``train`` refuses such a change: trainproof.train.resume.check_transition)."""
    try:
        check_transition(data, world, world * per_rank_batch)
    except ContractError:
        return 1
    return world


def _counter_key(key: str) -> bool:
    """A live record's optimizer key (``state.0.step``, ``param_groups.0.lr``) that does not depend on the layout."""
    return key.startswith("param_groups") or key.rsplit(".", 1)[-1] in COUNTER_KEYS


def restored_records(record: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """A live record (trainproof.train.live) with its optimizer split into counters and moments, reduced to
    :data:`RESTORED`."""
    optimizer = record.get("optimizer") or {}
    split = {"optimizer_counters": {k: v for k, v in optimizer.items() if _counter_key(k)},
             "optimizer_moments": {k: v for k, v in optimizer.items() if not _counter_key(k)}}
    return {c: split[c] if c in split else (record.get(c) or {}) for c in RESTORED}


def compare_restored(live: dict[str, dict[str, str]], restored: dict[str, dict[str, str]], *, sharded: bool,
                     step: int) -> dict[str, Diff]:
    """The continuous path's live record at the cut against the world-changed path's right after restoring:
    exactly, every component of :data:`RESTORED` (without :data:`SHARD_LOCAL` for a sharded layout)."""
    wanted = [c for c in RESTORED if not (sharded and c in SHARD_LOCAL)]
    diffs = compare_records(restored_records(live), restored_records(restored), path=NAME, step=step)
    return {c: diffs[c] for c in wanted}


def _stream_after(state: dict[str, Any], cut: int) -> torch.Tensor:
    """Every sample id the history's steps after ``cut`` consumed, in order."""
    offsets = state["history"]["sample_offsets"]
    return state["history"]["sample_ids"][int(offsets[cut]):]


def data_order(ref: dict[str, Any], other: dict[str, Any], cut: int) -> Diff:
    """The samples the world-changed path consumed after the cut are the next ones of the continuous path's stream
    (the data order carries over; fewer a step)."""
    a, b = _stream_after(ref, cut), _stream_after(other, cut)
    if not 0 < len(b) <= len(a):
        return Diff(problems=[f"data_order: {len(b)} samples after step {cut}, the continuous path {len(a)}"])
    return diff_tree(a[: len(b)], b, EXACT, "data_order")


_AFTER_PARTS = {
    **{n: EXTRACTORS[n] for n in ("scheduler", "grad_scaler", "learning_rates", "next_lr")},
    "steps": lambda s, _: {"progress.step": s["progress"]["step"], "history.step": s["history"]["step"]},
}


def _part(name: str, extract: Any, ref: dict[str, Any], other: dict[str, Any], names: frozenset[str]) -> Diff:
    try:
        a, b = extract(ref, names), extract(other, names)
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        return Diff(problems=[f"{name}: section missing or malformed ({type(exc).__name__}: {exc})"])
    return diff_tree(a, b, EXACT, name)


def compare_after(ref: dict[str, Any], other: dict[str, Any], cut: int, names: frozenset[str]) -> dict[str, Diff]:
    """Every check of :data:`AFTER` between the continuous path's final state and the world-changed path's."""
    diffs = {n: _part(n, extract, ref, other, names) for n, extract in _AFTER_PARTS.items()}
    try:
        diffs["data_order"] = data_order(ref, other, cut)
    except (KeyError, TypeError, IndexError) as exc:
        diffs["data_order"] = Diff(problems=[f"data_order: history missing or malformed ({exc})"])
    diffs["optimizer_counters"] = optimizer_counters(ref, other)
    return {n: diffs[n] for n in AFTER}


def split_optimizer(optimizer: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state_dict's counters and hyper-parameters (what does not depend on the layout)."""
    state = optimizer.get("state") or {}
    return {"state": {k: {n: v for n, v in slot.items() if n in COUNTER_KEYS} for k, slot in state.items()},
            "param_groups": optimizer.get("param_groups")}


def optimizer_counters(ref: dict[str, Any], other: dict[str, Any]) -> Diff:
    """The optimizer's step counters and hyper-parameters, exactly (a sharded state: only those entries read)."""
    if SECTIONS in ref and SECTIONS in other:
        a, b = ref[SECTIONS], other[SECTIONS]
        mine = sorted(f for f, e in a.entries.items() if e.path[0] != "model" and _counter_path(e.path))
        theirs = sorted(f for f, e in b.entries.items() if e.path[0] != "model" and _counter_path(e.path))
        out = Diff()
        if mine != theirs:
            out.problems.append(f"optimizer: entries {sorted(set(mine) ^ set(theirs))[:6]} present on one side only")
        keys = [f for f in mine if f in theirs]
        return diff_tree(a.read(keys), b.read(keys), EXACT, "optimizer", out)
    try:
        return diff_tree(split_optimizer(_whole(ref)["optimizer"]), split_optimizer(_whole(other)["optimizer"]),
                         EXACT, "optimizer")
    except (KeyError, TypeError, AttributeError) as exc:
        return Diff(problems=[f"optimizer: section missing or malformed ({exc})"])


def _counter_path(path: tuple) -> bool:
    return path[1:2] == ("param_groups",) or path[-1] in COUNTER_KEYS


def _whole(state: dict[str, Any]) -> dict[str, Any]:
    if SECTIONS not in state:
        return state
    model, optimizer = state[SECTIONS].whole()
    return {**state, "model": model, "optimizer": optimizer}


class WorldChange(Check):
    """The resume on another world size (W > 1), and the worlds every process of the verification ran with."""

    def __init__(self, *, settings: ProtocolSettings, four: FourPaths, root_url: str, opener: Opener) -> None:
        self.s, self.four, self.opener = settings, four, opener
        self.to = target_world(settings.world) if settings.world > 1 else None
        """The world the path resumes on (one rank instead when the trainer would refuse W // 2 at the cut)."""
        self.root_url = root_url.rstrip("/")
        self.path: dict[str, Any] | None = None
        self.restored: dict[str, Diff] = {}
        self.after: dict[str, Diff] = {}
        self.why_not_restored: str | None = None
        """Why the restored state was not compared (None: it was)."""
        self.ran: dict[str, int] = {}
        """The world each process reported in its ``start`` event, by name."""
        self.compared = False

    @property
    def active(self) -> bool:
        return self.to is not None

    @property
    def url(self) -> str:
        return f"{self.root_url}/{NAME}/resume_on_{self.to}"

    def _fitting_world(self, cut_store: GenerationStore) -> int:
        """:func:`fitting_world` at the cut's data position."""
        if self.to in (None, 1):
            return 1
        data = decode(cut_store.load(self.s.cut, skip=is_sharded_file).files[STATE_FILE])["ranks"][0]["data"]
        return fitting_world(data, self.to, self.four.task.batch_size)

    def argv(self) -> list[str]:
        """The path's command line: the protocol's resumed path on :attr:`to` ranks, allowed to change the world,
        recording its live state right after restoring (when the continuous path records it at the cut)."""
        s = replace(self.s, world=self.to or 1)
        live = (self.s.cut,) if self.s.cut in self.s.live_at else None
        return [*train_argv(s, self.url, steps=self.s.steps - self.s.cut, every=0, resume=True, live=live),
                "--allow-world-change"]

    def jobs(self, phase: str, scratch: Path, done: Results) -> list[Job]:
        """In the resumed phase, the path, seeded with a copy of the cut's generation."""
        if phase != RESUMED or not self.active:
            return []
        cut_store = self.opener(self.four.urls["cut"])
        self.to = self._fitting_world(cut_store)
        seed_copy(self.opener(self.url), cut_store, self.s.cut)
        return [(NAME, self.url, self.argv())]

    def record(self, phase: str, results: list[PathResult]) -> None:
        if results:
            self.path = results[0].to_json()

    def compare(self, phase: str, results: list[PathResult], done: Results) -> None:
        """Every phase: the worlds the processes reported. The resumed phase: the path resumed the cut on
        :attr:`to` ranks. The compare phase: its restored state and its final state against the continuous path's."""
        for name, run in done.runs.items():
            start = run.event("start")
            if start is not None and isinstance(start.get("world"), int):
                self.ran[name] = start["world"]
        if phase == RESUMED and results:
            require_success(results)
            event = results[0].event("resume") or {}
            want = {"step": self.s.cut, "from": self.s.world, "to": self.to}
            if event.get("step") != self.s.cut or event.get("world_change") != want:
                raise VerificationIncomplete(f"path {NAME!r} did not resume the cut on another world size "
                                             f"(resume event {event}; expected a world change {want})")
        elif phase == COMPARE and self.active:
            self._compare(done)

    def _compare(self, done: Results) -> None:
        cut, steps = self.s.cut, self.s.steps
        live, restored = records(done.runs.get("continuous")).get(cut), records(done.runs.get(NAME)).get(cut)
        if live is None or restored is None:
            self.why_not_restored = (f"no live record at step {cut} ({'continuous' if live is None else NAME}): "
                                     "a reused reference's continuous path recorded none")
        else:
            self.restored = compare_restored(live, restored, sharded=self.s.fsdp, step=cut)
        ref = RunReader("continuous", self.four.urls["continuous"], self.opener).state(steps)
        other = RunReader(NAME, self.url, self.opener).state(steps)
        if other["meta"].get("world") != self.to:
            raise VerificationIncomplete(f"path {NAME!r} ran with world {other['meta'].get('world')}, not {self.to}")
        self.after = compare_after(ref, other, cut, self.four.param_names)
        self.compared = True

    @property
    def passed(self) -> bool:
        """Compared, and every comparison exact (True with ``--world 1``: nothing to judge)."""
        if not self.active:
            return True
        return self.compared and all(d.within for d in [*self.restored.values(), *self.after.values()])

    def failing(self) -> list[str]:
        return ([f"{NAME}.restored.{n}" for n, d in self.restored.items() if not d.within]
                + [f"{NAME}.after.{n}" for n, d in self.after.items() if not d.within])

    def verdicts(self) -> dict[str, bool]:
        """``world_change_passed`` (W > 1 only)."""
        return {f"{NAME}_passed": self.passed} if self.active else {}

    def sections(self) -> dict[str, Any]:
        """The ``world_change`` block: the worlds exercised, and (W > 1) the path and its comparisons."""
        worlds = {"by_path": dict(sorted(self.ran.items())), "exercised": sorted(set(self.ran.values()))}
        if not self.active:
            return {NAME: {"worlds": worlds, "resumed_on_another_world": None,
                           "why": "--world 1: every path runs on one rank; verify --world W (W > 1) adds a resume "
                                  "of the W-rank cut on W // 2 ranks"}}
        sharded = ("a sharded layout's live record fingerprints each rank's own shard, which another world "
                   "splits otherwise" if self.s.fsdp else None)
        return {NAME: {
            "worlds": worlds,
            "resumed_on_another_world": {"from": self.s.world, "to": self.to, "at_step": self.s.cut,
                                         "compared_at_step": self.s.steps},
            "passed": self.passed if self.compared else False, "mode": "exact",
            "restored": {"at_step": self.s.cut, "not_compared": self.why_not_restored,
                         "checks": {n: d.to_json(n, EXACT) for n, d in self.restored.items()},
                         "not_applicable": {c: sharded for c in SHARD_LOCAL} if sharded else {}},
            "after": {"at_step": self.s.steps, "checks": {n: d.to_json(n, EXACT) for n, d in self.after.items()}},
            "not_compared": NOT_COMPARED, "path": self.path}}
