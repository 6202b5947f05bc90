"""``trainproof verify --audit``: replay a real run's generations a -> b in a fresh process and compare.

For a run that is training (or has trained) for real: take two committed generations a < b (by default the
two newest), copy generation a into ``<store>/verification/<id>/replay`` through the store (write -> verify
-> mark usable; plan.json too), train it ``b - a`` more steps in a fresh process with the task, settings and
seed the run recorded in ``plan.json``, and compare the replayed step b with the run's own generation b using
the protocol's checks. A generation b produced by another trajectory (a resume that lost its optimizer
state, re-seeded generators, skipped data ...) does not match.

Read-only towards the run: generations are read with ``load`` (verified, never quarantined or deleted), the
store is opened without the multipart sweep, and nothing is written among the run's generations; it can run
as a CronJob while the training Job is still committing. Note: a run with world > 1 needs a launcher for
the replay that this command does not provide yet; it is refused (exit 2).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from job.proof.compare import Diff, Tolerance, compare_states, parameter_distance
from job.train.contract import PLAN_FILE
from job.errors import ConfigError
from job.train.state import decode_generation
from job.tasks import load_task, trusted_task
from job.proof.protocol import parameter_names, verification_base
from job.proof.paths import (Opener, RunReader, VerificationIncomplete, absolute_url, job_argv, new_id, read_run_plan,
                             require_success, run_processes, seed_run)
from job.proof.report import build_report, environment
from storage import COMPLETE


@dataclass(kw_only=True)
class AuditSettings:
    """One ``verify --audit`` invocation."""

    store: str
    """The run to audit."""
    task: str | None = None
    """The run's task (``--task``): compared with plan.json, never read from it; needed unless built in."""
    from_step: int | None = None
    """Generation a (default: the second newest complete one, or the newest one before ``to_step``)."""
    to_step: int | None = None
    """Generation b (default: the newest complete one)."""
    tolerance: Tolerance = field(default_factory=Tolerance)
    device: str = "auto"
    workdir: str | None = None
    vid: str = field(default_factory=new_id)
    timeout: float = 7200.0
    store_args: list[str] = field(default_factory=list)
    max_replay_steps: int | None = None
    """Longest replay accepted (default: :func:`replay_cap` of the run's plan)."""


def replay_cap(plan: dict[str, Any]) -> int:
    """The longest replay an audit runs without being told to: ten epochs of the run's own plan, at least 1000
    steps. A generation claiming a step far beyond it (a forged ``step-99999999``) must not buy a replay of
    millions of steps."""
    epoch = plan.get("epoch_plan") if isinstance(plan.get("epoch_plan"), dict) else {}
    steps = epoch.get("steps")
    return max(1000, 10 * steps) if isinstance(steps, int) and 0 < steps < 10**7 else 1000


