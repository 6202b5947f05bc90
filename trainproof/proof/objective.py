"""The objective-equivalence check: the objective the trainer really optimises is the one the run declares.

Every task declares the global mean over the real targets of a step (``Task.loss_sum`` returns a *sum*, the
trainer divides by the step's target count, docs/tasks.md). That is a property of the user's code and of the
trainer together, and it can be checked numerically: the same step must give the same result whether it is
computed as one micro-batch, as several micro-batches of unequal size, or (``--world W``) over W ranks.
A ``loss_sum`` that returns a mean weighs a micro-batch of 3 targets like one of 300 and fails the check.

The runs (each a real ``train`` process, the W-rank ones through the real launcher, under
``<id>/objective/``), all with the same seed and global batch ``G``, so they consume the same samples:

- ``single``: one rank, one micro-batch of ``G`` samples (the reference);
- ``unequal``: one rank, micro-batches of ``m`` and ``G - m`` samples (``m = G // 2 + 1``);
- ``mean_of_means``: as ``unequal`` with the variant ``negative_control: mean-of-microbatch-means`` (each
  micro-batch normalised by its own count, the micro-batches averaged): the negative control, which must
  be detected;
- with ``--world W``: ``w_ranks`` (W ranks, ``G / W`` each, split unequally again) and ``w_mean_of_means``
  (the same with the negative control).

They train ``train --objective-check`` (trainproof.tasks.objective.ObjectiveCheckTask): the task's
``deterministic_objective()`` variant (the built-ins switch dropout, gain and noise off) with every
``nn.Dropout`` and ``nn.MultiheadAttention`` dropout at 0, in float64, for :data:`STEPS` steps. Parameters, optimizer
moments (Adam's first
moment is the gradient itself, scaled) and per-step losses are compared with ``single``: within
:data:`TOLERANCE` (absolute, float64; measured ~1e-16 to 1e-13), and the negative control must differ
by more. Not bitwise: another split adds the same terms in another order.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trainproof.format.layout import flag as layout_flag
from trainproof.proof.check import REFERENCE, Check, Job, Results
from trainproof.proof.equivalence import max_differences, same_experience
from trainproof.proof.paths import Opener, PathResult, RunReader, VerificationIncomplete, job_argv
from trainproof.tasks import Task
from trainproof.tasks.objective import same_task
from trainproof.train.data import epoch_plan
from trainproof.train.variant import Variant

TOLERANCE = 1e-9
"""Absolute, float64: another micro-batch split or world only reorders additions (measured ~1e-16..1e-13)."""
STEPS = 2
NEGATIVE = "mean-of-microbatch-means"
HINT = ("the step's result depends on how it is split: Task.loss_sum must return the SUM of the per-target losses "
        "of its micro-batch (the trainer divides by the step's target count), and count_targets must count exactly "
        "the targets loss_sum sums; a mean weighs a small micro-batch like a large one (docs/tasks.md, 'Return a "
        "sum, not a mean'). If loss_sum does return a sum, make_batch or the model still draws randomness the "
        "check could not switch off: implement Task.deterministic_objective()")


def unequal_micro(batch: int) -> int | None:
    """A micro-batch size that splits ``batch`` into unequal parts (m, batch - m), or None when it cannot."""
    return batch // 2 + 1 if batch >= 3 else (1 if batch == 2 else None)


class ObjectiveCheck(Check):
    """Plan, then compare, the objective-equivalence runs (the protocol launches them with its reference paths)."""

    def __init__(self, *, task: Task, task_name: str, config: str | None, seed: int, device: str, world: int,
                 root_url: str, store_args: list[str], opener: Opener, fsdp: bool = False) -> None:
        self.world, self.root_url, self.opener = world, root_url.rstrip("/"), opener
        same_task(task, task.deterministic_objective())  # another task's objective is refused here: exit 2
        self.global_batch = task.batch_size * world
        per_rank = self.global_batch // world
        epoch_plan(task.num_samples(), per_rank, world)  # a refused plan is a configuration error, here
        micro, micro_w = unequal_micro(self.global_batch), unequal_micro(per_rank)
        self.splits: dict[str, dict[str, Any]] = {"single": {"world": 1, "batch": self.global_batch,
                                                             "micro": self.global_batch}}
        if micro is not None:
            self.splits["unequal"] = {"world": 1, "batch": self.global_batch, "micro": micro}
            self.splits["mean_of_means"] = {**self.splits["unequal"], "negative": True}
        if world > 1:
            self.splits["w_ranks"] = {"world": world, "batch": per_rank, "micro": micro_w or per_rank}
            self.splits["w_mean_of_means"] = {**self.splits["w_ranks"], "negative": True}
        self.common = ["--task", task_name, *(["--config", config] if config else []), "--seed", str(seed),
                       "--steps", str(STEPS), "--checkpoint-every", "0", "--checkpoint-every-seconds", "0",
                       "--keep", "0", "--resume", "never", "--device", device, "--log-format", "json", *store_args,
                       *layout_flag(fsdp)]
        self.urls = {name: f"{self.root_url}/{name}" for name in self.splits}
        self.paths: dict[str, dict[str, Any]] = {}
        self.diffs: dict[str, dict[str, float]] = {}
        self.same: dict[str, bool] = {}

    def jobs(self, phase: str, scratch: Path, done: Results) -> list[Job]:
        """Every run, with the protocol's reference paths (they need nothing of them)."""
        if phase != REFERENCE:
            return []
        out = []
        for name, split in self.splits.items():
            ranks = ["--nproc-per-node", str(split["world"])] if split["world"] > 1 else []
            variant = Variant(objective_check=True, batch_size=split["batch"], micro_batch_size=split["micro"],
                              negative_control=NEGATIVE if split.get("negative") else "none")
            argv = job_argv("train", "--store", self.urls[name], *ranks, *self.common, *variant.argv())
            out.append((f"objective/{name}", self.urls[name], argv))
        return out

    def record(self, phase: str, results: list[PathResult]) -> None:
        """Its runs' entries, in the ``objective_equivalence`` block (by split name)."""
        if phase == REFERENCE:
            self.paths = {r.name.split("/", 1)[1]: r.to_json() for r in results}

    def compare(self, phase: str, results: list[PathResult], done: Results) -> None:
        """Read every run back from the store and compare it with ``single``."""
        if phase != REFERENCE:
            return
        failed = [r for r in results if r.code != 0]
        if failed:
            r = failed[0]
            raise VerificationIncomplete(
                f"objective check: run {r.name!r} exited {r.code}: {r.error or r.stderr_tail}",
                hint=f"the objective check trains your task's deterministic_objective() in float64 with the step "
                     f"split unequally (train --objective-check; its command is in verification.json, "
                     f"objective_equivalence.paths.{r.name.split('/', 1)[-1]}): fix what the error names in the task, "
                     f"or skip the check with --no-objective-check (the verdict then claims nothing about the "
                     f"objective)")
        states = {name: RunReader(f"objective/{name}", url, self.opener).state(STEPS, whole=True)
                  for name, url in self.urls.items()}
        for name in self.splits:
            if name != "single":
                self.same[name] = same_experience(states["single"], states[name])
                self.diffs[name] = max_differences(states["single"], states[name])

    @property
    def positives(self) -> list[str]:
        """The runs that must agree with ``single``."""
        return [n for n, s in self.splits.items() if n != "single" and not s.get("negative")]

    @property
    def negatives(self) -> list[str]:
        """The negative-control runs, which must differ from ``single``."""
        return [n for n, s in self.splits.items() if s.get("negative")]

    @property
    def passed(self) -> bool:
        """Every split agrees with one micro-batch within the tolerance, on the same samples."""
        return bool(self.diffs) and bool(self.positives) and all(
            self.same.get(n) and all(v <= TOLERANCE for v in self.diffs[n].values()) for n in self.positives)

    @property
    def negative_detected(self) -> bool:
        """Every negative control (same samples) differs beyond the tolerance in parameters or optimizer."""
        return bool(self.negatives) and all(
            n in self.diffs and self.same.get(n)
            and max(self.diffs[n]["parameters"], self.diffs[n]["optimizer"]) > TOLERANCE for n in self.negatives)

    def failing(self) -> list[str]:
        """Failed checks, named ``objective.<run>.<check>``."""
        if not self.diffs:
            return []
        out = []
        for n in self.positives:
            if not self.same.get(n):
                out.append(f"objective.{n}.experience")
            out += [f"objective.{n}.{k}" for k, v in self.diffs[n].items() if not v <= TOLERANCE]
        if self.negatives and not self.negative_detected:
            out.append("objective_negative: mean of micro-batch means not detected")
        if not self.positives:
            out.append("objective: the global batch cannot be split (batch_size 1)")
        return out

    def diagnosis(self) -> list[str]:
        """What a failed check most likely means, for the person reading the report."""
        bad = [n for n in self.positives if n in self.diffs and not all(v <= TOLERANCE for v in self.diffs[n].values())]
        if not bad:
            return []
        worst = max(max(self.diffs[n].values()) for n in bad)
        return [f"objective check ({', '.join(bad)} vs one micro-batch; "
                f"max |diff| {_g(worst)} > {TOLERANCE:g}): {HINT}"]

    def verdicts(self) -> dict[str, bool]:
        """``objective_equivalence_passed`` and ``objective_negative_detected``."""
        return {"objective_equivalence_passed": self.passed, "objective_negative_detected": self.negative_detected}

    def sections(self) -> dict[str, Any]:
        """``objective_equivalence``: :meth:`to_json`."""
        return {"objective_equivalence": self.to_json()}

    def to_json(self) -> dict[str, Any]:
        """The ``objective_equivalence`` block of verification.json."""
        return {
            "world": self.world, "steps": STEPS, "global_batch": self.global_batch,
            "tolerance": {"atol": TOLERANCE, "rtol": 0.0, "dtype": "float64"},
            "splits": self.splits, "max_abs_diff": {n: self.diffs.get(n) for n in self.positives},
            "same_experience": {n: self.same.get(n) for n in self.splits if n != "single"},
            "passed": self.passed,
            "negative_control": {"what": "each micro-batch normalised by its own target count and the step's "
                                         "micro-batches averaged (variant negative_control=mean-of-microbatch-means)",
                                 "max_abs_diff": {n: self.diffs.get(n) for n in self.negatives},
                                 "detected": self.negative_detected},
            "configuration": "the task's deterministic_objective() variant, float64, nn.Dropout p=0 (train "
                             "--objective-check); same seed and global batch in every run",
            "paths": self.paths,
        }


def _g(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.3g}"

