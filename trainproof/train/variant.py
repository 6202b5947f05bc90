"""The verifier's variants of a ``train`` invocation: the one value by which a check asks the trainer to run
otherwise than a user's training run does.

A check of :mod:`trainproof.proof` that needs a trainer mode builds a :class:`Variant` and puts ``variant.argv()``
on its path's command line (one hidden option, ``--variant JSON``); the trainer reads it once into
``TrainConfig.variant`` and applies it to the task (:meth:`Variant.apply`) or hands its loss normalisation to the
step. Adding a mode is a field here and the line that applies it. A user never sets one: no environment variable
reads it, and ``--help`` does not show it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from trainproof.errors import ConfigError

NEGATIVE_CONTROLS = ("none", "per-rank-mean", "mean-of-microbatch-means")
OPTION = "--variant"


@dataclass(frozen=True, kw_only=True)
class Variant:
    """A verifier mode of one ``train`` process; the default is a plain training run."""

    objective_check: bool = False
    """The objective-equivalence runs (trainproof.proof.objective): train the task's ``deterministic_objective()``
    variant in float64 with dropout off and the step split as ``batch_size`` / ``micro_batch_size`` say."""
    batch_size: int | None = None
    """With ``objective_check``: samples per step and rank (default: the task's)."""
    micro_batch_size: int | None = None
    """With ``objective_check``: samples per forward/backward (default: the task's)."""
    target_losses: bool = False
    """With ``objective_check``: after each micro-batch's ``loss_sum``, print a ``target_losses`` event with what the
    task's ``Task.target_losses`` gives for the same model and batch (per-sample sums and counts), for the check of
    the declared objective. Changes nothing the run computes."""
    negative_control: str = "none"
    """A deliberately wrong objective the verifier must detect: ``per-rank-mean`` normalises each rank's loss by its
    own target count; ``mean-of-microbatch-means`` normalises each micro-batch by its own target count and averages
    the micro-batches of the step."""
    grad_clip: float | None = None
    """The clipping runs (trainproof.proof.clipping): this max gradient norm instead of the task's."""
    samples: int | None = None
    """``verify --samples``: train on the task's first this many samples (trainproof.tasks.base.first_samples)."""
    live_state_at: tuple[int, ...] | None = None
    """The ``live_vs_restored`` check (trainproof.proof.live): at each of these step boundaries the process reaches
    (the first one right after a restore included, before any update), print a ``live_state`` event recording its
    live state (trainproof.train.live). Changes nothing the run computes."""

    def __post_init__(self) -> None:
        if self.negative_control not in NEGATIVE_CONTROLS:
            raise ConfigError(f"{OPTION}: negative_control must be one of {', '.join(NEGATIVE_CONTROLS)} "
                              f"(got {self.negative_control!r})")
        if (self.batch_size is not None or self.micro_batch_size is not None or self.target_losses) \
                and not self.objective_check:
            raise ConfigError(f"{OPTION}: batch_size/micro_batch_size/target_losses are for the objective check only")
        for name in ("batch_size", "micro_batch_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{OPTION}: {name} must be an integer >= 1 (got {value!r})")
        if self.samples is not None and (isinstance(self.samples, bool) or not isinstance(self.samples, int)
                                         or self.samples < 1):
            raise ConfigError(f"{OPTION}: samples must be an integer >= 1 (got {self.samples!r})")
        at = self.live_state_at
        if at is not None:
            if not isinstance(at, (list, tuple)) or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                                        for s in at):
                raise ConfigError(f"{OPTION}: live_state_at must be a list of step numbers >= 0 (got {at!r})")
            object.__setattr__(self, "live_state_at", tuple(sorted(set(at))))
        clip = self.grad_clip
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                 or not (clip > 0 and math.isfinite(clip))):
            raise ConfigError(f"{OPTION}: grad_clip must be a finite number > 0 (got {clip!r})")

    def to_json(self) -> dict[str, Any]:
        """The fields that differ from a plain training run (``{}`` for one)."""
        plain = Variant()
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if v != getattr(plain, k)}

    def argv(self) -> list[str]:
        """The ``train`` options that ask for this variant (none for a plain run)."""
        changed = self.to_json()
        return [OPTION, json.dumps(changed, sort_keys=True)] if changed else []

    @classmethod
    def parse(cls, text: str | None) -> Variant:
        """The value of ``--variant`` (JSON object of fields); ``None`` or empty: a plain training run."""
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except ValueError:
            raise ConfigError(f"{OPTION} takes a JSON object (got {text[:80]!r})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{OPTION} takes a JSON object (got {text[:80]!r})")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"{OPTION}: unknown field(s) {', '.join(map(str, unknown))}")
        return cls(**data)

    def apply(self, task: Any) -> Any:
        """The task this variant trains: the subset of its samples, the objective check's float64 twin, and the
        clipping runs' threshold."""
        if self.samples is not None:
            from trainproof.tasks.base import first_samples

            task = first_samples(task, self.samples)
        if self.objective_check:
            from trainproof.tasks.objective import ObjectiveCheckTask

            task = ObjectiveCheckTask(task, batch_size=self.batch_size, micro_batch_size=self.micro_batch_size,
                                      record_targets=self.target_losses)
        if self.grad_clip is not None:
            task.grad_clip = self.grad_clip
        return task
