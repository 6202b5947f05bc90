"""Which generation a run continues from, agreed by every rank: the run's plan, then the newest usable generation.

Why rank 0 decides and the others follow: discovery may quarantine a corrupt generation and plan.json is
written create-only; W ranks doing that at once would race each other, and two ranks that picked different
generations (one listed a moment later) would silently train from different states. So rank 0 writes or
reads plan.json and discovers the newest usable generation; it broadcasts what it found; every other rank
loads exactly that generation (the manifest lists the rank files: they all belong to it) and all ranks
agree that every load succeeded before training starts.

Falling back instead of failing the Job: a generation whose files verify but whose state contradicts
itself or its folder (its step is not the folder's, its contract or data identity is not the manifest's,
its history or scheduler disagree with its step) cannot have been written by a correct trainer of this run:
it is damage or a planted copy. It is quarantined (evidence kept, one warning line) and the previous
generation is used. A generation written by *other code* is not damage: it is skipped with a warning when an
older one of this build exists (a stray or planted newer file must not crash-loop the Job); when none does,
the code change is the person's call (exit 2, trainproof.train.resume).

Steps travel as integers; only ``storage`` turns them into generation names.
"""


from __future__ import annotations

import json
import logging
from typing import Any, Iterator

from trainproof.errors import StateError, TrainError
from trainproof.format.contract import PLAN_FILE, canonical_json, check_plan, ensure_plan
from trainproof.format.state import STATE_FILE, check_self_consistent, decode, decode_generation, decode_rank_part
from trainproof.storage import GenerationStore, Loaded
from trainproof.storage.errors import StoreError
from trainproof.storage.manifest import step_dir
from trainproof.storage.spool import Spool
from trainproof.train.dist import Collectives, PeerError
from trainproof.train.fetch import spooled

log = logging.getLogger("trainproof.resume")  # the logger name users filter on, kept from before the split


def agree_plan(store: GenerationStore, plan: dict[str, Any], sync: Collectives) -> dict[str, Any]:
    """plan.json written or checked by rank 0, then checked by every rank against its own options."""
    stored = sync.on_rank0(f"write or check {PLAN_FILE}", lambda: ensure_plan(store, plan))
    raw = sync.broadcast_bytes(canonical_json(stored) if sync.rank == 0 else None, f"share {PLAN_FILE}")
    if sync.rank:
        stored = json.loads(raw)
        check_plan(stored, plan, where=f"{store.url} (rank {sync.rank}'s options differ from rank 0's)")
    return stored


