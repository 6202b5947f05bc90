"""``trainproof verify --audit``: replay a real run's generations a -> b in a fresh process and compare.

For a run that is training (or has trained) for real: take two committed generations a < b (by default the
two newest), copy generation a into ``<store>/verification/<id>/replay`` through the store (write -> verify
-> mark usable; plan.json too), train it ``b - a`` more steps in a fresh process with the task, settings and
seed the run recorded in ``plan.json``, and compare the replayed step b with the run's own generation b using
the protocol's checks. A generation b produced by another trajectory (a resume that lost its optimizer
state, re-seeded generators, skipped data ...) does not match.

Across resumes: every generation records the step its process resumed from (``extra.resumed_from`` in its
COMPLETE.json, ``meta.resumed_from`` in the state). By default ``b`` is the newest generation and ``a`` the newest
generation *before* the restore point ``r`` that ``b``'s process started from (``r`` itself when nothing older is
kept; the trainer keeps ``r`` from retention until an audit passed across it, trainproof.format.protect), so the replay
runs across the restore without one: a resume that lost state makes ``b`` differ. ``verification.json``'s
``audit_span`` says which generations, which restore points and which code identities the replay spans; a
replay that crosses a code change (``--allow-code-change``) runs with this process's code and says so. A passed
audit records its span in ``<run>/verification/audited.json``, which releases the protected restore point.

Per-step history: a generation holds only the rows since the previous one (trainproof.format.state), so the run's rows
a+1..b are reassembled from its generations (trainproof.format.history, chain checked; a changed row is refused) and
compared with the replay's row by row. Where retention deleted generations between a and b, the comparison covers the
steps still held (``history_compared``: ``first_step``..``last_step``, ``covers_replay``), and ``chain_digest_equal``
says whether the replay's chain value, which covers every step, equals the run's (bitwise the same rows throughout).

Read-only towards the run: generations are read with ``load`` (verified, never quarantined or deleted), the
store is opened without the multipart sweep, and nothing is written among the run's generations; it can run
as a CronJob while the training Job is still committing. A sharded run (``train --fsdp``, ``fsdp`` in its plan.json)
is replayed sharded, its generation a copied with its shards, and both states' model and optimizer are read whole
from their verified shards before the comparison. A run of W > 1 ranks is replayed with W ranks (``train
--nproc-per-node W``: trainproof's launcher, gloo on the CPU or NCCL with ``--device cuda``), its generation a copied
with every rank's file, and generation b compared with every rank's part (generators, data position) joined in, as
the protocol compares a W-rank path.

Across a world change (``train --allow-world-change``): the world is each generation's own (its COMPLETE.json
``world``), not plan.json's (the run's first). The replay runs one process per span of one world (:func:`replay_spans`):
from a with a's world up to the restore point where the run changed its world, then from the replay's own generation
there with the next world and ``--allow-world-change``, as the run did; ``audit_span.world_changes`` names each
change the replay crossed.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainproof.errors import ConfigError, StateError
from trainproof.format import history
from trainproof.format.contract import PLAN_FILE
from trainproof.format.identity import code_version
from trainproof.format.layout import flag as layout_flag
from trainproof.format.layout import sharded
from trainproof.format.protect import AUDITED_FILE, audited_past, read_audited, recorded_restore, within_run
from trainproof.format.shard_files import is_sharded_file
from trainproof.format.state import decode_generation
from trainproof.proof.compare import Diff, Tolerance, compare_all
from trainproof.proof.paths import (
    Opener,
    RunReader,
    VerificationIncomplete,
    absolute_url,
    job_argv,
    new_id,
    read_run_plan,
    require_success,
    run_processes,
    seed_run,
    with_sections,
)
from trainproof.proof.protocol import parameter_names, verification_base
from trainproof.proof.report import build_report, environment
from trainproof.proof.verification import VerificationRunner
from trainproof.storage import COMPLETE, StoreError
from trainproof.storage.spool import spool_dir
from trainproof.tasks import load_task, trusted_task


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
    replay_env: dict[str, str] = field(default_factory=dict)
    """The replay's extra environment: ``verify --audit`` sets TRAINPROOF_S3_CREATE_ONLY from ``require`` to ``private``
    (the replay writes only under this audit's own verification/<id>/: no create-only probe object there)."""


def replay_cap(plan: dict[str, Any]) -> int:
    """The longest replay an audit runs without being told to: ten epochs of the run's own plan, at least 1000
    steps. A generation claiming a step far beyond it (a forged ``step-99999999``) must not buy a replay of
    millions of steps."""
    epoch = plan.get("epoch_plan") if isinstance(plan.get("epoch_plan"), dict) else {}
    steps = epoch.get("steps")
    return max(1000, 10 * steps) if isinstance(steps, int) and 0 < steps < 10**7 else 1000


class Audit(VerificationRunner):
    """Replay a -> b of an existing run and compare with its generation b."""

    prunes_evidence = False
    """An audit deletes nothing: its credentials may not (``gc --keep-verifications`` removes old audits)."""

    def __init__(self, settings: AuditSettings, opener: Opener) -> None:
        self.s, self.opener = settings, opener
        self.run_store = opener(settings.store)
        self.plan = read_run_plan(self.run_store)
        world = self.plan.get("world", 1)
        if type(world) is not int or world < 1:
            raise ConfigError(f"{PLAN_FILE} of {self.run_store.url}: world must be a positive integer, not {world!r}")
        self.spans: list[Span] = []
        """The replay's processes: (from, to, world) each, in order (:func:`replay_spans`)."""
        self.task_name = trusted_task(self.plan.get("task"), settings.task, f"{PLAN_FILE} of {self.run_store.url}")
        if not isinstance(self.plan.get("task_config"), dict):
            raise ConfigError(f"{PLAN_FILE} of {self.run_store.url} holds no task_config mapping")
        self.task = load_task(self.task_name, self.plan["task_config"])
        self.param_names, _ = parameter_names(self.task)
        self.root = verification_base(opener, settings.store, settings.workdir).child(settings.vid)
        self.replay_url = f"{absolute_url(self.root)}/replay"
        self.a: int | None = None
        self.b: int | None = None
        self.paths: dict[str, dict[str, Any]] = {}
        self.diffs: dict[str, dict[str, Diff]] = {"replay": {}}
        self.generations: dict[str, Any] = {}
        self.distance: float | None = None
        self.meta: dict[str, Any] = {}
        self.span: dict[str, Any] = {}
        self.audited_record: str | None = None
        self.history: dict[str, Any] = {}
        """Which steps' history rows (sample ids, losses, learning rates) were compared: ``first_step``..``last_step``
        (from a+1 unless retention deleted generations in between), and ``chain_digest_equal``: whether the replay's
        history chain value equals the run's (bitwise the same rows over the whole replay)."""

    def run(self) -> None:
        """Select, copy, replay, compare. Raises VerificationIncomplete / ConfigError when it cannot."""
        loaded_a, loaded_b = self._select()  # large files in spools (a state's tensors mapped from them)
        try:
            seed_run(self.opener(self.replay_url), self.run_store.read_file(PLAN_FILE), loaded_a)
            # A sharded run (--fsdp): generation b's model and optimizer stay in its verified shards, compared a
            # group of entries at a time (trainproof.proof.compare).
            original = self._original_history(with_sections(self.run_store, self.b,
                                                            decode_generation(loaded_b.files)))
        finally:
            loaded_a.close()
            loaded_b.close()
        del loaded_a, loaded_b
        self._replay()
        # The replay holds the rows a+1..b itself (its generation b chains from the copied generation a).
        replayed = RunReader("replay", self.replay_url, self.opener).state(self.b, since=self.history["first_step"])
        # Both chain values cover every row since step 1 (the replay chains from the copy of generation a): equal means
        # the replayed rows a+1..b are bitwise the run's, even those whose generations retention deleted.
        self.history["chain_digest_equal"] = replayed["history_chain"]["digest"] == original["history_chain"]["digest"]
        diffs, self.distance = compare_all(original, {"replay": replayed}, self.s.tolerance, self.param_names)["replay"]
        for name, diff in diffs.items():
            self.diffs["replay"].setdefault(name, Diff()).merge(diff, self.b)
        self.meta = original["meta"]

    def _original_history(self, state: dict[str, Any]) -> dict[str, Any]:
        """Generation b with its history rows a+1..b reassembled from the run's generations (chain checked), or from
        the first step retention left contiguous back from b: the per-step comparison covers that span (recorded
        in ``history_compared``)."""
        try:
            found = history.from_store(self.run_store, state, contract=self.plan["contract"], since=self.a + 1,
                                       partial=True)
        except StateError as exc:
            raise VerificationIncomplete(f"the history of generation {self.b} of {self.run_store.url} cannot be "
                                         f"reassembled: {exc}") from None
        self.history = {**found.to_json(), "replayed_from": self.a + 1, "covers_replay": found.first == self.a + 1}
        self.history.pop("complete")
        return found.state

    def _select(self):
        complete = {g.step: g for g in self.run_store.scan(contract=self.plan["contract"]) if g.status == COMPLETE}
        steps = sorted(complete)
        b = self.s.to_step if self.s.to_step is not None else (steps[-1] if steps else None)
        restore = _resumed_from(complete.get(b))
        a, how = self.s.from_step, "--from"
        if a is None:
            a, how = default_from(steps, b, restore)
            how = self._restore_gone(steps, b, restore) or how
        if a is None or b is None or not a < b or a not in steps or b not in steps:
            raise ConfigError(f"--audit needs two complete generations a < b of {self.run_store.url}; it has "
                              f"{steps or 'none'} (asked for --from {self.s.from_step} --to {self.s.to_step})")
        cap = self.s.max_replay_steps or replay_cap(self.plan)
        if b - a > cap:
            raise ConfigError(f"--audit would replay {b - a} steps ({a} -> {b}), more than {cap} (ten epochs of this "
                              "run's plan): pick closer generations with --from/--to, or raise --max-replay-steps")
        self.a, self.b = a, b
        # Generation a is copied whole into the replay; of b, the shards of a sharded run are read (and verified) by
        # the comparison, not here. Files of a part or more are spooled, not held in memory.
        loaded = [self.run_store.load(a, contract=self.plan["contract"], spool_dir=spool_dir())]
        try:
            loaded.append(self.run_store.load(b, contract=self.plan["contract"], spool_dir=spool_dir(),
                                              skip=is_sharded_file))
        except BaseException:
            loaded[0].close()
            raise
        self.generations = {"from": _describe(loaded[0]), "to": _describe(loaded[1])}
        infos = {s: complete[s] for s in steps if a <= s <= b}
        self.spans = replay_spans(a, b, infos, self.run_store.url)
        self.span = audit_span(a, b, how, restore, infos, self.generations, replay_code=code_version(),
                               spans=self.spans)
        return loaded

    def _restore_gone(self, steps: list[int], b: int | None, restore: int | None) -> str | None:
        """When generation b's process resumed from a point of which no generation at or before it is stored: the
        default audit could only replay after the resume, proving nothing about it. That is fine when a passed audit
        of this run (``verification/audited.json``, authenticated) already spanned the point (retention then
        released it): the returned reason says so. Otherwise VerificationIncomplete: it does not pass."""
        if b is None or restore is None or not restore < b or any(s <= restore for s in steps):
            return None
        record = within_run(read_audited(self.run_store), steps[-1])
        if audited_past(record, restore):
            return (f"the newest generation before {b}: the restore point {restore} is no longer stored, and the "
                    f"passed audit {record.get('id')} spanned it")
        raise VerificationIncomplete(
            f"generation {b} of {self.run_store.url} was written by a process that resumed from step {restore}, and "
            f"no generation at or before step {restore} is stored any more (nor has an audit of this run spanned it): "
            "no replay can cross that resume, so the audit cannot prove it",
            hint=f"audit a pair you choose with --from/--to (it will not span the resume at {restore}); retention "
                 "keeps a restore point until an audit spans it, so check who deleted it (quarantine/, the bucket's "
                 "access log)")

    def _replay(self) -> None:
        """One process per span of one world (:attr:`spans`), each resuming from the previous one's generation."""
        with tempfile.TemporaryDirectory(prefix="trainproof-audit-") as tmp:
            config = Path(tmp) / "task_config.json"
            config.write_text(json.dumps(self.plan["task_config"]))
            for i, span in enumerate(self.spans):
                name = "replay" if i == len(self.spans) - 1 else f"replay_{span.start}_{span.end}"
                changed = any(c["step"] == span.start for c in self.span.get("world_changes", []))
                argv = self._argv(span, str(config), world_change=changed)
                results = run_processes([(name, self.replay_url, argv)], timeout=self.s.timeout,
                                        envs={name: self.s.replay_env})
                self.paths[name] = results[0].to_json()
                require_success(results)
                event = results[0].event("resume") or {}
                if event.get("step") != span.start or event.get("rng_restored") is not True:
                    raise VerificationIncomplete(f"the replay did not resume from step {span.start} "
                                                 f"(its resume event: {event or 'none'})")

    def _argv(self, span: Span, config: str, *, world_change: bool) -> list[str]:
        """The ``train`` command line of one span: the run's task, settings and seed, the span's world."""
        # Generation a written by other code: the replay continues it with this code, and says so (audit_span).
        allow = ["--allow-code-change"] if self.span.get("replay_crosses_code_change") else []
        return job_argv("train", "--store", self.replay_url, "--task", self.task_name, "--config", config,
                        "--seed", str(self.plan["seed"]), "--steps", str(span.end - span.start),
                        "--checkpoint-every", "0", "--checkpoint-every-seconds", "0", "--keep", "0",
                        "--resume", "auto", "--device", self.s.device, "--log-format", "json", *allow,
                        *(["--allow-world-change"] if world_change else []),  # as the run changed it, there
                        *layout_flag(sharded(self.plan)),  # as plan.json says: the same state format
                        *(["--nproc-per-node", str(span.world)] if span.world > 1 else []),  # the span's ranks
                        *self.s.store_args)

    def verdicts(self) -> dict[str, Any]:
        """An audit has no negative path: ``negative_divergence_detected`` is None."""
        replay = self.diffs["replay"]
        positive = bool(replay) and all(d.within for d in replay.values())
        return {"all_checks_passed": positive, "positive": positive, "negative_divergence_detected": None}

    def after_pass(self) -> None:
        """After a passed audit: record its span in ``<run>/verification/audited.json`` (releases the restore point
        the trainer protects from retention, trainproof.format.protect). Only for the default workdir: with
        ``--workdir`` the run's store is left alone."""
        if self.s.workdir is not None or not self.verdicts()["all_checks_passed"] or self.a is None:
            return
        record = {"from": self.a, "to": self.b, "passed": True, "id": self.s.vid,
                  "restore_points": self.span.get("restore_points", [])}
        keys = self.run_store.options.signing
        if keys is not None:  # it releases retention's protection: evidence, signed like the generations
            record = keys.sign(record)
        try:
            self.run_store.child("verification").write_file(AUDITED_FILE, (json.dumps(record) + "\n").encode())
            self.audited_record = f"{self.run_store.url}/verification/{AUDITED_FILE}"
        except (StoreError, OSError) as exc:
            self.audited_record = f"not written: {exc}"

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
            extra={"audited_generations": self.generations, "parameter_distance": self.distance,
                   "audit_span": self.span, "audited_record": self.audited_record, "history_compared": self.history},
            error=error)

    def plot(self) -> None:
        """An audit draws no plot: it compares one replayed generation, not a trajectory."""
        return None


