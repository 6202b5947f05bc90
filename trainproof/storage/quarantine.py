"""Move a damaged or abandoned generation aside, keeping the evidence, so its step can be committed again.

Layout: ``<run>/quarantine/step-%08d-<UTC time>-<id>/`` holding the generation's objects plus a ``REASON`` file.
On a folder this is one atomic rename.  On an object store it is copy-then-delete, in an order that keeps
every intermediate state safe: copy everything, write ``REASON``, delete ``COMPLETE.json`` *first*, then the
rest — a crash half-way leaves at worst an incomplete generation (skipped) and a partial copy (harmless).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

from trainproof.storage import manifest as mf
from trainproof.storage.backend import RenamesFolders, read_at_most
from trainproof.storage.generations import Ctx
from trainproof.storage.limits import UntrustedJSONError, loads_untrusted

log = logging.getLogger("trainproof.storage")
QUARANTINE = "quarantine"


OCCUPANT = "OCCUPANT"
"""What :func:`move_aside` names the entry it moved, inside its quarantine folder."""


def quarantine(ctx: Ctx, name: str, reason: str) -> str:
    """Move generation ``name`` to the quarantine folder with a REASON file; return the new folder name. When
    ``name`` is not a folder (a file, a link, a FIFO, an object), :func:`move_aside` moves it."""
    here = [e for e in ctx.io(f"list {name}", lambda: ctx.backend.listdir(ctx.root, prefix=name)) if e.name == name]
    if any(not e.is_dir or e.is_special for e in here):
        moved = move_aside(ctx, name, reason)
        if not any(e.is_dir and not e.is_special for e in here):  # on S3 an object and a folder may share a name
            return moved
    root, dest_name, note = _destination(ctx, name, reason)
    src, dest = ctx.path(name), ctx.path(root, dest_name)
    if isinstance(ctx.backend, RenamesFolders):
        backend = ctx.backend
        ctx.io(f"move {name} to quarantine", lambda: backend.rename_dir(src, dest))
    else:
        _copy_then_delete(ctx, name, src, dest)
    ctx.io(f"write {dest_name}/REASON", lambda: ctx.backend.write(f"{dest}/REASON", note))
    log.warning("quarantined %s → %s/%s: %s", name, root, dest_name, reason)
    return dest_name


def clear_for_folder(ctx: Ctx, name: str, reason: str) -> bool:
    """Where the run keeps a folder at its entry ``name``: move aside (:func:`move_aside`) what occupies it without
    being one (a file, a link, a FIFO; on an object store an object of that name), so the folder is never written
    through. Whether something was moved."""
    listing = ctx.io(f"list {name}", lambda: ctx.backend.listdir(ctx.root, prefix=name))
    if any(e.name == name and (not e.is_dir or e.is_special) for e in listing):
        move_aside(ctx, name, reason)
        return True
    return False


def move_aside(ctx: Ctx, name: str, reason: str, *, label: str | None = None) -> str:
    """Move what occupies the run's entry ``name`` without being a folder (a file, a FIFO, a symlink; on an object
    store an object named like a folder) into a quarantine folder of its own, as ``OCCUPANT`` beside a REASON
    file, so the run can write its folder there. The entry itself moves: a symlink as the link, never followed.
    Returns the quarantine folder's name."""
    root, dest_name, note = _destination(ctx, label or name, reason)
    src, dest = ctx.path(name), ctx.path(root, dest_name, OCCUPANT)
    if isinstance(ctx.backend, RenamesFolders):
        backend = ctx.backend
        ctx.io(f"move {name} to quarantine", lambda: backend.rename_dir(src, dest))
    else:  # an object: copied, then deleted (its key only; a folder of the same name is another listing entry)
        ctx.io(f"copy {name}", lambda: ctx.backend.copy(src, dest))
        ctx.io(f"delete {name}", lambda: ctx.backend.delete(src))
    ctx.io(f"write {dest_name}/REASON", lambda: ctx.backend.write(ctx.path(root, dest_name, "REASON"), note))
    log.warning("moved %s aside → %s/%s: %s", name, root, dest_name, reason)
    return dest_name


