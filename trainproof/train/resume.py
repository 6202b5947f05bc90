"""Where a run continues from: one function, :func:`resume`, and the decisions it makes on the way.

Read :func:`resume` top to bottom: with ``--resume never`` refuse a store that already holds generations;
otherwise go through the usable generations every rank agreed on, newest first, until one restores
(trainproof.train.discover): decide whether this process may continue it (its world size, its code identity),
check it against what this run expects, load a sharded layout's shards, and restore the rest with the generators
last (trainproof.train.run ``restore_state``). It returns a small value (:class:`Resumed`) the trainer records in
every later generation.

World size: the run's current world is that of its newest usable generation (or plan.json's before the
first one). Resuming with another world is refused (exit 2) unless ``--allow-world-change``; then the
global data position carries over, every rank's generators are re-derived from (seed, rank, step), and the
change is recorded: the run is no longer bitwise comparable with a run that kept its world.

Code identity: a generation written by other code is refused (exit 2) unless ``--allow-code-change``, which is
recorded like a world change (discovery has already preferred an older generation of this build if one exists).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from trainproof.errors import ContractError, StateError, TrainError
from trainproof.format.identity import code_version
from trainproof.format.layout import sharded
from trainproof.format.state import Expected, check_consistency
from trainproof.storage import COMPLETE, INCOMPLETE, GenerationStore
from trainproof.storage.errors import StoreError
from trainproof.storage.manifest import step_dir
from trainproof.train.discover import agreed_generations, quarantine_corrupt, quarantine_unusable
from trainproof.train.dist import Collectives, PeerError
from trainproof.train.parallel import Strategy
from trainproof.train.pretrained import start_from_pretrained
from trainproof.train.progress import Reporter
from trainproof.train.run import RestoreCheckError, Run, check_fits, restore_state


@dataclass(frozen=True, kw_only=True)
class ResumeOptions:
    """What the command line says about resuming (trainproof.train.config ``TrainConfig``)."""

    mode: str = "auto"
    """``auto`` (the newest usable generation, else a fresh start) or ``never`` (refuse a store with generations)."""
    seed: int
    allow_world_change: bool = False
    allow_code_change: bool = False
    restore_rng: bool = True
    """False only for the verifier's negative control (``--omit-rng-restore``)."""


@dataclass(kw_only=True)
class Resumed:
    """What this start continues from (recorded in every generation it writes, and in summary.json)."""

    step: int | None = None
    """The generation restored; None: a fresh start."""
    world_changes: list[dict[str, int]] = field(default_factory=list)
    """The run's world-size changes so far, as ``{step, from, to}``."""
    code_changes: list[dict[str, Any]] = field(default_factory=list)
    """The code identities the run changed between (``--allow-code-change``), as ``{step, from, to}``."""


@dataclass(kw_only=True)
class _Context:
    run: Run
    store: GenerationStore
    plan: dict[str, Any]
    sync: Collectives
    parallel: Strategy
    options: ResumeOptions
    reporter: Reporter
    started: float = field(default_factory=time.perf_counter)
    """When the resume began: the resume event says how long finding, verifying and restoring took."""

    @property
    def rank0(self) -> bool:
        return self.sync.rank == 0


def resume(run: Run, *, store: GenerationStore, plan: dict[str, Any], sync: Collectives, options: ResumeOptions,
           reporter: Reporter) -> Resumed:
    """Load the newest usable generation of this run into ``run`` on every rank (generators last). What was
    fetched ahead and not taken (``GenerationStore.fetch_ahead``) is deleted once the resume is over."""
    try:
        return _resume(run, store=store, plan=plan, sync=sync, options=options, reporter=reporter)
    finally:
        store.discard_ahead()  # never a second copy of the state on disk for the run's length


