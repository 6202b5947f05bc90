"""``trainproof train`` settings: a keyword-only dataclass the CLI fills in and validates once."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainproof.errors import ConfigError
from trainproof.train.variant import Variant

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (Ubuntu 22.04's): the same parser, from PyPI
    import tomli as tomllib

RESUME_MODES = ("auto", "never")
DEVICES = ("auto", "cpu", "cuda")
LOG_FORMATS = ("auto", "json", "rich")


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one ``train`` invocation needs. Validation raises ConfigError (exit 2)."""

    store: str
    """Run location: s3://bucket/prefix/run, file:///abs, a local path or memory://name."""
    task: str = "regression"
    """Built-in task name or ``package.module:factory``."""
    task_config: dict[str, Any] = field(default_factory=dict)
    """Overrides of the task's settings (from ``--config``); part of the run contract."""
    max_steps: int | None = None
    """Target total of optimizer steps, idempotent across restarts (what a Kubernetes Job uses)."""
    steps: int | None = None
    """Additional optimizer steps from wherever this process resumed (the protocol's semantics)."""
    checkpoint_every: int = 0
    """Commit a generation every N optimizer steps (0: off)."""
    checkpoint_every_seconds: float = 600.0
    """Commit a generation when this many seconds passed since the last one (0: off)."""
    keep: int = 3
    """Complete generations to keep after each commit (0: keep all). The newest is never deleted."""
    resume: str = "auto"
    """``auto``: resume from the newest usable generation; ``never``: refuse a store that has one."""
    omit_rng_restore: bool = False
    """Negative control: restore everything except the random generators (the run must diverge)."""
    variant: Variant = field(default_factory=Variant)
    """The verifier's mode of this process (trainproof.train.variant); the default is a plain training run."""
    seed: int = 1234
    """Seed of every random generator at the start of the run; part of the run contract."""
    deadline: datetime | None = None
    """Stop (commit, exit 75) early enough to finish the save before this moment."""
    device: str = "auto"
    """``auto`` picks CUDA when available and the task supports it."""
    log_every: int = 1
    """Log one line every N steps (JSON mode)."""
    log_format: str = "auto"
    """``rich`` progress bar, ``json`` lines, or ``auto`` (rich on a terminal)."""
    deadline_margin_s: float = 1.0
    """Safety margin added to the step and save estimates when honouring ``deadline``."""
    allow_world_change: bool = False
    """Resume a run on another world size (data order carries over, per-rank streams are re-derived; the
    run is then no longer bitwise comparable). Without it such a resume is refused (exit 2)."""
    allow_code_change: bool = False
    """Resume a generation written by other code (another trainproof/ source digest); recorded in
    ``meta.code_changes``. Without it such a resume is refused (exit 2)."""
    dist_timeout_s: float = 600.0
    """Timeout of every collective of a distributed run; it must cover rank 0's upload of a generation,
    during which the other ranks wait for the outcome."""

    fsdp: bool = False
    """Shard the model and optimizer with FSDP2 over the ranks (trainproof.train.fsdp) instead of replicating them with
    DDP; checkpoints are then sharded generations (each rank writes its own shards). Part of the run's plan: a
    run cannot switch. A task can ask for it itself (``Task.fsdp``)."""
    sync_checkpoint: bool = False
    """Commit checkpoints inline, blocking training for the whole save (the behaviour before asynchronous
    checkpoints, trainproof.train.async_save), on every rank."""
    data_workers: int | None = None
    """DataLoader worker processes building micro-batches ahead of the step (trainproof.train.pipeline); None: the
    task's
    ``num_workers``. Never changes results, so not part of the contract: a run may resume with another count."""
    prefetch: int | None = None
    """Micro-batches each data worker builds ahead; None: the task's ``prefetch``. Not part of the contract."""
    stop_grace_s: float = 25.0
    """Seconds the platform grants between SIGTERM (or a spot notice) and SIGKILL. After a stop request the
    final step is committed only when the measured commit time fits what is left; otherwise the run exits 75
    from the commit that was in flight. Kubernetes: terminationGracePeriodSeconds (30 s by default, 150 s in
    infra/k8s); AWS spot: 120 s; GCP and Azure spot: 30 s."""

    def __post_init__(self) -> None:
        if not self.store:
            raise ConfigError("--store is required (a URL or a local folder)")
        if self.max_steps is not None and self.steps is not None:
            raise ConfigError("use either --max-steps (target total) or --steps (additional steps), not both")
        for name in ("max_steps", "steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1 (got {value})")
        if self.seed < 0:
            raise ConfigError(f"--seed must be >= 0 (got {self.seed})")
        if self.checkpoint_every < 0 or self.checkpoint_every_seconds < 0 or self.keep < 0:
            raise ConfigError("--checkpoint-every, --checkpoint-every-seconds and --keep must be >= 0")
        _one_of("--resume", self.resume, RESUME_MODES)
        _one_of("--device", self.device, DEVICES)
        _one_of("--log-format", self.log_format, LOG_FORMATS)
        if self.log_every < 1:
            raise ConfigError("--log-every must be >= 1")
        if self.dist_timeout_s <= 0:
            raise ConfigError(f"--dist-timeout must be > 0 seconds (got {self.dist_timeout_s})")
        if self.data_workers is not None and not 0 <= self.data_workers <= 256:
            raise ConfigError(f"--data-workers must be in 0..256 (got {self.data_workers})")
        if self.prefetch is not None and not 1 <= self.prefetch <= 1024:
            raise ConfigError(f"--prefetch must be in 1..1024 (got {self.prefetch})")
        if self.stop_grace_s <= 0:
            raise ConfigError(f"--stop-grace must be > 0 seconds (got {self.stop_grace_s})")
        if self.deadline is not None and self.deadline <= datetime.now(timezone.utc):
            raise ConfigError(f"--deadline {self.deadline.isoformat()} is already past")

    def target_step(self, start_step: int, default_steps: int) -> int:
        """The step to reach: ``max_steps``, or ``start_step + steps``, or the task's default total."""
        if self.steps is not None:
            return start_step + self.steps
        return self.max_steps if self.max_steps is not None else default_steps

    def target_source(self) -> str:
        """Where :meth:`target_step` took the target from, for the start line (a silent default surprises)."""
        if self.steps is not None:
            return "--steps"
        return "--max-steps" if self.max_steps is not None else "the task's default: no --max-steps given"

    def recorded(self) -> dict[str, Any]:
        """Trainer settings recorded in each state (informational; the contract covers what matters)."""
        return {
            "task": self.task, "max_steps": self.max_steps, "steps": self.steps,
            "checkpoint_every": self.checkpoint_every, "checkpoint_every_seconds": self.checkpoint_every_seconds,
            "keep": self.keep, "seed": self.seed, "device": self.device,
            "deadline": None if self.deadline is None else self.deadline.isoformat(),
            "allow_world_change": self.allow_world_change, "dist_timeout_s": self.dist_timeout_s,
            "allow_code_change": self.allow_code_change, "variant": self.variant.to_json(),
            "sync_checkpoint": self.sync_checkpoint,
            "stop_grace_s": self.stop_grace_s, "fsdp": self.fsdp, "data_workers": self.data_workers,
            "prefetch": self.prefetch,
        }


def load_task_config(path: Path) -> dict[str, Any]:
    """Read ``--config FILE`` (JSON, or TOML by extension): a flat mapping of task settings."""
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text.decode()) if path.suffix.lower() == ".toml" else json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        kind = "TOML" if path.suffix.lower() == ".toml" else "JSON"
        raise ConfigError(f"--config {path} is not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path} must hold a mapping of task settings")
    return data


def _one_of(option: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{option} must be one of {', '.join(allowed)} (got {value!r})")