def _resumed_from(info: Any) -> int | None:
    """The step generation ``info``'s process resumed from (None: a fresh start, written before it was recorded, or
    no step at all: trainproof.format.protect reads it, as retention does)."""
    return None if info is None else recorded_restore(info.manifest)


def default_from(steps: list[int], b: int | None, restore: int | None) -> tuple[int | None, str]:
    """Generation a for ``--to b``: the newest one before b's restore point (the point itself when nothing older is
    kept), so the replay spans the restore; without a restore point (or when it is gone) the newest before b."""
    if b is None:
        return None, "no generation"
    if restore is not None and restore < b:
        before = [s for s in steps if s < restore]
        if before:
            return before[-1], f"the newest generation before the restore point {restore}"
        if restore in steps:
            return restore, f"the restore point {restore} itself (no older generation is kept)"
    earlier = [s for s in steps if s < b]
    why = "no restore point recorded" if restore is None else f"the restore point {restore} is no longer stored"
    return (earlier[-1] if earlier else None), f"the newest generation before {b} ({why})"


@dataclass(frozen=True)
class Span:
    """One replay process: from generation ``start`` to ``end`` with ``world`` ranks."""

    start: int
    end: int
    world: int


def _world(info: Any) -> int | None:
    """The world size generation ``info`` was written by (its COMPLETE.json ``world``), None when unreadable."""
    world = info.manifest.get("world") if isinstance(info.manifest, dict) else None
    return world if type(world) is int and world >= 1 else None


