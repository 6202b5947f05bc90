"""``trainproof train`` settings: a keyword-only dataclass the CLI fills in and validates once."""

from __future__ import annotations

import json
import sys
from dataclasses import MISSING, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainproof.errors import ConfigError
from trainproof.storage import KeepEvery
from trainproof.train.variant import Variant

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (Ubuntu 22.04's): the same parser, from PyPI
    import tomli as tomllib

RESUME_MODES = ("auto", "never")
DEVICES = ("auto", "cpu", "cuda")
LOG_FORMATS = ("auto", "json", "rich")


def setting(default: Any = MISSING, help: str | None = None, *, flag: str | None = None, recorded: bool = True) -> Any:
    """A field of an options object declared once, with what derives from it. ``help``: the field is an option of
    ``trainproof train`` (``trainproof.cli.train``): ``--FLAG`` and the variable ``TRAINPROOF_FLAG`` (``flag``: the
    field's name by default), with this default and this help. ``recorded``: :meth:`TrainConfig.recorded` holds it
    (a field declared without :func:`setting` is neither). A class as ``default`` is its factory."""
    meta = {"help": help, "flag": flag or None, "recorded": recorded}
    if isinstance(default, type):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one ``train`` invocation needs. Validation raises ConfigError (exit 2). Each field is declared
    once (:func:`setting`): the ``train`` option, its help and default, and whether each state records it."""

    store: str
    """Run location: s3://bucket/prefix/run, file:///abs, a local path or memory://name (``--store``)."""
    task: str = setting("regression", "Built-in task (regression, tinylm) or package.module:factory.")
    task_config: dict[str, Any] = setting(dict, recorded=False)
    """Overrides of the task's settings (from ``--config``); part of the run contract."""
    max_steps: int | None = setting(None, "Target total of optimizer steps (idempotent).")
    steps: int | None = setting(None, "Additional optimizer steps from where this run resumes.")
    checkpoint_every: int | str = setting(0, "Commit every N steps (0: off), or auto: every T seconds, T re-planned "
                                          "after each commit (Daly) from this run's measured cost per commit (stall "
                                          "and the steps it slowed) and its interruptions that lost work (its "
                                          "attempt records); replaces "
                                          "--checkpoint-every-seconds.")
    """``auto``: trainproof.lifecycle.autointerval. Normalised: an int, or the string ``auto``."""
    checkpoint_every_seconds: float = setting(600.0, "Commit every S seconds (0: off).")
    keep: int = setting(3, "Complete generations to keep (0: all).")
    """The newest is never deleted."""
    keep_every: str | None = setting(None, "Also keep a sparse permanent series besides the --keep newest: N (steps: "
                                     "the first generation at or after each multiple of N) or a duration (6h: the "
                                     "first generation committed in each 6 h of the run).")
    """trainproof.storage.KeepEvery; recorded in each generation's manifest (``extra.keep_every``) for ``ls`` and
    ``gc``. Not part of the contract: a run may resume with another rule."""
    resume: str = setting("auto", "auto: resume from the newest usable generation; never.", recorded=False)
    """``never`` refuses a store that has a generation."""
    omit_rng_restore: bool = setting(False, "Negative control: skip the RNG restore.", recorded=False)
    """Restore everything except the random generators (the run must diverge)."""
    variant: Variant = setting(Variant)
    """The verifier's mode of this process (trainproof.train.variant, ``--variant``); default: a plain training run."""
    seed: int = setting(1234, "Seed of every generator (part of the run contract).")
    deadline: datetime | None = setting(None)
    """Stop (commit, exit 75) early enough to finish the save before this moment (``--deadline``)."""
    device: str = setting("auto", "auto, cpu or cuda.")
    """``auto`` picks CUDA when available and the task supports it."""
    log_every: int = setting(1, "Log every N steps.", recorded=False)
    log_format: str = setting("auto", "auto (rich on a terminal), rich or json.", recorded=False)
    tensorboard: str = setting("auto", "Folder for TensorBoard event files of every step (loss, lr, throughput): "
                               "auto (<store>/tensorboard for a folder store, none for S3), off, or a path.",
                               recorded=False)
    deadline_margin_s: float = 1.0
    """Safety margin added to the step and save estimates when honouring ``deadline``."""
    dist_timeout_s: float = setting(600.0, "Seconds any collective may wait for a rank.", flag="dist_timeout")
    """It must cover rank 0's upload of a generation, during which the other ranks wait for the outcome."""
    allow_world_change: bool = setting(False, "Resume on another world size (no longer bitwise comparable).")
    """Data order carries over, per-rank streams are re-derived. Without it such a resume is refused (exit 2)."""
    allow_code_change: bool = setting(False, "Resume a generation written by other code (another source digest of "
                                      "trainproof/); recorded in meta.code_changes.")
    """Without it such a resume is refused (exit 2)."""
    fsdp: bool = setting(False, "Shard the model and optimizer over the ranks with FSDP2 instead of DDP; checkpoints "
                         "are sharded (each rank writes its own shards, none holds the whole state). Part of the run's "
                         "plan: give it on every start. Resume on another world size with --allow-world-change (DCP "
                         "reshards).")
    """trainproof.train.fsdp. A run cannot switch. A task can ask for it itself (``Task.fsdp``)."""
    sync_checkpoint: bool = setting(False, "Commit checkpoints inline, blocking training for the whole save (default: "
                                    "only a copy to host memory blocks; the commit runs in the background).")
    """The behaviour before asynchronous checkpoints (trainproof.train.async_save), on every rank."""
    stop_grace_s: float = setting(25.0, "Seconds between SIGTERM (or a spot notice) and SIGKILL: the final step is "
                                  "committed only when its measured commit time fits; else exit 75 from the commit "
                                  "in flight. Kubernetes: match terminationGracePeriodSeconds (150 in infra/k8s); AWS "
                                  "spot 120.", flag="stop_grace")
    """Kubernetes' default is 30 s; GCP and Azure spot: 30 s."""
    data_workers: int | None = setting(None, "DataLoader worker processes that load, decode, augment and collate "
                                       "micro-batches ahead of the step (default: the task's num_workers; 0: in the "
                                       "training process). Never changes results: a run may resume with another "
                                       "count.")
    """trainproof.train.pipeline. Not part of the contract."""
    prefetch: int | None = setting(None, "Micro-batches each data worker builds ahead (default: the task's prefetch, "
                                   "2).")
    """Not part of the contract."""

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
        self.checkpoint_every = _every(self.checkpoint_every)
        if self.checkpoint_every_seconds < 0 or self.keep < 0:
            raise ConfigError("--checkpoint-every-seconds and --keep must be >= 0")
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
        self.keep_every_rule()  # a bad --keep-every is one line now, not at the first retention
        if self.stop_grace_s <= 0:
            raise ConfigError(f"--stop-grace must be > 0 seconds (got {self.stop_grace_s})")
        if self.deadline is not None and self.deadline <= datetime.now(timezone.utc):
            raise ConfigError(f"--deadline {self.deadline.isoformat()} is already past")

    @property
    def auto_interval(self) -> bool:
        """``--checkpoint-every auto``."""
        return self.checkpoint_every == "auto"

    @property
    def every_steps(self) -> int:
        """The step cadence (0: none, as with ``auto``)."""
        return self.checkpoint_every if isinstance(self.checkpoint_every, int) else 0

    def keep_every_rule(self) -> KeepEvery | None:
        """``--keep-every`` as retention's rule (None: not given)."""
        if self.keep_every is None:
            return None
        try:
            return KeepEvery.parse(self.keep_every)
        except ValueError as exc:
            raise ConfigError(f"--keep-every: {exc}") from None

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
        """Trainer settings recorded in each state (informational; the contract covers what matters): the fields
        declared ``recorded``, as JSON values."""
        return {f.name: _recorded(getattr(self, f.name)) for f in fields(self) if f.metadata.get("recorded")}


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


def _every(value: int | str) -> int | str:
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    try:
        steps = int(text)
    except ValueError:
        steps = -1
    if steps < 0:
        raise ConfigError(f"--checkpoint-every must be a whole number of steps >= 0 or auto (got {str(value)[:40]!r})")
    return steps


def _one_of(option: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{option} must be one of {', '.join(allowed)} (got {value!r})")


def _recorded(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return value.to_json() if isinstance(value, Variant) else value