def _destination(ctx: Ctx, name: str, reason: str) -> tuple[str, str, bytes]:
    """(quarantine root, a fresh folder name in it, the REASON file's bytes) for moving ``name`` aside."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    note = json.dumps({"generation": name, "reason": reason, "quarantined_at": stamp}, indent=2).encode() + b"\n"
    return quarantine_root(ctx), f"{name}-{stamp}-{uuid.uuid4().hex[:6]}", note


def quarantine_root(ctx: Ctx) -> str:
    """``quarantine`` when it is a real folder or absent; otherwise (a file, a symlink that would lead the moves out
    of the run, a FIFO: planted) a fresh ``quarantine-<id>`` beside it, so that nothing at that name stops a move."""
    here = [e for e in ctx.io("list quarantine", lambda: ctx.backend.listdir(ctx.root, prefix=QUARANTINE))
            if e.name == QUARANTINE]
    if all(e.is_dir and not e.is_special for e in here):
        return QUARANTINE
    fresh = f"{QUARANTINE}-{uuid.uuid4().hex[:8]}"
    log.warning("%s is occupied by something that is not a folder (a file or a link): quarantining into %s",
                QUARANTINE, fresh)
    return fresh


def _copy_then_delete(ctx: Ctx, name: str, src: str, dest: str) -> None:
    entries = [e for e in ctx.io(f"list {name}", lambda: ctx.backend.listdir(src)) if not e.is_dir]
    # The marker is copied last so the copy is never "complete" before its files are there.
    ordered = sorted(entries, key=lambda e: e.name == mf.MARKER)
    for e in ordered:
        ctx.io(f"copy {name}/{e.name}", lambda e=e: ctx.backend.copy(f"{src}/{e.name}", f"{dest}/{e.name}"))
    ctx.io(f"delete {name}/{mf.MARKER}", lambda: ctx.backend.delete(f"{src}/{mf.MARKER}"))
    ctx.io(f"delete {name}", lambda: ctx.backend.delete_tree(src))


def list_quarantined(ctx: Ctx) -> list[tuple[str, str]]:
    """(path under the run, reason) of every quarantined entry, oldest first: in ``quarantine/`` and in each fresh
    ``quarantine-<id>/`` made while ``quarantine`` itself was occupied (:func:`quarantine_root`)."""
    roots = sorted(e.name for e in ctx.io("list quarantine", lambda: ctx.backend.listdir(ctx.root, prefix=QUARANTINE))
                   if e.is_dir and not e.is_special and _FRESH_ROOT.fullmatch(e.name))
    return [item for root in roots for item in _listed(ctx, root)]


_FRESH_ROOT = re.compile(rf"{QUARANTINE}(-[0-9a-f]{{8}})?")
"""``quarantine``, or a fresh root :func:`quarantine_root` made beside it."""


def _listed(ctx: Ctx, root: str) -> list[tuple[str, str]]:
    cap = ctx.limits.scan_entries
    listing = ctx.io(f"list {root}", lambda: ctx.backend.listdir(ctx.path(root), limit=cap))
    if len(listing) > cap:
        log.warning("%s holds more than %d entries (Limits.scan_entries): listing the first %d", root, cap, cap)
    out = []
    for e in sorted(listing[:cap], key=lambda e: e.name):
        if not e.is_dir or e.is_special:
            continue
        out.append((f"{root}/{e.name}", _reason(ctx, root, e.name)))
    return out


def _reason(ctx: Ctx, root: str, folder: str) -> str:
    """The REASON file's reason, read defensively (capped, strict JSON, a string): it is printed by ``ls``."""
    cap = ctx.limits.small_json_bytes
    try:
        reason = ctx.path(root, folder, "REASON")
        raw = ctx.io(f"read {folder}/REASON", lambda: read_at_most(ctx.backend, reason, cap))
        reason = loads_untrusted(raw, what="REASON", max_bytes=cap)
    except FileNotFoundError:
        return "(no REASON file: the move was interrupted)"
    except UntrustedJSONError as exc:
        return f"(unreadable REASON file: {exc})"
    except OSError as exc:  # a symlink or a pipe in place of the file (local folders)
        return f"(unreadable REASON file: {exc.strerror or exc.__class__.__name__})"
    reason = reason.get("reason") if isinstance(reason, dict) else None
    return reason[:1000] if isinstance(reason, str) else "(REASON file without a reason)"
