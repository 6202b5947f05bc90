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

Split invariance cannot tell a correct sum from a sum of per-sample means (each is a sum over samples, which any split
adds up alike), though the latter weighs a sequence of 2 tokens like one of 200. So where the task gives its unreduced
per-target losses (``Task.target_losses``; ``DatasetTask`` gives ``per_sample_loss``'s), the ``single`` run also prints
them for each step (``target_losses`` events, computed on the same model and batch as ``loss_sum``, without gradient),
and the **declared objective** is checked (:func:`declared_objective`, ``objective_equivalence.declared_objective``):
their number must be the step's ``count_targets``, and the loss the trainer trained on their mean, within
:data:`DECLARED_RTOL`. A failure (``objective.declared_reduction``) says what the loss looks like instead (a sum of
per-sample means, a mean of per-sample means, a sum ...). A task that gives none gets that part reported as not
applicable, with the reason.

Where the check cannot apply (:func:`not_applicable`), it runs nothing and reports why (``objective_equivalence:
{"not_applicable": why}``), never a failure that blames the loss:

- **a model that normalises over the batch** (any BatchNorm in training mode): another split gives its layers other
  batch statistics, so a correct ``loss_sum`` differs too. When the task itself splits its steps (micro-batches,
  or ranks with ``--world W``), each part is normalised on its own statistics: what is trained is not what one
  batch would train. That is a *finding* (``findings``, naming the modules), not a failure;
- **batches that still draw** after ``deterministic_objective()`` (a collate that mixes samples, mixup): another
  split draws other numbers. Switching them off (``DatasetTask(eval_collate=...)``, or the task's own
  ``deterministic_objective()``) makes the check apply again.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainproof.format.layout import flag as layout_flag
from trainproof.proof.check import REFERENCE, Check, Job, NotApplicable, Results
from trainproof.proof.equivalence import max_differences, same_experience
from trainproof.proof.paths import Opener, PathResult, RunReader, VerificationIncomplete, job_argv
from trainproof.tasks import Task
from trainproof.tasks.batches import BatchRequest, batch_generators, map_tensors
from trainproof.tasks.objective import same_task
from trainproof.train.data import epoch_plan
from trainproof.train.variant import Variant

DECLARED_RTOL = 1e-9
"""The declared-objective check's tolerance, relative to the mean magnitude of the step's target losses (float64): the
trained loss and the mean of ``Task.target_losses`` add the same terms in another order (a reduction inside
``loss_sum`` against a sum of the unreduced values), an error of at most ~n * 1e-16 of that magnitude."""
NOT_GIVEN = ("the task gives no per-target losses (Task.target_losses returns None): only split invariance is "
             "checked. Implement target_losses (one loss per real target; DatasetTask gives per_sample_loss's unless "
             "a subclass counts its own targets) to have the trained loss checked against the declared target mean")
DECLARED = ("the mean over the step's targets: the sum of the per-target losses (Task.loss_sum sums them per "
            "micro-batch) divided by the step's target count (Task.count_targets)")
TOLERANCE = 1e-9
"""Absolute, float64: another micro-batch split or world only reorders additions (measured ~1e-16..1e-13)."""
STEPS = 2
NEGATIVE = "mean-of-microbatch-means"
HINT = ("the step's result depends on how it is split: Task.loss_sum must return the SUM of the per-target losses "
        "of its micro-batch (the trainer divides by the step's target count), and count_targets must count exactly "
        "the targets loss_sum sums; a mean weighs a small micro-batch like a large one (docs/tasks.md, 'Return a "
        "sum, not a mean'). If loss_sum does return a sum, make_batch or the model still draws randomness the "
        "check could not switch off: implement Task.deterministic_objective()")


def batch_norms(task: Task) -> list[str]:
    """The modules of the task's model (built on the meta device, put in training mode as the trainer does) that
    normalise over the batch: every BatchNorm (``_BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm, the lazy ones) in
    training mode. GroupNorm, LayerNorm and InstanceNorm normalise each sample on its own: not listed."""
    with torch.device("meta"):
        model = task.build_model()
    model.train()
    return [f"{name} ({type(module).__name__})" if name else type(module).__name__
            for name, module in model.named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training]


def batches_still_draw(task: Task) -> bool:
    """Whether the task's ``deterministic_objective()`` still builds a micro-batch from random draws (a collate that
    mixes samples: mixup): its first batch built twice, under the generators of two run seeds (as the trainer seeds
    them for ``build_batch``), differs. Only a task that builds its batches with ``build_batch`` is asked."""
    variant = task.deterministic_objective()
    if not variant.builds_batches:
        return False
    ids = tuple(range(min(task.micro_batch_size, task.num_samples())))
    built = []
    for seed in (0, 1):
        request = BatchRequest(seed=seed, step=1, micro=0, epoch=0, sample_ids=ids)
        tensors: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            tensors.append(t)
            return t

        try:
            with batch_generators(request):
                map_tensors(variant.build_batch(request), keep)
        except Exception:  # noqa: BLE001  (the check's own runs build it again and report what fails, by path)
            return False
        built.append(tensors)
    return len(built[0]) != len(built[1]) or not all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(*built))