def _resume(run: Run, *, store: GenerationStore, plan: dict[str, Any], sync: Collectives, options: ResumeOptions,
            reporter: Reporter) -> Resumed:
    c = _Context(run=run, store=store, plan=plan, sync=sync, parallel=run.parallel, options=options,
                 reporter=reporter)
    if options.mode == "never":
        sync.on_rank0("check that the store holds no generation", lambda: _refuse_existing_generations(store))
        return _fresh(c)
    # Without --allow-code-change a newer generation of other code is passed over for one of this build.
    generations = agreed_generations(store, plan["contract"], sync,
                                     code_version=None if options.allow_code_change else code_version())
    unusable: list[tuple[int, Exception]] = []  # generations that verified but did not restore, newest first
    corrupt_shards: int | None = None  # the last generation passed over for a corrupt shard file
    for step, state in generations:
        failure: Exception | None = None
        try:
            resumed = _decide(c, step, state)
            changed = state["meta"]["world"] != sync.world
            if not _load_shards(c, state, step, changed):
                corrupt_shards = step  # quarantined: on to the next older generation
                continue
            check_fits(run, state)
            _restore(c, state, rederive_at=step if changed else None)
        except (ContractError, PeerError, OSError, StoreError):
            raise  # what the operator passed, or the environment: never a reason to pass a generation over
        except Exception as exc:  # anything else the stored state made the restore raise
            failure = exc
        if not _agreed_unusable(c, failure, step):
            break
        unusable.append((step, failure or StateError("another rank could not restore it")))
    else:
        return _none_restored(c, unusable, corrupt_shards)
    if unusable and c.rank0:  # a generation below them restored: they were damage, or planted
        for bad, exc in unusable:
            quarantine_unusable(store, bad, f"does not restore: {_why(exc)}")
    reporter.event("resume", step=run.step, generation=step_dir(step), rng_restored=options.restore_rng,
                   restore_s=round(time.perf_counter() - c.started, 3),
                   fetched_ahead=store.fetched_ahead == step_dir(step),  # downloaded beside the start-up
                   **({"world_change": resumed.world_changes[-1]} if changed else {}))
    return Resumed(step=run.step, world_changes=resumed.world_changes, code_changes=resumed.code_changes)


def _none_restored(c: _Context, unusable: list[tuple[int, Exception]], corrupt_shards: int | None) -> Resumed:
    """No generation restored: refuse when some verified but did not restore, or one had a corrupt shard file;
    otherwise a fresh start."""
    if unusable:
        _refuse_all_unusable(c, unusable)
    if corrupt_shards is not None:
        # A failed sharded load may have copied verified parts of its files into the model and optimizer
        # before a later part failed: this process does not train a fresh run from those tensors.
        raise TrainError(f"every generation left to resume from had a corrupt shard file (quarantined, "
                         f"the last {step_dir(corrupt_shards)}); this process may hold part of one, so it does not "
                         "start fresh: run it again to start from step 0")
    c.sync.on_rank0("look for unusable generations", lambda: _warn_if_unusable_generations(c))
    return _fresh(c)


def _why(exc: Exception) -> str:
    """One line saying why a state did not restore."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return (first if isinstance(exc, TrainError) else f"{type(exc).__name__}: {first}")[:300]


def _agreed_unusable(c: _Context, failure: Exception | None, step: int) -> bool:
    """Whether generation ``step`` failed to restore on any rank (every rank agrees); one warning line on rank 0."""
    failed = c.sync.sum_ints([0 if failure is None else 1], f"agree whether {step_dir(step)} restored")[0]
    if failed and c.rank0:
        why = _why(failure) if failure is not None else f"{failed} other rank(s) could not restore it"
        c.reporter.warn(f"skipping {step_dir(step)} (does not restore): {why}; trying the one before it")
    return bool(failed)


def _refuse_all_unusable(c: _Context, unusable: list[tuple[int, Exception]]) -> None:
    """Every generation that verified failed to restore: that is this process (its code, a sabotaged restore),
    not the bucket, so nothing is quarantined and nothing starts fresh beside them; the newest one's failure is
    raised as it was (a StateError: exit 2, naming it)."""
    step, exc = unusable[0]
    if isinstance(exc, RestoreCheckError):
        # Named for the verifier: a resume that fails its own check is a failed comparison, not a crash.
        c.reporter.event("restore_check_failed", check=exc.check, generators=exc.differing, detail=str(exc))
    if c.rank0:
        c.reporter.warn(f"no generation restores ({', '.join(step_dir(s) for s, _ in unusable)}): nothing is "
                        f"quarantined and nothing starts fresh; the newest, {step_dir(step)}, fails as follows")
    raise exc


def _fresh(c: _Context) -> Resumed:
    """A fresh start: the world is compared with the one plan.json recorded; a task that starts from pretrained
    weights gets them now (trainproof.train.pretrained: read, verified and loaded on a fresh start only)."""
    changes = _decide_world(c, c.plan["world"], step=0, history=[], source=f"plan.json of {c.store.url}")
    files = c.run.task.pretrained()
    if files:
        loaded = start_from_pretrained(files, c.parallel.load_initial, c.run.model, c.run.task.pretrained_name)
        c.reporter.event("pretrained", **loaded)
    return Resumed(world_changes=changes)


def _decide(c: _Context, step: int, state: dict[str, Any]) -> Resumed:
    """Whether this process may continue generation ``step`` (world, code), and whether it is what this run
    expects (contract, data identity, its own step); warnings for what is valid but not bitwise equal."""
    saved_world, name = state["meta"]["world"], step_dir(step)
    _world_is_the_runs(c.plan, state["meta"], name)
    world_changes = _decide_world(c, saved_world, step=state["progress"]["step"],
                                  history=state["meta"].get("world_changes", []),
                                  source=f"{name} was written by {saved_world} rank(s)")
    if saved_world != c.sync.world:
        check_transition(state["ranks"][0]["data"], c.sync.world, c.run.global_batch)
    saved_code, code_changes = _decide_code(c, state, step=state["progress"]["step"], source=name)
    # The generation's own step (its folder name), not the state's word for it: a state moved under a newer name
    # must be refused, never resumed from.
    expected = Expected(contract=c.plan["contract"], world=saved_world, code_version=saved_code or code_version(),
                        data_identity=c.plan["data_identity"], step=step)
    _same_as_plan(c.plan, state["meta"], name)
    for warning in check_consistency(state, expected) + _device_warnings(state, c.run.device):
        c.reporter.warn(warning)
    return Resumed(step=step, world_changes=world_changes, code_changes=code_changes)


def _world_is_the_runs(plan: dict[str, Any], meta: dict[str, Any], name: str) -> None:
    """A generation's world is the one plan.json recorded, or the last world change its own history records (a
    change is only ever made with --allow-world-change, and recorded then). A state of another world without
    that record was not written by this run: StateError, so it is passed over like any unusable generation,
    rather than asking the operator (exit 2) for a world change they never made. Only a world the run's own
    history reached reaches the operator's decision (``_decide_world``)."""
    changes = meta.get("world_changes", [])
    if not isinstance(changes, list) or not all(isinstance(change, dict) for change in changes):
        raise StateError(f"{name}'s meta.world_changes is not a list of world changes")
    recorded = changes[-1].get("to") if changes else plan.get("world")
    if meta.get("world") != recorded:
        raise StateError(f"{name} says it was written by {meta.get('world')!r} rank(s), but this run's world is "
                         f"{recorded!r} (plan.json and the world changes the state records)")