def replay_spans(a: int, b: int, infos: dict[int, Any], where: str) -> list[Span]:
    """The replay a -> b as spans of one world each: the run's world changes (``--allow-world-change``) happen at a
    restore point, where the generations after it record another world than the one before. VerificationIncomplete
    when a generation's world is unreadable, or changes without a restore point within the span to change it at."""
    worlds = {s: _world(info) for s, info in infos.items()}
    bad = sorted(s for s, w in worlds.items() if w is None)
    if bad:
        raise VerificationIncomplete(f"generation {bad[0]} of {where} records no world size")
    spans = [Span(a, b, worlds[a])]  # type: ignore[arg-type]
    for s in sorted(t for t in infos if a < t <= b):
        if worlds[s] == spans[-1].world:
            continue
        r = _resumed_from(infos[s])
        if r is None or not spans[-1].start <= r < s:
            raise VerificationIncomplete(
                f"generation {s} of {where} was written by {worlds[s]} rank(s) and the generations before it by "
                f"{spans[-1].world}, with no restore point between them to replay the world change at",
                hint="audit a pair of generations of one world with --from/--to")
        if r == spans[-1].start:  # the change happened at the span's own start: the span runs with the new world
            spans[-1] = Span(r, b, worlds[s])  # type: ignore[arg-type]
        else:
            spans[-1] = Span(spans[-1].start, r, spans[-1].world)
            spans.append(Span(r, b, worlds[s]))  # type: ignore[arg-type]
    return spans


