"""``trainproof verify``'s settings (protocol mode), and the ``train`` command line every path of it shares.

Kept apart from :mod:`trainproof.proof.protocol` so that the checks that start protocol-like paths of their own (the
extra cuts of :mod:`trainproof.proof.cuts`) build their command lines with the same options as the protocol's paths: a
path that differed in an option (another seed, device, commit cadence) would compare another experiment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from trainproof.errors import ConfigError
from trainproof.format.layout import flag as layout_flag
from trainproof.proof.compare import Tolerance
from trainproof.proof.paths import job_argv, new_id
from trainproof.train.variant import Variant

DEFAULT_SCHEDULE = {"regression": (10, 5), "tinylm": (8, 3)}
"""(steps, cut) per built-in task: regression is the fixture of docs/protocol.md (the cut mid-epoch at cursor 20 of 24,
10 updates crossing into a second epoch); tinylm's default corpus has 5 steps an epoch, so a cut at 3 is
mid-epoch and 8 updates cross into the second epoch."""


@dataclass(kw_only=True)
class ProtocolSettings:
    """One ``verify`` invocation (protocol mode). Validation raises ConfigError (exit 2)."""

    store: str
    """The run location; the verification writes under ``<store>/verification/<id>/``."""
    task: str = "regression"
    config: Path | None = None
    """Task settings file, passed to every path as ``--config``."""
    steps: int = 10
    cut: int = 5
    seed: int = 1234
    tolerance: Tolerance | None = None
    """None: chosen from the device and the task's dtype (:func:`default_tolerance`): exact on the CPU."""
    device: str = "auto"
    checkpoint_every: int = 1
    """Commit cadence of the continuous and resumed paths (0: only their final state)."""
    workdir: str | None = None
    """Where ``<id>/`` goes instead of ``<store>/verification``."""
    vid: str = field(default_factory=new_id)
    reuse: str | None = None
    """Id of an earlier verification whose continuous, cut and negative-control paths are reused (read back,
    re-checked): a verification of another resume of the same experiment runs only its resumed paths."""
    timeout: float = 7200.0
    """Seconds each process may run."""
    parallel: bool = True
    """Run independent paths concurrently (each uses the task's own thread count)."""
    store_args: list[str] = field(default_factory=list)
    """``--endpoint-url`` / ``--region`` / ``--path-style`` as given to verify, passed on to every process."""
    export: bool = True
    world: int = 1
    """Ranks of every path (> 1: ``train --nproc-per-node W``, gloo on the CPU), plus the world-size equivalence."""
    fsdp: bool = False
    """Every path trains sharded (``train --fsdp``); their states are read whole from the shards
    (trainproof.train.fsdp)."""
    cuts: list[int] | None = None
    """Every cut to resume at (``--cuts``); None: the protocol's cut, every epoch boundary and later mid-epoch of three
    epochs, a seeded random step and a resume of a resume (trainproof.proof.cuts). Recorded in verification.json's
    ``cuts`` block, not in ``settings``."""
    objective: bool = True
    """Run the objective-equivalence check (trainproof.proof.objective); skipped when reusing a reference."""
    budget_steps: int = 5000
    """Most steps the main paths may train together (trainproof.proof.budget): a larger plan is refused."""
    budget_gib: float = 20.0
    """Most GiB their generations may take, estimated from the model's parameters."""
    samples: int | None = None
    """Every path trains on the task's first this many samples (``--samples``; trainproof.tasks.base.first_samples);
    None: the whole dataset. The protocol resolves it from the task's ``verify_samples`` when not given."""
    fixed: tuple[str, ...] = ()
    """The options of the command line that set the paths' lengths (``--steps``, ``--cut``, ``--cuts``,
    ``--samples``): a plan past the end of the task's schedule is then refused rather than shortened
    (trainproof.proof.schedule_fit)."""
    fitted: str | None = None
    """Why the protocol shortened its paths to the task's schedule (trainproof.proof.schedule_fit), or None."""
    live_at: tuple[int, ...] = ()
    """The steps at which the continuous path records its live state for the ``live_vs_restored`` check (every cut;
    trainproof.proof.live), each resumed path right after restoring; empty: the check does not run. Set by the
    protocol."""

    def __post_init__(self) -> None:
        if not 1 <= self.cut < self.steps:
            raise ConfigError(f"need 1 <= --cut < --steps (got cut {self.cut}, steps {self.steps})")
        if self.checkpoint_every < 0 or self.timeout <= 0:
            raise ConfigError("--checkpoint-every must be >= 0 and --timeout > 0")
        if self.world < 1:
            raise ConfigError(f"--world must be >= 1 (got {self.world})")
        if urlparse(self.store).scheme == "memory" or (self.workdir or "").startswith("memory:"):
            raise ConfigError("verify runs every path as a separate process: memory:// stores are private to "
                              "one process; use a folder or s3://")

    def to_json(self) -> dict[str, Any]:
        """The settings block of verification.json."""
        return {"task": self.task, "config": None if self.config is None else str(self.config), "steps": self.steps,
                "cut": self.cut, "seed": self.seed,
                **({"atol": None, "rtol": None, "comparison": None} if self.tolerance is None else
                   {"atol": self.tolerance.atol, "rtol": self.tolerance.rtol, "comparison": self.tolerance.mode}),
                "device": self.device, "checkpoint_every": self.checkpoint_every, "reused_reference": self.reuse,
                "world": self.world, "fsdp": self.fsdp, "objective_check": self.objective, "samples": self.samples,
                "fitted_to_schedule": self.fitted}