def _same_as_plan(plan: dict[str, Any], meta: dict[str, Any], name: str) -> None:
    """The state's record of what the run trains is plan.json's (the contract alone does not cover the copies in
    ``meta``): a state that says otherwise was not written by this run (StateError: the generation is passed over)."""
    for key in ("task", "task_config", "seed", "objective"):
        if key in plan and _as_json(meta.get(key)) != _as_json(plan[key]):  # as plan.json holds it: tuples are lists
            raise StateError(f"{name}'s meta.{key} is not plan.json's")
    if "layout" in plan and (not isinstance(meta.get("layout"), dict)
                             or meta["layout"].get("name") != plan["layout"].get("name")):
        raise StateError(f"{name}'s meta.layout is not plan.json's")


def _as_json(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, default=repr)
    except (TypeError, ValueError, RecursionError):
        return repr(value)


def _decide_world(c: _Context, saved_world: int, *, step: int, history: list[dict[str, int]],
                  source: str) -> list[dict[str, int]]:
    """The run's world changes; refuse (exit 2) a change not allowed."""
    world = c.sync.world
    changes = world_decision(saved_world=saved_world, world=world, step=step, source=source,
                             allow=c.options.allow_world_change, history=history)
    if saved_world != world and c.rank0:
        c.reporter.warn(f"world size changes from {saved_world} to {world} at step {step} "
                        "(--allow-world-change): this run is no longer bitwise comparable with one that "
                        "kept its world size")
    return changes


def _decide_code(c: _Context, state: dict[str, Any], *, step: int, source: str) -> tuple[str, list[dict[str, Any]]]:
    """Refuse (exit 2) a resume under other code unless ``--allow-code-change``; record an allowed change.

    Returns the code identity the state must carry (the saved one when the change is allowed) and the changes."""
    saved, now = state["meta"].get("code_version"), code_version()
    changes = code_decision(saved=saved, now=now, step=step, source=source, allow=c.options.allow_code_change,
                            history=state["meta"].get("code_changes", []))
    if saved != now and c.rank0:
        c.reporter.warn(f"code changes from {saved} to {now} at step {step} (--allow-code-change): "
                        "an audit replaying across this step runs the new code")
    return saved, changes


