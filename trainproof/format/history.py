"""A state's full per-step history, reassembled from the generations of its run.

A generation holds only the history rows since the previous committed generation (``history_chain.first``..its
step, trainproof.format.state): checkpoints stay the same size however long the run. Whoever needs every step (the
verifier's comparisons, the audit, the export's loss curve) walks back through the run's generations: the rows
before ``first`` are in generation ``first - 1``, whose own rows start at its ``first``, and so on down to step 1.

Every link is checked: each generation's rows must hash from its ``before`` to its ``digest`` (the chain of
trainproof.format.state.History), and each ``before`` must be the ``digest`` of the generation below it, down to the
chain's genesis at step 1. So a full history reassembled here is proven to be exactly the rows the newest state's
digest was computed over; a row changed in an older generation (even one re-committed with valid checksums)
breaks the chain and is refused by name.

:func:`assemble` is the logic (generations come from a ``fetch`` callable); :func:`from_store` reads them from a
run's store. ``partial=True`` (the export, the audit) stops at the first generation that is missing (deleted by
retention) and says which steps it covers, instead of failing; a generation that is there but does not verify
or does not chain is refused in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from trainproof.errors import StateError
from trainproof.format.state import (
    HISTORY_DIR,
    HISTORY_FILE,
    STATE_FILE,
    History,
    check_history,
    decode,
    decode_history,
)
from trainproof.storage import COMPLETE, GenerationStore
from trainproof.storage.errors import StoreError
from trainproof.storage.manifest import step_dir
from trainproof.storage.spool import spool_dir


class MissingGeneration(StateError):
    """The generation holding the next older rows is not in the run (retention deleted it, or it was quarantined)."""


KEPT_COPY = "kept_copy"
"""Set in what a fetch returns from ``<run>/history/`` rather than from the generation itself."""
Fetch = Callable[[int], "dict[str, Any] | None"]
"""Generation ``step``'s decoded history section (its ``history.pt``, or its ``training_state.pt``: a mapping with
``progress.step``, ``history`` and ``history_chain``), or None when the run has none."""


@dataclass(kw_only=True)
class Assembled:
    """A state whose ``history`` holds every step from ``first`` to its own step, in the columnar layout."""

    state: dict[str, Any]
    """The state, its ``history`` replaced by the reassembled rows and ``history_chain.first`` set to ``first``."""
    first: int
    """The first step covered (1 for a full history, or the ``since`` asked for)."""
    step: int
    """The state's own step: the last one covered."""
    generations: list[int] = field(default_factory=list)
    """The generations read, newest first (the state's own step first)."""
    stopped: str | None = None
    """Why a partial reassembly stops after ``first`` (None when it reached what was asked)."""

    def to_json(self) -> dict[str, Any]:
        """Which steps the history covers and why not more (for a bundle or a report)."""
        return {"first_step": self.first, "last_step": self.step, "complete": self.first == 1,
                "generations_read": len(self.generations), "stopped": self.stopped}


def assemble(state: dict[str, Any], fetch: Fetch, *, since: int = 1, partial: bool = False) -> Assembled:
    """The history of ``state`` from step ``since`` (default: 1, all of it) to its own step.

    Refuses (StateError, naming the generation) a missing generation (:class:`MissingGeneration`), a state whose
    rows do not hash to its digest, and a broken link between generations. ``partial``: a missing generation
    ends the walk instead (the history then starts later, and ``stopped`` says why); damage is never tolerated.
    """
    own = state["progress"]["step"]
    parts = [check_history(state)]
    used = [own]
    stopped = None
    while parts[-1].first > max(since, 1):
        newer, need = used[-1], parts[-1].first - 1
        try:
            parts.append(_previous(fetch, need, newer, parts[-1].before))
        except MissingGeneration as exc:
            if not partial:
                raise
            stopped = str(exc)
            break
        used.append(need)
    full = History.join(parts[::-1])
    if full.first < since:
        full = full.since(since)
    chain = {"first": full.first, "before": full.before, "digest": state["history_chain"]["digest"]}
    return Assembled(state={**state, "history": full.state_dict(), "history_chain": chain}, first=full.first,
                     step=own, generations=used, stopped=stopped)