def audit_span(a: int, b: int, how: str, restore: int | None, infos: dict[int, Any], generations: dict[str, Any],
               *, replay_code: str, spans: list[Span] | None = None) -> dict[str, Any]:
    """What the replay a -> b spans: restore points, code identities, world changes, and whether it crosses each."""
    points = sorted({r for s, info in infos.items() if s > a and (r := _resumed_from(info)) is not None and a <= r < b})
    code_a, code_b = generations["from"].get("code_version"), generations["to"].get("code_version")
    crosses = bool(points) or (restore is not None and a <= restore < b)
    spans = spans or []
    start_world = _world(infos[a]) if a in infos else None
    changes = [{"step": s.start, "from": p.world if p else start_world, "to": s.world}
               for p, s in zip([None, *spans], spans) if (p.world if p else start_world) != s.world]
    summary = (f"replays {a} -> {b} ({how}); " + (f"spans the restore point(s) {points or [restore]}" if crosses else
                                                   "spans no restore point")
               + ("" if code_a == code_b == replay_code else
                  f"; crosses a code change ({code_a} at {a}, {code_b} at {b}, replayed with {replay_code})")
               + "".join(f"; crosses a world change at step {c['step']} ({c['from']} -> {c['to']} ranks), replayed "
                         "across it as the run resumed" for c in changes))
    return {"from": a, "to": b, "chosen": how, "newest_restore_point": restore, "restore_points": points,
            "spans_restore": crosses, "code_versions": {"from": code_a, "to": code_b, "replay": replay_code},
            "crosses_code_change": not code_a == code_b == replay_code,
            "replay_crosses_code_change": code_a != replay_code, "world_changes": changes,
            "replayed_worlds": [{"from": s.start, "to": s.end, "world": s.world} for s in spans], "summary": summary}


def _describe(loaded: Any) -> dict[str, Any]:
    manifest = loaded.info.manifest
    return {"generation": loaded.info.name, "step": loaded.info.step, "created_at": manifest.get("created_at"),
            "state_sha256": manifest.get("state_sha256"), "code_version": manifest.get("code_version")}