def not_applicable(task: Task, world: int) -> NotApplicable | None:
    """The objective check as not applicable to ``task`` (with the reason, and a finding when the task's own steps
    are split under BatchNorm), or None when it applies."""
    norms = batch_norms(task)
    if norms:
        names = ", ".join(norms)
        why = f"the model normalises over the batch (BatchNorm: {names}): a split changes its statistics"
        splits = ([f"micro-batches of {task.micro_batch_size} in steps of {task.batch_size}"]
                  if task.micro_batch_size < task.batch_size else []) + ([f"{world} ranks"] if world > 1 else [])
        findings = [] if not splits else [{
            "what": "BatchNorm over a split step", "check": "objective_equivalence", "modules": norms,
            "finding": f"the task splits each step ({' and '.join(splits)}) and its model normalises over the batch "
                       f"(BatchNorm: {names}): each part is normalised with its own statistics, so a step trains "
                       "something else than one batch would (not a resume error). Intended? Then nothing to do; "
                       "otherwise train one micro-batch a step (micro_batch_size = batch_size) or use a "
                       "normalisation that does not depend on the batch (GroupNorm, LayerNorm)"}]
        return NotApplicable("objective_equivalence", why, details={"batch_norm": norms}, findings=findings)
    if batches_still_draw(task):
        return NotApplicable("objective_equivalence", (
            "the task's batches still draw random numbers after deterministic_objective() (a collate that mixes "
            "samples, e.g. mixup): a split draws other numbers. To check the objective, switch them off: "
            "DatasetTask(eval_collate=...) or the task's deterministic_objective() (docs/tasks.md)"),
            details={"batches_draw": True})
    return None


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
                                                             "micro": self.global_batch, "target_losses": True}}
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
        self.declared: dict[str, Any] = {}

    def jobs(self, phase: str, scratch: Path, done: Results) -> list[Job]:
        """Every run, with the protocol's reference paths (they need nothing of them)."""
        if phase != REFERENCE:
            return []
        out = []
        for name, split in self.splits.items():
            ranks = ["--nproc-per-node", str(split["world"])] if split["world"] > 1 else []
            variant = Variant(objective_check=True, batch_size=split["batch"], micro_batch_size=split["micro"],
                              negative_control=NEGATIVE if split.get("negative") else "none",
                              target_losses=bool(split.get("target_losses")))
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
        self.declared = declared_objective(next(r for r in results if r.name == "objective/single"))

    @property
    def declared_ok(self) -> bool:
        """The trained loss is the declared target mean of the task's own per-target losses, every step (True where
        the task gives none: not applicable)."""
        return "not_applicable" in self.declared or bool(self.declared.get("passed"))

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
        return bool(self.diffs) and bool(self.positives) and self.declared_ok and all(
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
        if not self.declared_ok:
            out.append("objective.declared_reduction")
        return out

    def diagnosis(self) -> list[str]:
        """What a failed check most likely means, for the person reading the report."""
        bad = [n for n in self.positives if n in self.diffs and not all(v <= TOLERANCE for v in self.diffs[n].values())]
        out = [] if self.declared_ok else [declared_finding(self.declared)]
        if not bad:
            return out
        worst = max(max(self.diffs[n].values()) for n in bad)
        return [*out, f"objective check ({', '.join(bad)} vs one micro-batch; "
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
            "declared_objective": self.declared,
            "configuration": "the task's deterministic_objective() variant, float64, nn.Dropout p=0 (train "
                             "--objective-check); same seed and global batch in every run",
            "paths": self.paths,
        }


def _g(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.3g}"



def declared_objective(single: PathResult) -> dict[str, Any]:
    """The ``declared_objective`` block: the ``single`` run's loss of each step (its ``step`` events: what the trainer
    trained on) against the mean of the task's per-target losses of that step (its ``target_losses`` events, one per
    step: the run trains one micro-batch a step), or ``{"not_applicable": why}`` when the task gives none."""
    given = [e for e in single.events if e.get("event") == "target_losses"]
    steps = [e for e in single.events if e.get("event") == "step"]
    if not given or not all(e.get("given") for e in given):
        return {"not_applicable": NOT_GIVEN}
    rows = [_declared_step(g, s) for g, s in zip(given, steps)]
    return {"declared": DECLARED, "rtol": DECLARED_RTOL, "steps": rows,
            "passed": len(given) == len(steps) == STEPS and all(r["ok"] for r in rows)}


def _declared_step(given: dict[str, Any], step: dict[str, Any]) -> dict[str, Any]:
    sums, counts = [float(v) for v in given["sample_sums"]], [int(c) for c in given["sample_targets"]]
    total, n, count, trained = sum(sums), sum(counts), int(step["targets"]), float(step["loss"])
    declared = total / n if n else math.nan
    scale = float(given["abs_sum"]) / max(n, 1)  # the mean magnitude of a target loss
    row: dict[str, Any] = {"step": step["step"], "trained_loss": trained, "declared_mean": declared,
                           "count_targets": count, "target_losses": n, "loss_sum": given["loss_sum"],
                           "sum_of_target_losses": total, "abs_diff": abs(trained - declared),
                           "ok": n == count and _close(trained, declared, scale)}
    if not row["ok"]:
        row["looks_like"] = _looks_like(sums, counts, count, trained, scale)
        row["loss_sum_is_the_sum"] = _close(float(given["loss_sum"]), total, scale * max(n, 1))
    return row


def _close(a: float, b: float, scale: float) -> bool:
    """Equal within :data:`DECLARED_RTOL` of the larger of them and ``scale``."""
    return abs(a - b) <= DECLARED_RTOL * max(abs(a), abs(b), scale) + 1e-300


def _looks_like(sums: list[float], counts: list[int], count: int, trained: float, scale: float) -> str:
    """What the trained loss is instead of the declared mean, among the usual mistakes (or that it is none of them)."""
    total, n = sum(sums), sum(counts)
    means = [s / c for s, c in zip(sums, counts) if c]
    candidates = [
        (f"the sum of the target losses divided by count_targets' {count} targets, while target_losses gives {n}",
         total / count if n != count and count else math.nan),
        ("a sum of per-sample means (e.g. per-sequence means) divided by the target count: each sample weighs the "
         "same, whatever its number of targets", sum(means) / count if count else math.nan),
        ("a mean of per-sample means (e.g. per-sequence means): each sample weighs the same, whatever its number of "
         "targets", sum(means) / len(means) if means else math.nan),
        ("the sum of the target losses divided by the number of samples", total / len(sums) if sums else math.nan),
        ("the sum of the target losses, not divided", total),
    ]
    for what, value in candidates:
        if _close(trained, value, scale):
            return what
    return "none of the usual reductions (a sum, a mean of per-sample means, a mean over samples)"


def declared_finding(block: dict[str, Any]) -> str:
    """The diagnosis line of a failed declared-objective check: the first wrong step, what the loss looks like, and
    whose code most likely computes it."""
    rows = block.get("steps") or []
    bad = next((r for r in rows if not r["ok"]), None)
    if bad is None:
        return (f"objective check (declared_reduction): the single run printed {len(rows)} step(s) of target losses "
                f"for {STEPS} steps: the check could not compare every step")
    where = ("Task.loss_sum must return the SUM of the per-target losses Task.target_losses gives (every token's, not "
             "per-sequence means), and count_targets their number" if not bad["loss_sum_is_the_sum"] else
             "loss_sum is the sum of the target losses, so count_targets (or the trainer) divides by something else "
             "than their number")
    return (f"objective check (declared_reduction, step {bad['step']}): the loss trained on, "
            f"{bad['trained_loss']:.10g}, is not the declared objective, {DECLARED}: the mean of the task's "
            f"{bad['target_losses']} target losses is {bad['declared_mean']:.10g} (count_targets: "
            f"{bad['count_targets']}). It looks like {bad['looks_like']}. {where} (docs/tasks.md, 'Return a sum, "
            f"not a mean')")