def _load_shards(c: _Context, state: dict[str, Any], step: int, world_changed: bool) -> bool:
    """A sharded layout loads its model and optimizer from the generation's shards (every rank: only the chunks
    it needs; DCP reshards after an allowed world change) before the rest of the state is restored.

    False when a shard file's bytes disagree with the manifest (every rank learns it from DCP): rank 0
    quarantines the generation with a warning and the caller falls back to the next older one, as for a
    corrupt training state. Any other failure raises."""
    saved, mine = sharded(state["meta"]), c.parallel.layout.sharded
    if saved != mine:  # plan.json refuses this first; a generation must agree too
        raise ContractError(f"{step_dir(step)} was written by a {'sharded (--fsdp)' if saved else 'replicated (DDP)'} "
                            f"run and this run trains {'sharded' if mine else 'replicated'}: resume it "
                            f"{'with' if saved else 'without'} --fsdp")
    corrupt = c.parallel.load(c.run.model, c.run.optimizer, c.store, step, world=c.sync.world,
                              contract=c.plan["contract"], allow_world_change=world_changed)
    if corrupt is not None and c.rank0:
        quarantine_corrupt(c.store, step, corrupt)
    return corrupt is None


def _restore(c: _Context, state: dict[str, Any], *, rederive_at: int | None) -> None:
    restore_state(c.run, state, restore_rng=c.options.restore_rng, seed=c.options.seed, rederive_at=rederive_at)


def _device_warnings(state: dict[str, Any], device: torch.device) -> list[str]:
    saved = state["meta"].get("device")
    if saved == str(device):
        return []
    return [f"the state was written on {saved}, this process trains on {device}: the resume is valid "
            "but not bitwise equal (other kernels, and AMP only on CUDA)"]


def _refuse_existing_generations(store: GenerationStore) -> None:
    complete = [g for g in store.scan() if g.status == COMPLETE]
    if complete:
        raise ContractError(
            f"--resume never, but {store.url} already holds {len(complete)} complete generation(s) "
            f"(newest step {complete[-1].step}); use a new --store, or --resume auto to continue"
        )


def _warn_if_unusable_generations(c: _Context) -> None:
    scan = c.store.scan(contract=c.plan["contract"])
    present = [g for g in scan if g.status != INCOMPLETE]
    if present:
        c.reporter.warn(f"{len(present)} generation(s) in {c.store.url} but none is usable by this "
                        "run: starting from step 0")


def world_decision(*, saved_world: int, world: int, step: int, allow: bool, history: list[dict[str, int]],
                   source: str) -> list[dict[str, int]]:
    """The world changes of the run after this start; ContractError (exit 2) for a change not allowed.

    ``source`` says where ``saved_world`` comes from (a generation, or plan.json before the first one).
    """
    if saved_world == world:
        return list(history)
    if not allow:
        raise ContractError(
            f"this run trains with world size {saved_world} ({source}) but this process group has {world}: "
            f"resume with {saved_world} ranks (--nproc-per-node, or torchrun's), or pass --allow-world-change "
            f"to continue with {world} (the data order carries over, the per-rank random streams are re-derived, "
            "and the run is no longer bitwise comparable with one that kept its world size)")
    return [*history, {"step": step, "from": saved_world, "to": world}]


def code_decision(*, saved: str | None, now: str, step: int, allow: bool, history: list[dict[str, Any]],
                  source: str) -> list[dict[str, Any]]:
    """The code changes of the run after this start; ContractError (exit 2) for a change not allowed.

    The code identity (trainproof.format.identity) is not part of the run contract, so a new build can still find
    the run's generations; whether it may *continue* them is decided here, like a world-size change.
    """
    if saved == now:
        return list(history)
    if not allow:
        raise ContractError(
            f"{source} was written by {saved}, this process runs {now}: resume with the code that wrote it, or "
            "pass --allow-code-change to continue with this code (recorded in the state's meta.code_changes; "
            "an audit that replays across this step runs the new code)")
    return [*history, {"step": step, "from": saved, "to": now}]


def check_transition(data: dict[str, Any], world: int, global_batch: int) -> None:
    """Refuse a world change whose first, partial epoch would leave a rank without a sample."""
    drawn, cursor, total = data.get("drawn"), data.get("cursor", 0), data.get("num_samples", 0)
    left = total - cursor if drawn and cursor < total else 0
    tail = left % global_batch or (global_batch if left else 0)
    if 0 < tail < world:
        raise ContractError(
            f"after the world change the current epoch has {left} sample(s) left: its last step would hold "
            f"{tail} for {world} ranks. Resume with the old world size until the epoch ends, or pick a world "
            "size that divides the rest")