def agreed_generations(store: GenerationStore, contract: str, sync: Collectives, *,
                       code_version: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(step, joined state) of each generation this run may resume from, newest first, every one loaded by every
    rank: rank 0 finds the next (:func:`_candidates`), broadcasts its step, and all ranks agree each load succeeded.
    The caller stops taking them once one restores (every rank stops at the same one).

    ``code_version``: this build's; a generation of other code is passed over for an older one of this build
    (see the module docstring)."""
    candidates = _candidates(store, contract, code_version) if sync.rank == 0 else iter(())
    while True:
        loaded = sync.on_rank0("find the newest usable generation", lambda: next(candidates, None))
        step = int(sync.broadcast_bytes(str(loaded[0] if loaded else 0).encode() if sync.rank == 0 else None,
                                        "share the step to resume"))
        error: Exception | None = None
        if sync.rank and step:
            try:
                loaded = _load(store, contract, step)
            except (TrainError, StoreError, OSError) as exc:
                error = exc
        sync.require_all(error is None, f"load generation {step} to resume")
        if isinstance(error, TrainError):
            raise error
        if error is not None:
            raise PeerError(f"could not load step {step}, which rank 0 resumes from: {error}")
        if not step or loaded is None:
            return
        yield step, loaded[1]


def _candidates(store: GenerationStore, contract: str,
                code_version: str | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rank 0: the generations to try, newest first, in one pass over the store's usable ones. Any world: a newer
    generation written by another world must be refused (or adopted) explicitly, never silently skipped in favour
    of an older one that would lose its progress."""
    other_code: tuple[int, dict[str, Any]] | None = None  # the newest of other code since the last one offered
    decoded: dict[int, Any] = {}
    for found in store.usable(contract=contract, check=_checker(decoded), **spooled()):
        step = found.info.step
        try:
            state = _joined(found, decoded)
            problem = _inconsistency(state, step, contract)
        except (OSError, StoreError):
            raise  # this machine or the store, not the generation's content
        except Exception as exc:  # a rank file or a section missing, a field of the wrong kind: not written by us
            problem = _problem(exc)
        if problem is not None:
            log.warning("skipping %s (inconsistent): %s", found.info.name, problem)
            _quarantine(store, step, problem)
            continue
        written_by = state["meta"].get("code_version")
        if code_version is not None and written_by != code_version:
            log.warning("skipping %s: written by %r, this is %r; looking for an older generation of this build",
                        found.info.name, written_by, code_version)
            other_code = other_code or (step, state)
            continue
        other_code = None
        yield step, state
    if other_code:
        yield other_code  # none of this build below: the newest, for check_consistency to refuse by name


def _inconsistency(state: dict[str, Any], step: int, contract: str) -> str | None:
    try:
        check_self_consistent(state, step=step, contract=contract)
    except StateError as exc:
        return str(exc)
    return None


def _problem(exc: Exception) -> str:
    """One line naming what in a stored state made decoding fail (a KeyError names the missing key)."""
    if isinstance(exc, KeyError):
        return f"it lacks {exc.args[0]!r}" if exc.args else "a section is missing"
    text = (str(exc).strip().splitlines() or [""])[0]
    return (text if isinstance(exc, TrainError) else f"{type(exc).__name__}: {text}")[:300]


def quarantine_corrupt(store: GenerationStore, step: int, reason: str) -> None:
    """Rank 0, after every rank failed to load generation ``step``'s shards because a byte disagreed with its
    manifest: one warning, and the generation is quarantined (kept as evidence, never resumed from again)."""
    log.warning("skipping %s (corrupt): %s", step_dir(step), reason)
    _quarantine(store, step, reason)


def quarantine_unusable(store: GenerationStore, step: int, reason: str) -> None:
    """Rank 0, once an older generation restored: generation ``step`` verified but did not restore (a state that
    does not fit this task, generators that do not reproduce their recorded draws): quarantined, kept as evidence
    (the warning naming it was given when it was passed over)."""
    _quarantine(store, step, reason)


def _quarantine(store: GenerationStore, step: int, reason: str) -> None:
    try:
        store.quarantine(step, reason)
    except (StoreError, OSError) as exc:
        log.warning("could not quarantine step %d (%s); it stays in place and keeps being skipped", step, exc)


def _load(store: GenerationStore, contract: str, step: int) -> tuple[int, dict[str, Any]]:
    decoded: dict[int, Any] = {}
    found = store.load(step, _checker(decoded), contract=contract, **spooled())
    return step, _joined(found, decoded)


def _checker(decoded: dict[int, Any]):
    def check(name: str, data: bytes | Spool) -> None:
        if name == STATE_FILE:
            decoded.clear()  # hold at most one decoded candidate in memory
            decoded[id(data)] = (data, decode(data))  # keeps `data` alive, so its id stays unique
        elif name.startswith("rank-"):
            decode_rank_part(data)

    return check


def _joined(found: Loaded, decoded: dict[int, Any]) -> dict[str, Any]:
    """The generation's state, rank parts joined. A large state was downloaded into a spool file and is
    memory-mapped (its tensors page in from the file as the model loads them: no second copy in memory); the
    spool files are deleted here, which leaves the mapping valid."""
    try:
        data = found.files[STATE_FILE]
        state = decoded[id(data)][1] if id(data) in decoded else None
        return decode_generation(found.files, state=state)
    finally:
        found.close()