class Audit:
    """Replay a -> b of an existing run and compare with its generation b."""

    def __init__(self, settings: AuditSettings, opener: Opener) -> None:
        self.s, self.opener = settings, opener
        self.run_store = opener(settings.store)
        self.plan = read_run_plan(self.run_store)
        if self.plan.get("world", 1) != 1:
            raise ConfigError(f"--audit replays single-process runs only; this run has world {self.plan['world']}")
        self.task_name = trusted_task(self.plan.get("task"), settings.task, f"{PLAN_FILE} of {self.run_store.url}")
        if not isinstance(self.plan.get("task_config"), dict):
            raise ConfigError(f"{PLAN_FILE} of {self.run_store.url} holds no task_config mapping")
        self.task = load_task(self.task_name, self.plan["task_config"])
        self.param_names = parameter_names(self.task)
        self.root = verification_base(opener, settings.store, settings.workdir).child(settings.vid)
        self.replay_url = f"{absolute_url(self.root)}/replay"
        self.a: int | None = None
        self.b: int | None = None
        self.paths: dict[str, dict[str, Any]] = {}
        self.diffs: dict[str, dict[str, Diff]] = {"replay": {}}
        self.generations: dict[str, Any] = {}
        self.distance: float | None = None
        self.meta: dict[str, Any] = {}

    def run(self) -> None:
        """Select, copy, replay, compare. Raises VerificationIncomplete / ConfigError when it cannot."""
        loaded_a, loaded_b = self._select()
        seed_run(self.opener(self.replay_url), self.run_store.read_file(PLAN_FILE), loaded_a)
        original = decode_generation(loaded_b.files)
        del loaded_a, loaded_b  # hold one state in memory, not three
        self._replay()
        replayed = RunReader("replay", self.replay_url, self.opener).state(self.b)
        for name, diff in compare_states(original, replayed, self.s.tolerance, self.param_names).items():
            self.diffs["replay"].setdefault(name, Diff()).merge(diff, self.b)
        self.distance = parameter_distance(original, replayed, self.param_names)
        self.meta = original["meta"]

    def _select(self):
        steps = [g.step for g in self.run_store.scan(contract=self.plan["contract"]) if g.status == COMPLETE]
        b = self.s.to_step if self.s.to_step is not None else (steps[-1] if steps else None)
        earlier = [s for s in steps if b is not None and s < b]
        a = self.s.from_step if self.s.from_step is not None else (earlier[-1] if earlier else None)
        if a is None or b is None or not a < b or a not in steps or b not in steps:
            raise ConfigError(f"--audit needs two complete generations a < b of {self.run_store.url}; it has "
                              f"{steps or 'none'} (asked for --from {self.s.from_step} --to {self.s.to_step})")
        cap = self.s.max_replay_steps or replay_cap(self.plan)
        if b - a > cap:
            raise ConfigError(f"--audit would replay {b - a} steps ({a} -> {b}), more than {cap} (ten epochs of this "
                              "run's plan): pick closer generations with --from/--to, or raise --max-replay-steps")
        self.a, self.b = a, b
        loaded = [self.run_store.load(step, contract=self.plan["contract"]) for step in (a, b)]
        self.generations = {"from": _describe(loaded[0]), "to": _describe(loaded[1])}
        return loaded

    def _replay(self) -> None:
        with tempfile.TemporaryDirectory(prefix="trainproof-audit-") as tmp:
            config = Path(tmp) / "task_config.json"
            config.write_text(json.dumps(self.plan["task_config"]))
            argv = job_argv("train", "--store", self.replay_url, "--task", self.task_name, "--config", str(config),
                            "--seed", str(self.plan["seed"]), "--steps", str(self.b - self.a),
                            "--checkpoint-every", "0", "--checkpoint-every-seconds", "0", "--keep", "0",
                            "--resume", "auto", "--device", self.s.device, "--log-format", "json", *self.s.store_args)
            # The replay writes only under this audit's own verification/<id>/ (no other writer): no create-only
            # probe object there, so the audit writes nothing but its own results.
            private = {"TRAINPROOF_S3_CREATE_ONLY": "private"} if os.environ.get(
                "TRAINPROOF_S3_CREATE_ONLY", "require") == "require" else {}
            results = run_processes([("replay", self.replay_url, argv)], timeout=self.s.timeout,
                                    envs={"replay": private})
        self.paths["replay"] = results[0].to_json()
        require_success(results)
        event = results[0].event("resume") or {}
        if event.get("step") != self.a or event.get("rng_restored") is not True:
            raise VerificationIncomplete(f"the replay did not resume from step {self.a} "
                                         f"(its resume event: {event or 'none'})")

    def verdicts(self) -> dict[str, Any]:
        """An audit has no negative path: ``negative_divergence_detected`` is None."""
        replay = self.diffs["replay"]
        positive = bool(replay) and all(d.within for d in replay.values())
        return {"all_checks_passed": positive, "positive": positive, "negative_divergence_detected": None}

    def report(self, error: str | None = None) -> dict[str, Any]:
        """verification.json of the audit (partial, with ``error``, when it could not complete)."""
        verdicts = self.verdicts() if error is None else {
            "all_checks_passed": False, "positive": False, "negative_divergence_detected": None}
        settings = {"run": self.run_store.url, "from": self.a, "to": self.b, "atol": self.s.tolerance.atol,
                    "rtol": self.s.tolerance.rtol, "device": self.s.device, "task": self.task_name,
                    "task_config": self.plan["task_config"], "seed": self.plan["seed"]}
        return build_report(
            kind="audit", vid=self.s.vid, location=absolute_url(self.root), store=self.run_store.url,
            verdicts=verdicts, failing=[f"replay.{n}" for n, d in self.diffs["replay"].items() if not d.within],
            settings=settings, paths=self.paths, diffs=self.diffs, tol=self.s.tolerance, step_recovered=self.a,
            env=environment(self.task, self.meta), export=None,
            extra={"audited_generations": self.generations, "parameter_distance": self.distance},
            error=error)


def _describe(loaded: Any) -> dict[str, Any]:
    manifest = loaded.info.manifest
    return {"generation": loaded.info.name, "step": loaded.info.step, "created_at": manifest.get("created_at"),
            "state_sha256": manifest.get("state_sha256"), "code_version": manifest.get("code_version")}