def _previous(fetch: Fetch, need: int, newer: int, before: str) -> History:
    """Generation ``need``'s rows, checked to end exactly where generation ``newer``'s chain starts. A kept copy of
    them (``KEPT_COPY``) that does not check out is missing, not damage: the generation itself is gone."""
    prev = fetch(need)
    if prev is not None and prev.get(KEPT_COPY):
        try:
            return _checked(prev, need, newer, before)
        except StateError as exc:
            raise MissingGeneration(f"the kept copy of {step_dir(need)}'s history rows is not this run's: "
                                    f"{exc}") from None
    return _checked(prev, need, newer, before)


def _checked(prev: dict[str, Any] | None, need: int, newer: int, before: str) -> History:
    if prev is None:
        raise MissingGeneration(f"the history before step {need + 1} is in "
                                f"{step_dir(need)}, which the run no longer has "
                         f"(deleted by retention?): {step_dir(newer)} chains from it")
    if prev["progress"].get("step") != need:
        raise StateError(f"{step_dir(need)} holds the state of step {prev['progress'].get('step')!r}")
    try:
        rows = check_history(prev)
    except StateError as exc:
        raise StateError(f"{step_dir(need)}: {exc}") from None
    if rows.first > need:
        raise StateError(f"{step_dir(need)} holds no history rows of its own (its rows start at step {rows.first})")
    if rows.digest != before:
        raise StateError(
            f"history chain broken: the rows of {step_dir(need)} (steps {rows.first}..{need}) hash to "
            f"{rows.digest[:16]}..., but {step_dir(newer)} chains from {before[:16]}...: a history row of "
            f"{step_dir(need)} was changed after {step_dir(newer)} "
            "was written, or the generations are of different runs")
    return rows


def store_fetch(store: GenerationStore, contract: str | None = None) -> Fetch:
    """Read generations of ``store`` for :func:`assemble`: verified (size, sha256), decoded weights-only, never
    quarantined or deleted. A step without a complete generation gives None; a corrupt one StateError."""
    complete: set[int] | None = None

    def fetch(step: int) -> dict[str, Any] | None:
        nonlocal complete
        if complete is None:
            complete = {g.step for g in store.scan(contract=contract) if g.status == COMPLETE}
        if step not in complete:
            return kept(step)
        try:
            info = store.generation(step, contract=contract)
            if info.manifest is not None and HISTORY_FILE in info.manifest["files"]:
                # Only the generation's small history.pt: never its model and optimizer.
                return decode_history(store.load_files(info, [HISTORY_FILE]).files[HISTORY_FILE])
            # A generation written before history.pt existed: its state, spooled and memory-mapped (its tensors
            # are never read whole into memory; only the history rows are touched).
            loaded = store.load(step, contract=contract, skip=lambda name: name != STATE_FILE,
                                spool_dir=spool_dir(), spool_from=0)
        except (StoreError, OSError) as exc:
            raise StateError(f"{step_dir(step)} cannot be read: {exc}") from None
        try:
            return decode(loaded.files[STATE_FILE])
        finally:
            loaded.close()

    kept = _kept_copies(store, contract)
    return fetch


def _kept_copies(store: GenerationStore, contract: str | None) -> Fetch:
    """The rows of a generation retention deleted, from its copy under ``<run>/history/`` (HISTORY_DIR), marked
    ``kept_copy``: a copy that is unreadable or does not chain is treated as missing, never as a reason to fail
    (anyone who can write to the bucket could have put it there; the chain check decides what is the run's)."""
    copies = store.child(HISTORY_DIR)
    complete: set[int] | None = None

    def fetch(step: int) -> dict[str, Any] | None:
        nonlocal complete
        try:
            if complete is None:
                complete = {g.step for g in copies.scan(contract=contract) if g.status == COMPLETE}
            if step not in complete:
                return None
            info = copies.generation(step, contract=contract)
            return {**decode_history(copies.load_files(info, [HISTORY_FILE]).files[HISTORY_FILE]), KEPT_COPY: True}
        except (StoreError, OSError, StateError) as exc:
            raise MissingGeneration(f"the kept copy of {step_dir(step)}'s history rows cannot be read: {exc}") from None

    return fetch


def from_store(store: GenerationStore, state: dict[str, Any], *, contract: str | None = None, since: int = 1,
               partial: bool = False) -> Assembled:
    """:func:`assemble` over the generations of ``store`` (the run ``state`` was read from)."""
    return assemble(state, store_fetch(store, contract), since=since, partial=partial)
