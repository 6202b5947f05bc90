"""What to keep, and deleting the rest without ever losing the last good copy.

``plan_retention`` is a pure function of the list of generations and one :class:`RetentionPolicy` (the rule's
settings, passed whole: a new rule is a field there and a line here).  Its rules (each one a complaint about
users of other checkpointing tools have made: retention that deleted the only good copy, or deleted before the
new checkpoint was written):
- keep the ``keep`` newest complete generations *of this run* (``contract``/``world`` when given; none above the
  writer's newest commit, ``upto``, counts);
- never delete the newest complete generation, nor anything newer than it (a write may be in flight);
- a foreign (another contract or world), corrupt, or symlinked generation is never counted as the newest and
  never deleted: it is left in place with a warning (quarantine moves corrupt ones aside when they are loaded);
- with no ``contract`` given and complete generations of several contracts in the folder, the newest cannot be
  told apart from a stranger's, so nothing is deleted;
- collect partial generations (no COMPLETE.json) older than the newest complete one once untouched for
  ``grace_seconds``, which cannot go below MIN_GRACE_SECONDS unless the caller states that no writer is active;
  in the writer's own retention (``partials_above_newest``) newer ones too, so that a flood of partial folders
  planted above the run costs its scans once (at most COLLECT_PER_PASS a retention, oldest-touched first: a flood
  never holds a commit up for long);
- with ``keep_every`` (:class:`KeepEvery`), a sparse permanent series besides the ``keep`` newest: the first
  generation at or after each multiple of N steps, or the first committed in each window of a duration counted from
  the run's oldest kept generation; never deleted by retention under that rule (it only ever keeps more);
- export bundles, verification records and quarantine live outside ``step-*`` and are never seen here;
- an object under ``shared/`` (stored once, referenced by generations: a frozen base) that no generation left in the
  store references any more is deleted after the generations (:func:`unreferenced_shared`): a task whose frozen
  entries change (an EMA copy, layers unfrozen over time) stores a new object now and then, and these would
  otherwise pile up for the run's whole life. By default only the objects the generations deleted in this pass
  referenced (``shared="released"``: each looked up by name, and nothing asked of the store when those generations
  referenced none); ``shared="all"`` (``gc``) lists ``shared/`` and also takes what no generation ever referenced,
  once older than the grace period and no generation was written within it (a writer stores its object, or reuses
  one it finds stored, before the commit that references it).

``apply_retention`` then re-verifies (streams every file through sha256) the newest generation it keeps before
deleting anything: if that one fails, nothing older than the newest generation that does verify is deleted.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Callable, Iterable

from trainproof.storage import manifest as mf
from trainproof.storage.durations import duration_seconds
from trainproof.storage.errors import StoreError
from trainproof.storage.generations import (
    COMPLETE,
    CORRUPT,
    FOREIGN,
    INCOMPLETE,
    Ctx,
    GenerationInfo,
    scan_capped,
    verify_hashes,
)

log = logging.getLogger("trainproof.storage")
# A partial generation younger than this may belong to a writer that is still writing (a slow upload, a rank
# that lags): deleting its files under it would turn its commit into a conflict or a corrupt generation.
MIN_GRACE_SECONDS = 60.0
DEFAULT_GRACE_SECONDS = 6 * 3600.0
"""Partial generations younger than this are left alone by default (a slow upload may still be writing them)."""
COLLECT_PER_PASS = 256
"""Most partial generations one retention collects (each costs a few requests on S3); the rest wait for the next."""


SHARED_RULES = ("released", "all", "none")
"""RetentionPolicy.shared's values."""

KEEP_EVERY_FORMS = "a step count (1000) or a duration (90s, 10m, 6h, 7d, 1h30m)"


