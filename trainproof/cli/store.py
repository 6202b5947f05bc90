"""``trainproof ls`` and ``trainproof gc``: look at and prune a run's generations; ``trainproof store create``: make
the bucket or folder a run will use and check it."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trainproof.cli.app import app
from trainproof.cli.common import (
    EndpointArg,
    PathStyleArg,
    RegionArg,
    StoreArg,
    UsageError,
    handled,
    open_run,
    setup_logging,
)
from trainproof.storage import COMPLETE, CORRUPT, KeepEvery, RetentionPolicy, StoreOptions, create_store

_STYLE = {"complete": "green", "incomplete": "yellow", "corrupt": "red", "foreign": "magenta"}


def shown(text: object) -> str:
    """Text read from the store, safe for the terminal: control characters replaced, rich markup escaped.

    A folder name, a REASON file or LATEST can hold anything a writer of the bucket put there: ``[/x]`` would
    crash rich's markup parser, and escape sequences would reach the terminal."""
    plain = "".join(c if c.isprintable() else "?" for c in str(text))
    return escape(plain)


def _verified(run: Any, g: Any) -> Any:
    """``g``, marked corrupt (with the reason) when a complete generation's bytes do not match its manifest."""
    if g.status != COMPLETE:
        return g
    problem = run.verify(g.step)
    return g if problem is None else replace(g, status=CORRUPT, reason=problem)


def _age(mtime: float | None) -> str:
    if mtime is None:
        return "?"
    s = max(0, time.time() - mtime)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f}{unit}"
    return f"{s:.0f}s"


@app.command("ls")
@handled
def ls_command(
    store: StoreArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="Re-read every complete generation and check each "
                                                          "file's sha256 (slow on big states).")] = False,
    endpoint_url: EndpointArg = None, region: RegionArg = None, path_style: PathStyleArg = None,
) -> None:
    """List a run's generations with their status (complete / incomplete / corrupt / foreign).

    Also shows the LATEST hint (a hint only) and quarantined generations with their reason. Read-only: writes
    nothing. Without --verify a generation is "complete" when its COMPLETE.json checks out (names, sizes);
    --verify also hashes every file, so damaged bytes show as corrupt.
    """
    setup_logging()
    run = open_run(store, endpoint_url, region, path_style)
    gens = run.scan()
    if verify:
        gens = [_verified(run, g) for g in gens]
    quarantined = run.quarantined()
    hint = run.latest_hint()
    newest = max((g.step for g in gens if g.status == COMPLETE), default=None)
    kept_for_audit = _kept_for_audit(run, gens)
    rule = recorded_keep_every(gens)
    permanent = rule.permanent([g for g in gens if g.status == COMPLETE]) if rule else set()
    exports = [g for g in run.child("exports").scan() if g.status == COMPLETE]
    from trainproof.proof.evidence import list_verifications

    verifications = list_verifications(run)
    if as_json:
        doc = {
            "store": run.url, "latest_hint": hint, "newest_complete_step": newest,
            "keep_every": str(rule) if rule else None,
            "generations": [{"name": g.name, "step": g.step, "status": g.status, "reason": g.reason,
                             "bytes": g.bytes, "mtime": g.mtime,
                             "world": (g.manifest or {}).get("world"),
                             "created_at": (g.manifest or {}).get("created_at"),
                             "kept_for_audit": g.step in kept_for_audit, "permanent": g.step in permanent}
                            for g in gens],
            "quarantined": [{"name": n, "reason": r} for n, r in quarantined],
            "exports": [{"name": g.name, "step": g.step, "bytes": g.bytes} for g in exports],
            "verifications": [{"id": v.vid, "created_at": v.created_at, "verdict": v.verdict} for v in verifications],
        }
        print(json.dumps(doc, indent=2))
        return
    table = Table(title=f"{shown(run.url)}  (LATEST hint: {shown(hint or 'none')})")
    names = [g.name for g in gens] + [n for n, _ in quarantined]
    # Names are shown whole (they are what a person types next); the note column folds instead.
    table.add_column("generation", no_wrap=True, min_width=max(map(len, names), default=10))
    for col in ("status", "bytes", "age"):
        table.add_column(col, no_wrap=True)
    table.add_column("note", overflow="fold")
    for g in gens:
        note = g.reason or ("newest complete" if g.step == newest else
                            _AUDIT_NOTE if g.step in kept_for_audit else "")
        if g.step in permanent and not g.reason:
            note = ", ".join(filter(None, (note, f"permanent (--keep-every {rule})")))
        table.add_row(shown(g.name), f"[{_STYLE[g.status]}]{g.status}[/]", f"{g.bytes:,}", _age(g.mtime), shown(note))
    for name, reason in quarantined:
        table.add_row(shown(name), "[red]quarantined[/]", "", "", shown(reason))
    console = Console()
    console.print(table if gens or quarantined else f"{shown(run.url)}: no generations yet")
    if exports:
        console.print("exports: " + ", ".join(f"{shown(g.name)} ({g.bytes:,} bytes)" for g in exports))
    if verifications:
        unreported = "no report (running or abandoned)"
        console.print("verifications: " + ", ".join(f"{shown(v.vid)} {shown(v.verdict or unreported)}"
                                                    for v in verifications))