CPU_EXACT = ("CPU with the trainer's deterministic settings (deterministic algorithms, the task's fixed thread count, "
             "the same code and operations in the same order on every path): a correct resume is bitwise equal, so "
             "every difference must be exactly 0")
CUDA_TOLERANCE = ("CUDA: kernels without a deterministic implementation only warn (torch.use_deterministic_algorithms "
                  "warn_only), so the paths are not bitwise by construction; each value is held to atol + rtol * "
                  "|reference|, rtol 16 machine epsilons of the task's dtype")


def default_tolerance(task: Any, device: str) -> Tolerance:
    """The comparison of the protocol's paths when ``--atol``/``--rtol`` are not given: exact where the paths are
    bitwise by construction (they run on the CPU: ``--device cpu``, or ``auto`` without CUDA or with a CPU-only task),
    a relative and absolute tolerance derived from the task's dtype where they are not (CUDA)."""
    import torch

    cuda = device == "cuda" or (device == "auto" and task.supports_cuda and torch.cuda.is_available())
    if not cuda:
        return Tolerance.exact(CPU_EXACT)
    return Tolerance(atol=1e-12, rtol=16 * torch.finfo(task.dtype).eps, mode="tolerance", why=CUDA_TOLERANCE)


def given_tolerance(atol: float | None, rtol: float | None) -> Tolerance | None:
    """``--atol``/``--rtol`` as given (a missing one is 0), or None when neither was."""
    if atol is None and rtol is None:
        return None
    return Tolerance(atol=atol or 0.0, rtol=rtol or 0.0, mode="given",
                     why="given on the command line (--atol/--rtol); held to |other - ref| <= atol + rtol * |ref|")


def default_schedule(task: str) -> tuple[int, int]:
    """(steps, cut) for ``task`` when the command line does not say."""
    return DEFAULT_SCHEDULE.get(task, (10, 5))


def train_argv(s: ProtocolSettings, url: str, *, steps: int, every: int, resume: bool,
               negative: bool = False, variant: Variant | None = None,
               live: tuple[int, ...] | None = None) -> list[str]:
    """The ``train`` command line of one path of the protocol into run ``url``.

    ``steps``: updates to train (a resumed path: additional ones, so one that silently started over ends short);
    ``every``: its commit cadence (0: only at the end); ``resume``: continue the run's newest generation (the copy of
    a cut) rather than start fresh; ``negative``: the negative control, resumed without the RNG restore;
    ``variant``: a check's trainer mode (trainproof.train.variant), on the protocol's subset of samples; ``live``: the
    step boundaries at which it records its live state (:func:`live_steps`)."""
    args = ["--task", s.task, *(["--config", str(s.config)] if s.config else []), "--seed", str(s.seed),
            "--steps", str(steps), "--checkpoint-every", str(every), "--checkpoint-every-seconds", "0",
            "--keep", "0", "--resume", "auto" if resume else "never", "--device", s.device, "--log-format", "json",
            *s.store_args]
    if s.world > 1:
        args = ["--nproc-per-node", str(s.world), *args]
    args += layout_flag(s.fsdp)
    args += replace(variant or Variant(), samples=s.samples, live_state_at=live or None).argv()
    return job_argv("train", "--store", url, *args, *(["--omit-rng-restore"] if negative else []))


def live_steps(s: ProtocolSettings, *, resumed_at: int | None) -> tuple[int, ...] | None:
    """Where a path records its live state for the ``live_vs_restored`` check (trainproof.proof.live): the continuous
    path (``resumed_at`` None) at every cut, a path resumed at step c right after restoring, at c; None when the check
    does not run."""
    if not s.live_at:
        return None
    return s.live_at if resumed_at is None else (resumed_at,)