@dataclass(frozen=True)
class KeepEvery:
    """A sparse permanent series, kept besides the ``keep`` newest: one generation per ``steps`` steps or per
    ``seconds`` of the run's time (exactly one of them > 0).

    - steps N: for every multiple of N, the first generation at or after it (the lowest step in each window
      [m*N, (m+1)*N), m >= 1): a run whose commits do not land on multiples still keeps one per N steps;
    - seconds D: the first generation committed in each window of D, windows counted from the oldest of the run's
      generations (kept itself, so the windows never move); when a generation was committed is its manifest's
      ``created_at``, else its objects' modification time; one with neither is not part of the series.

    Both only ever keep more: the newest generation, the run's verified copy and the grace of partials are
    unchanged."""

    steps: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if (self.steps > 0) == (self.seconds > 0) or self.steps < 0 or self.seconds < 0 \
                or not math.isfinite(self.seconds):
            raise ValueError(f"keep-every needs exactly one of steps or seconds > 0 (got {self.steps}, {self.seconds})")

    @classmethod
    def parse(cls, text: str) -> KeepEvery:
        """``1000`` (steps) or a duration with its unit: ``90s``, ``10m``, ``6h``, ``7d``, ``1h30m``. Raises
        ValueError naming the accepted forms."""
        spec = str(text).strip().lower()
        if spec.isdigit() and len(spec) < 19 and int(spec) > 0:
            return cls(steps=int(spec))
        seconds = duration_seconds(spec)
        if seconds is not None and math.isfinite(seconds) and seconds > 0:
            return cls(seconds=seconds)
        raise ValueError(f"{str(text)[:40]!r} is not {KEEP_EVERY_FORMS} greater than 0")

    def __str__(self) -> str:
        if self.steps:
            return str(self.steps)
        left, out = int(self.seconds), []
        for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
            count, left = divmod(left, size)
            out.append(f"{count}{unit}" if count else "")
        return "".join(out) if float(int(self.seconds)) == self.seconds else f"{self.seconds}s"

    def permanent(self, generations: list[GenerationInfo]) -> set[int]:
        """The steps of ``generations`` (the run's complete ones) that form the series."""
        if self.steps:
            first: dict[int, int] = {}
            for g in generations:
                if g.step >= self.steps:
                    window = g.step // self.steps
                    first[window] = min(first.get(window, g.step), g.step)
            return set(first.values())
        timed = sorted((t, g.step) for g in generations if (t := committed_at(g)) is not None)
        windows: dict[int, int] = {}
        for t, step in timed:
            windows.setdefault(int((t - timed[0][0]) // self.seconds), step)
        return set(windows.values())


def committed_at(g: GenerationInfo) -> float | None:
    """When ``g`` was committed: its manifest's ``created_at`` (seconds since the epoch), else its objects' newest
    modification time, else None."""
    stamp = (g.manifest or {}).get("created_at")
    if isinstance(stamp, str):
        try:
            at = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
            if at.tzinfo is not None:
                return at.timestamp()
        except ValueError:
            pass
    return g.mtime


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """What retention keeps. Validated once, here; passed whole to :func:`plan_retention` and
    :func:`apply_retention`."""

    keep: int
    """Complete generations of this run to keep (>= 1: the newest complete generation is never deleted)."""
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    """A partial generation is collected once untouched this long (raised to MIN_GRACE_SECONDS, see below)."""
    contract: str | None = None
    """Only complete generations with this contract count as the run's (None: all, unless several contracts)."""
    world: int | None = None
    """Only complete generations of this world size count (None: any)."""
    protect: frozenset[int] = frozenset()
    """Steps of complete generations to keep anyway (the caller's reasons, e.g. the generation a resume started
    from, kept until an audit spans it)."""
    protect_rule: Callable[[list[GenerationInfo]], Iterable[int]] | None = None
    """More steps to keep, chosen from what is stored: called with this run's complete generations (oldest first)
    at each retention. Whatever it returns is kept; if it raises, nothing is deleted (a rule that cannot decide
    costs storage, never a generation)."""
    upto: int | None = None
    """The writer's newest commit: complete generations above it are neither counted nor deleted (a run commits
    upward, so one above its newest is not its own writing: passed over by its resume, or planted; counted, K of
    them would make retention delete each generation the run commits)."""
    i_know_no_writer_is_active: bool = False
    """Allow a grace below MIN_GRACE_SECONDS (a test, or an offline clean-up with no trainer running)."""
    partials_above_newest: bool = False
    """Collect stale partial generations above the newest complete one too. Only the run's own writer says so, in
    the retention after its commit: none of its writes is then in flight (the next save starts after it), so a
    partial folder above its newest untouched for the grace is a leftover or planted (a flood). Others (``gc``)
    leave them: a writer's upload of a large file may outlast any grace."""

    keep_every: KeepEvery | None = None
    """Also keep a sparse permanent series (:class:`KeepEvery`); None: only the ``keep`` newest (and ``protect``)."""

    shared: str = "released"
    """Which objects under ``shared/`` that no generation left references are deleted: ``released``, those the
    generations this pass deletes referenced (a committed object: no commit is in flight on it); ``all``, every
    one a listing of ``shared/`` shows (at most the store's ``scan_entries``), once older than ``grace_seconds``
    and only when no generation was written within that time (a writer may be reusing an old object for a commit
    in flight); ``none``."""

    def __post_init__(self) -> None:
        if self.shared not in SHARED_RULES:
            raise ValueError(f"shared must be one of {', '.join(SHARED_RULES)}, got {self.shared!r}")
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1 (the newest complete generation is never deleted), got {self.keep}")
        object.__setattr__(self, "protect", frozenset(self.protect))

    def protecting(self, steps: frozenset[int] | set[int]) -> RetentionPolicy:
        """This policy, also keeping ``steps``."""
        return replace(self, protect=self.protect | frozenset(steps))


def plan_retention(generations: list[GenerationInfo], policy: RetentionPolicy, *, now: float) -> list[GenerationInfo]:
    """The generations to delete under ``policy``, oldest first.  Complete generations of another contract or
    world (when the policy names them) are left alone; a grace below MIN_GRACE_SECONDS is raised to it, with a
    warning, unless the policy says no writer is active."""
    grace = effective_grace(policy.grace_seconds, policy.i_know_no_writer_is_active)
    stale = sorted((g for g in generations if g.status == INCOMPLETE and g.mtime is not None and now - g.mtime > grace),
                   key=lambda g: g.mtime or 0.0)
    ours, strangers = [], []
    for g in generations:
        if policy.upto is not None and g.step > policy.upto:
            continue  # above the writer's newest commit: not its own, never counted, never deleted here
        if g.status == COMPLETE and g.manifest is not None and _matches(g.manifest, policy.contract, policy.world):
            ours.append(g)
        elif g.status in (COMPLETE, CORRUPT, FOREIGN):
            strangers.append(g)
    for g in strangers:
        log.warning("retention: leaving %s alone (%s%s)", g.name, "another run's" if g.status == COMPLETE else g.status,
                    f": {g.reason}" if g.reason else "")
    if not ours:
        return []  # nothing of this run's to measure against: a store without its own generation is left as it is
    contracts = {g.manifest["contract"] for g in ours}
    if len(contracts) > 1:  # only possible with contract=None
        log.warning("retention: complete generations of %d different contracts and no contract given; deleting "
                    "nothing (pass the run's contract)", len(contracts))
        return []
    ours.sort(key=lambda g: g.step)
    newest = ours[-1].step
    kept = _kept(ours, policy)
    if kept is None:
        return []
    stale = [g for g in stale if g.step < newest or policy.partials_above_newest][:COLLECT_PER_PASS]
    doomed = [g for g in ours if g.step not in kept and g.step < newest] + stale
    return sorted(doomed, key=lambda g: g.step)


def _kept(ours: list[GenerationInfo], policy: RetentionPolicy) -> set[int] | None:
    """The steps of ``ours`` (oldest first) the policy keeps; None when its protection rule could not decide."""
    kept = {g.step for g in ours[-policy.keep:]} | policy.protect
    if policy.keep_every is not None:
        kept |= policy.keep_every.permanent(ours)
    if policy.protect_rule is not None:
        try:
            kept |= {int(step) for step in policy.protect_rule(list(ours))}
        except Exception as exc:  # noqa: BLE001 - a rule that cannot decide keeps everything
            log.warning("retention: the protection rule failed (%s: %s); deleting nothing", type(exc).__name__, exc)
            return None
    return kept


def effective_grace(grace_seconds: float, i_know_no_writer_is_active: bool = False, *, warn: bool = True) -> float:
    """``grace_seconds``, raised to MIN_GRACE_SECONDS (with a warning, unless ``warn`` is False: said once already)
    unless no writer can be active."""
    if grace_seconds < MIN_GRACE_SECONDS and not i_know_no_writer_is_active:
        if warn:
            log.warning("retention: grace period %.0fs raised to %.0fs: a partial generation that young may belong to "
                        "a writer still writing (pass i_know_no_writer_is_active=True when none can be)",
                        grace_seconds, MIN_GRACE_SECONDS)
        return MIN_GRACE_SECONDS
    return grace_seconds


def _matches(manifest: dict, contract: str | None, world: int | None) -> bool:
    return (contract is None or manifest["contract"] == contract) and (world is None or manifest["world"] == world)


def apply_retention(ctx: Ctx, policy: RetentionPolicy, *, dry_run: bool = False,
                    before_write=lambda: None,
                    on_shared: Callable[[str], None] | None = None) -> list[GenerationInfo]:
    """Delete what ``plan_retention`` selects, after re-verifying the newest generation kept; return it. Then
    delete the ``shared/`` objects no generation left references, as ``policy.shared`` says
    (:func:`unreferenced_shared`), calling ``on_shared(name)`` for each (with ``dry_run``: each it would delete).

    A complete generation loses its COMPLETE.json first, so an interrupted delete leaves it incomplete.  On a
    local folder a step folder that is a symlink is never entered or deleted through."""
    found = scan_capped(ctx, contract=policy.contract, world=policy.world)
    if found.truncated:  # unseen generations could be newer than what we would keep
        return []
    now = time.time()
    doomed = plan_retention(found.generations, policy, now=now)
    below = [g for g in found.generations if policy.upto is None or g.step <= policy.upto]
    if doomed and not _newest_verifies(ctx, below, policy.contract, policy.world):
        return []
    if not dry_run and doomed:
        before_write()
        for info in doomed:
            path = ctx.path(info.name)
            ctx.io(f"delete {info.name}", lambda: ctx.backend.delete_folder(path, first=mf.MARKER))
            log.info("retention: deleted %s (%s)", info.name, info.status)
    if policy.shared != "none":
        _collect_shared(ctx, policy, found.generations, doomed, now=now, dry_run=dry_run, before_write=before_write,
                        on_shared=on_shared)
    return doomed


def _collect_shared(ctx: Ctx, policy: RetentionPolicy, generations: list[GenerationInfo],
                    doomed: list[GenerationInfo], *, now: float, dry_run: bool, before_write: Callable[[], None],
                    on_shared: Callable[[str], None] | None) -> None:
    """:func:`apply_retention`'s second part: the ``shared/`` objects no generation left references, as
    ``policy.shared`` says. A failure here is a warning: the generations are deleted, an object left costs storage."""
    gone = {g.name for g in doomed}
    left = [g for g in generations if g.name not in gone]
    grace = effective_grace(policy.grace_seconds, policy.i_know_no_writer_is_active, warn=False)
    if policy.shared == "all" and any(g.mtime is not None and now - g.mtime <= grace for g in left):
        # A writer looks active (a generation written within the grace): an object it is about to reference may
        # be one it found stored and reused (an old modification time), so none is judged unreferenced now.
        log.info("retention: a generation was written within the grace period; objects under %s/ that no "
                 "generation references are left for a later pass", mf.SHARED_DIR)
        return
    try:
        unused = unreferenced_shared(ctx, left, released=None if policy.shared == "all" else _shared_refs(doomed),
                                     grace=grace, now=now)
        if unused and not dry_run:
            before_write()  # prepares the store once (GenerationStore: a no-op when the generations' delete did)
        for name in unused:
            if not dry_run:
                path = ctx.path(mf.SHARED_DIR, name)
                ctx.io(f"delete {mf.SHARED_DIR}/{name}", lambda: ctx.backend.delete(path))
                log.info("retention: deleted %s/%s (no generation references it)", mf.SHARED_DIR, name)
            if on_shared is not None:
                on_shared(name)
    except (OSError, StoreError) as exc:
        log.warning("retention: could not collect unreferenced objects under %s/: %s", mf.SHARED_DIR, exc)


def _shared_refs(generations: Iterable[GenerationInfo]) -> set[str]:
    """The ``shared/`` objects the manifests of ``generations`` reference (those whose manifest was read)."""
    return {meta["sha256"] for g in generations if g.manifest for meta in g.manifest["files"].values()
            if meta.get("shared")}


def unreferenced_shared(ctx: Ctx, generations: list[GenerationInfo], *, released: set[str] | None, grace: float,
                        now: float) -> list[str]:
    """Names of the objects under ``shared/`` that no generation of ``generations`` references (every one whose
    manifest was read, whatever its status or contract: one of another run keeps its objects too; one whose
    ``COMPLETE.json`` could not be read references nothing a reader would load), at most COLLECT_PER_PASS, oldest
    first. Only regular objects named as the store names them (a sha256: never a writer's temporary file, nor
    anything planted under another name), never through a ``shared`` that is not a folder (a symlink on a local
    store: what it points to is not the run's), nor a folder, symlink or special file inside it.

    ``released``: only these names (the objects of the generations just deleted), each looked up by name, whatever
    its age; None: every object a listing of ``shared/`` shows (capped at ``scan_entries``), untouched for
    ``grace`` seconds. Listing errors propagate."""
    referenced = _shared_refs(generations)
    wanted = sorted(name for name in (released or set()) - referenced if mf.SHA256_HEX.match(name))
    if released is not None and not wanted:
        return []  # the usual commit: nothing released, nothing asked of the store
    root = ctx.io("list the run", lambda: ctx.backend.listdir(ctx.root, prefix=mf.SHARED_DIR))
    if not any(e.name == mf.SHARED_DIR and e.is_dir and not e.is_special for e in root):
        return []  # none, or not a folder: put_shared moves such an occupant aside before it writes
    folder = ctx.path(mf.SHARED_DIR)
    if released is not None:
        listing = [e for name in wanted[:COLLECT_PER_PASS]
                   for e in ctx.io(f"list {mf.SHARED_DIR}", lambda: ctx.backend.listdir(folder, prefix=name))
                   if e.name == name]
    else:
        cap = ctx.limits.scan_entries
        listing = [e for e in ctx.io(f"list {mf.SHARED_DIR}", lambda: ctx.backend.listdir(folder, limit=cap))[:cap]
                   if mf.SHA256_HEX.match(e.name) and e.name not in referenced
                   and e.mtime is not None and now - e.mtime > grace]
    unused = sorted((e.mtime or 0.0, e.name) for e in listing if not e.is_dir and not e.is_special)
    return [name for _, name in unused[:COLLECT_PER_PASS]]


def _newest_verifies(ctx: Ctx, generations: list[GenerationInfo], contract: str | None, world: int | None) -> bool:
    """Whether the newest complete generation of this run reads back with every listed sha256.  When it does
    not, log which older one does (that one, and everything older, must then stay)."""
    ours = [g for g in generations if g.status == COMPLETE and g.manifest and _matches(g.manifest, contract, world)]
    for rank, g in enumerate(sorted(ours, key=lambda g: g.step, reverse=True)):
        problem = verify_hashes(ctx, g)
        if problem is None:
            if rank:
                log.warning("retention: %s is the newest generation that verifies; deleting nothing older than it",
                            g.name)
            return rank == 0
        log.warning("retention: %s does not verify (%s); it is not counted as a good copy", g.name, problem)
    log.warning("retention: no complete generation verifies; deleting nothing")
    return False
