"""What a verification will cost, said before it starts, and refused when it is more than the budget.

A verification trains several paths in fresh processes (trainproof.proof.protocol). Their length follows the
task's data: without ``--cuts`` the continuous path covers three epochs (trainproof.proof.cuts), and every path
commits every ``--checkpoint-every`` steps, all kept until the verdict. For the built-in fixtures that is tens of
steps; for a packed dataset of a few thousand steps an epoch it is tens of thousands of steps and as many
generations. So the plan (processes, steps, generations, an estimate of the bytes written) is one log line before
anything runs, and a plan over ``--budget-steps`` or ``--budget-gib`` is refused (exit 2) with a line naming the
setting that shrinks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainproof.errors import ConfigError

ADAM_COPIES = 3
"""The bytes of a generation, estimated as the trainable parameters this many times over (weights plus Adam's two
moments). Frozen parameters (a LoRA's base) are no generation's in a replicated run: each path's run stores them
once, as a shared object (trainproof.train.frozen); a sharded one keeps them in every generation's shards
(:func:`plan_sizes`)."""
OVERHEAD = 32 * 2**10
"""And this much more: the manifest, the history rows, the generators' states."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the verification's main paths will do (the checks' own short runs come on top)."""

    paths: list[int]
    """Steps each path trains, the continuous path first."""
    steps_per_epoch: int
    every: int
    """Commit cadence (0: only each path's last state)."""
    state_bytes: int
    """Estimated bytes of one generation."""
    frozen_bytes: int = 0
    """Bytes of the frozen parameters, stored once by each path."""

    @classmethod
    def of(cls, *, steps: int, cut: int, extra_cuts: list[int], **rest: Any) -> Plan:
        """The continuous path, the cut, its resume and negative control, and a resumed path per other cut."""
        return cls(paths=[steps, cut, steps - cut, steps - cut, *(steps - c for c in extra_cuts)], **rest)

    @property
    def steps(self) -> int:
        return sum(self.paths)

    @property
    def commits(self) -> int:
        return sum(max(1, n // self.every) if self.every else 1 for n in self.paths)

    @property
    def bytes(self) -> int:
        return self.commits * self.state_bytes + len(self.paths) * self.frozen_bytes

    def line(self) -> str:
        continuous, epochs = self.paths[0], self.paths[0] / max(1, self.steps_per_epoch)
        return (f"plan: {len(self.paths)} paths (continuous {continuous} steps, {epochs:.3g} epochs of "
                f"{self.steps_per_epoch}), {self.steps} steps trained, {self.commits} generations "
                f"committed (every {self.every or 'final'} step(s)), about {_size(self.bytes)} written")

    def to_json(self) -> dict[str, Any]:
        return {"paths": len(self.paths), "continuous_steps": self.paths[0], "steps": self.steps,
                "commits": self.commits, "estimated_bytes": self.bytes, "steps_per_epoch": self.steps_per_epoch}


def state_bytes(model: Any) -> tuple[int, int]:
    """A generation's size, estimated from the model's trainable parameters, and the bytes of its frozen ones, stored
    once per run (the model built on the meta device: nothing allocated)."""
    trainable = frozen = 0
    for p in model.parameters():
        if p.requires_grad:
            trainable += p.numel() * p.element_size()
        else:
            frozen += p.numel() * p.element_size()
    return OVERHEAD + ADAM_COPIES * trainable, frozen


def plan_sizes(per_generation: int, frozen: int, *, sharded: bool) -> dict[str, int]:
    """:class:`Plan`'s sizes: a sharded run keeps its frozen parameters in every generation's shards (only a
    replicated run stores them apart, once), so there they count per generation, without Adam's moments."""
    if sharded:
        return {"state_bytes": per_generation + frozen, "frozen_bytes": 0}
    return {"state_bytes": per_generation, "frozen_bytes": frozen}


def check_budget(plan: Plan, *, max_steps: int, max_gib: float, cuts_given: bool, samples: int,
                 global_batch: int) -> None:
    """ConfigError (exit 2), one line naming what shrinks the plan, when it exceeds ``max_steps`` or ``max_gib``.
    ``samples``: what each path's epoch holds (the task's, or ``--samples``), in steps of ``global_batch``."""
    if plan.steps <= max_steps and plan.bytes <= max_gib * 2**30:
        return
    over = (f"{plan.steps} steps (over --budget-steps {max_steps})" if plan.steps > max_steps
            else f"about {_size(plan.bytes)} (over --budget-gib {max_gib:g})")
    fewer = _fewer(plan, samples=samples, global_batch=global_batch, max_steps=max_steps, max_gib=max_gib)
    why = "" if cuts_given else (
        f"; the default cuts cover three epochs of {plan.steps_per_epoch} steps: "
        + (f"verify on fewer samples with --samples (e.g. --samples {fewer}: epochs of "
           f"{-(-fewer // global_batch)} steps, still crossed) or " if fewer else "")
        + f"pick cuts within the first epoch or two with --cuts (e.g. --cuts {_example(plan.steps_per_epoch)})")
    raise ConfigError(f"this verification would train {over}: {plan.line()[6:]}{why}; a larger --checkpoint-every "
                      "commits fewer generations; or raise --budget-steps/--budget-gib")


def _fewer(plan: Plan, *, samples: int, global_batch: int, max_steps: int, max_gib: float) -> int | None:
    """A sample count whose epochs are short enough for the plan to fit (the default cuts' paths grow with the
    epoch), in whole global batches and at least two steps an epoch; None when that is not fewer than ``samples``."""
    share = min(max_steps / max(1, plan.steps), max_gib * 2**30 / max(1, plan.bytes))
    steps = max(2, int(plan.steps_per_epoch * share * 0.8))
    fewer = steps * global_batch
    return fewer if fewer < samples else None


def _example(steps_per_epoch: int) -> str:
    first = max(1, min(5, steps_per_epoch // 2))
    return ",".join(str(c) for c in sorted({first, steps_per_epoch, steps_per_epoch + first}))


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