_AUDIT_NOTE = "kept beyond --keep: a restore point (or the one before it) no audit has passed"


def recorded_keep_every(gens: list) -> KeepEvery | None:
    """The ``--keep-every`` rule the run's newest complete generation was written under (its manifest's
    ``extra.keep_every``); None without one, or one that does not parse (a rule only ever keeps more)."""
    complete = [g for g in gens if g.status == COMPLETE and isinstance(g.manifest, dict)]
    extra = max(complete, key=lambda g: g.step).manifest.get("extra") if complete else None
    value = extra.get("keep_every") if isinstance(extra, dict) else None
    try:
        return KeepEvery.parse(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _kept_for_audit(run: Any, gens: list) -> frozenset[int]:
    """The generations retention keeps beyond --keep for an audit (trainproof.format.protect): the restore points the
    complete generations record and the one before each, until a passed audit spans them."""
    from trainproof.format.protect import read_audited, recorded_restore, steps_to_keep, within_run

    complete = [g for g in gens if g.status == COMPLETE]
    points = [p for g in complete if (p := recorded_restore(g.manifest)) is not None]
    if not points:
        return frozenset()
    return steps_to_keep([g.step for g in complete], points, within_run(read_audited(run), complete[-1].step))


def _run_contract(run: Any) -> str | None:
    """The run's contract from its plan.json; None for a store without one (retention then deletes nothing
    when it finds generations of more than one contract)."""
    from trainproof.format.contract import PLAN_FILE, read_plan

    try:
        return read_plan(run)["contract"]
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a malformed plan: nothing is safe to collect
        raise UsageError(f"gc needs a readable {PLAN_FILE} to tell this run's generations from others: {exc}") from None


@app.command("gc")
@handled
def gc_command(
    store: StoreArg,
    keep: Annotated[Optional[int], typer.Option(
        "--keep", min=1, help="Complete generations to keep (the newest is always kept).")] = None,
    keep_verifications: Annotated[Optional[int], typer.Option(
        "--keep-verifications", min=0, help="Keep the N newest verifications (<run>/verification/<id>/ with a "
        "report) and remove older ones entirely; one without a report (running) is never removed.")] = None,
    abandoned_hours: Annotated[Optional[float], typer.Option(
        "--abandoned-hours", min=0.0, help="Remove verifications without a report (abandoned: stopped, killed) "
        "that nothing was written to for H hours; a running one writes all along.")] = None,
    keep_every: Annotated[Optional[str], typer.Option(
        "--keep-every", help="Also keep a sparse permanent series: N (steps) or a duration (6h), as `train "
        "--keep-every`; default: the rule the run's newest generation was written under; off: none.")] = None,
    grace_hours: Annotated[float, typer.Option("--grace-hours", min=0.0,
                                               help="Collect partial generations, and objects under "
                                                    "shared/ that no generation references, only once "
                                                    "this old (never younger than 60 s: a "
                                                    "writer may still be committing).")] = 6.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be deleted; delete nothing.")] = False,
    endpoint_url: EndpointArg = None, region: RegionArg = None, path_style: PathStyleArg = None,
) -> None:
    """Apply retention: keep the K newest complete generations (never the newest complete one, nor newer), and/or
    the N newest verifications.

    Partial generations older than the grace period are collected, and so are objects under shared/ (a frozen
    base stored once) that no generation left references; exports, quarantine and other runs'
    generations are never touched; --keep-verifications and --abandoned-hours touch only <run>/verification/.
    Exit 0 done, 2 bad usage or nothing complete to keep, 1 a store failure.
    """
    setup_logging()
    if keep is None and keep_verifications is None and abandoned_hours is None:
        raise UsageError("nothing to do: pass --keep K (generations), --keep-verifications N and/or "
                         "--abandoned-hours H")
    run = open_run(store, endpoint_url, region, path_style)
    contract = _run_contract(run) if keep is not None else None
    delete_verb, keep_verb = ("would delete", "would keep") if dry_run else ("deleted", "kept")
    if keep is not None:
        if not any(g.status == COMPLETE for g in run.scan(contract=contract)):
            raise UsageError(f"{shown(run.url)} has no complete generation "
                             "of this run: nothing can be collected safely")
        # Only this run's generations (its plan.json's contract) count as "newest" or "old": a stranger's folder
        # never pushes ours out. Retention re-verifies the newest kept generation before deleting anything. As in
        # the trainer, the generations around every restore point no audit has passed across are kept too.
        from trainproof.format.protect import restore_protection

        rule, audit_kept = restore_protection(run, None, keep), set()

        def protect(gens: list) -> frozenset[int]:
            steps = rule(gens)
            audit_kept.update(steps - {g.step for g in gens[-keep:]})
            return steps

        every = _gc_keep_every(run, keep_every, contract)
        policy = RetentionPolicy(keep=keep, grace_seconds=grace_hours * 3600, contract=contract, protect_rule=protect,
                                 shared="all",
                                 keep_every=every)
        shared: list[str] = []
        doomed = run.apply_retention(policy, dry_run=dry_run, on_shared=shared.append)
        for g in doomed:
            print(f"{delete_verb} {shown(g.name)} ({g.status})")
        for name in shared:
            print(f"{delete_verb} shared/{shown(name)} (no generation references it)")
        named = ", ".join(f"step-{s:08d}" for s in sorted(audit_kept))
        also = f" and {len(audit_kept)} around restore points no audit has passed ({named})" if audit_kept else ""
        also += f" and the permanent series (--keep-every {every})" if every else ""
        objects = f" and {len(shared)} shared object(s) no generation references" if shared else ""
        print(f"{delete_verb} {len(doomed)} generation(s){objects}; {keep_verb} the {keep} newest complete{also}")
    if keep_verifications is not None or abandoned_hours is not None:
        _gc_verifications(run, keep_verifications, abandoned_hours, dry_run=dry_run)


def _gc_keep_every(run: Any, given: str | None, contract: str | None) -> KeepEvery | None:
    """gc's permanent series: ``--keep-every`` as given (``off``: none), else the run's recorded rule."""
    if given is None:
        return recorded_keep_every(run.scan(contract=contract))
    if given.strip().lower() == "off":
        return None
    try:
        return KeepEvery.parse(given)
    except ValueError as exc:
        raise UsageError(f"--keep-every: {exc}, or off") from None


def _gc_verifications(run, keep: int | None, abandoned_hours: float | None, *, dry_run: bool) -> None:
    from trainproof.proof.evidence import plan_verification_gc, remove_verification

    after = None if abandoned_hours is None else abandoned_hours * 3600
    kept, doomed = plan_verification_gc(run, keep, abandoned_after_s=after)
    remove_verb, keep_verb = ("would remove", "would keep") if dry_run else ("removed", "kept")
    for v in doomed:
        if not dry_run:
            remove_verification(run, v.vid)
        print(f"{remove_verb} verification/{v.vid} ({v.created_at})")
    running = sum(1 for v in kept if not v.created_at)
    print(f"{remove_verb} {len(doomed)} verification(s); {keep_verb} {len(kept) - running} with a report"
          + (f" and {running} without one (running or abandoned)" if running else ""))


store_app = typer.Typer(help="Set up where runs are stored.", no_args_is_help=True)
app.add_typer(store_app, name="store")


@store_app.command("create")
@handled
def store_create_command(
    url: Annotated[str, typer.Argument(help="s3://bucket/prefix (the bucket is made if missing) or a folder.")],
    endpoint_url: EndpointArg = None, region: RegionArg = None, path_style: PathStyleArg = None,
) -> None:
    """Make the bucket (or folder) URL names if it does not exist, then check it as a run will use it: it can be
    listed and written (S3: a create-only write is probed, as before a run's first commit). Safe to repeat.

    Exit 0 ready, 2 what cannot work as given (a bad name, a bucket of another account, refused credentials),
    1 a storage failure.
    """
    setup_logging()
    options = StoreOptions.from_env(endpoint_url=endpoint_url, region=region, path_style=path_style)
    store, made = create_store(url, options)
    where = shown(store.url)
    kind = "bucket" if store.shared else "folder"
    print(f"{where}: {'created the ' + kind if made else 'the ' + kind + ' exists'}; listing and writing checked: "
          f"ready for --store {where}")

