"""Bounds on what the store reads from a bucket it does not control, and the defensive JSON parser.

A shared or hostile bucket can hold anything under a run's prefix: a 5 GB "manifest", JSON nested ten thousand
levels deep, a 5000-digit integer, ``NaN``, a file name of ``../../etc/passwd``, a million ``step-*`` folders.
Every one of these must end as a classification (corrupt / foreign, with a reason) or a warning, never as an
exception out of a scan, unbounded memory, or a path outside the run.  The caps live in one frozen dataclass
so a store (``StoreOptions.limits``) or a test can change them without patching module globals.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

KiB, MiB, GiB = 2**10, 2**20, 2**30

# JSON documents the store writes are a few levels deep; anything deeper is not ours.
MAX_JSON_DEPTH = 32
# An honest integer in a manifest (a size, a step, a world) has at most 20 digits; refusing longer ones before
# int() runs keeps the parser's cost linear (CPython's own limit is 4300 digits and raises a bare ValueError).
MAX_INT_DIGITS = 24
MAX_NAME_CHARS = 255


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Caps on what the store reads.  Exceeding one classifies the object (corrupt/foreign) or truncates a
    scan with a warning; it never raises out of a scan or a load."""

    manifest_bytes: int = 1 * MiB
    """Largest ``COMPLETE.json`` read; a bigger one is corrupt (real ones are a few KiB)."""
    small_json_bytes: int = 64 * KiB
    """Largest ``LATEST`` hint or quarantine ``REASON`` read."""
    file_bytes: int = 256 * GiB
    """Largest size a manifest may claim for one file; above it the generation is corrupt without reading."""
    scan_entries: int = 100_000
    """Most objects one generation folder may hold (and entries the quarantine listing shows). A scan of the run
    is not capped by count: it keeps only names of generations, and is bounded by ``scan_seconds``."""
    scan_seconds: float = 600.0
    """Longest a scan of the run's generations may take (listing and classifying): past it, the scan fails
    (``ListingIncompleteError``, exit 1: retriable) rather than decide from part of what is there."""
    files_per_generation: int = 100_000
    """Most files one manifest may list."""

    def __post_init__(self) -> None:
        for key, value in self.__dict__.items():
            if key == "scan_seconds":
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                    raise ValueError(f"Limits.scan_seconds must be a positive number, got {value!r}")
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Limits.{key} must be a positive integer, got {value!r}")


class UntrustedJSONError(ValueError):
    """A JSON document read from the store is too big, malformed, too deep, or holds a value JSON should not."""


def loads_untrusted(raw: bytes, *, what: str, max_bytes: int) -> object:
    """Parse ``raw`` (read from the store) as strict JSON, or raise UntrustedJSONError naming ``what``.

    Refuses: more than ``max_bytes``; invalid UTF-8 or JSON; nesting deeper than MAX_JSON_DEPTH (checked after
    parsing, and RecursionError during it); integers over MAX_INT_DIGITS digits; NaN, Infinity and floats that
    overflow to infinity; duplicate keys (two readers could disagree on which one counts)."""
    if len(raw) > max_bytes:
        raise UntrustedJSONError(f"{what} is larger than {max_bytes} bytes")
    try:
        text = bytes(raw).decode("utf-8")
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_no_constant,
                           object_pairs_hook=_no_duplicates)
    except UntrustedJSONError as exc:
        raise UntrustedJSONError(f"{what}: {exc}") from None
    except RecursionError:
        raise UntrustedJSONError(f"{what} is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise UntrustedJSONError(f"{what} is not valid JSON ({exc.__class__.__name__})") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise UntrustedJSONError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise UntrustedJSONError(f"an integer of {len(text)} digits")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise UntrustedJSONError(f"a non-finite number {text[:40]!r}")
    return value


def _no_constant(text: str):
    raise UntrustedJSONError(f"a non-finite number {text!r}")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise UntrustedJSONError("an object with a duplicate key")
    return out


def _depth(value: object) -> int:
    # Iterative: a recursive walk could itself hit the recursion limit on a document json accepted.
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                return depth
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def plain_name_problem(name: object) -> str | None:
    """Why ``name`` is not a plain object name inside one folder (None when it is one).

    A plain name is a non-empty string of at most MAX_NAME_CHARS characters, not ``.`` or ``..``, with no
    ``/`` or ``\\`` (so no absolute path and no way out of the folder) and no control characters."""
    if not isinstance(name, str):
        return f"{repr(name)[:60]} is not a string"  # cut: it may be a megabyte of JSON, and goes into logs
    if not name:
        return "the name is empty"
    if name in (".", ".."):
        return f"{name!r} is a relative folder reference"
    if len(name) > MAX_NAME_CHARS:
        return f"the name is longer than {MAX_NAME_CHARS} characters"
    if "/" in name or "\\" in name:
        return f"{name!r} contains a path separator"
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        return f"{name!r} contains a control character"
    return None


def safe(value: object, limit: int = 200) -> str:
    """``value`` as text fit for one log line, whatever storage put in it: every character that is not printable
    (terminal escape codes, newlines, NUL, bidirectional overrides) written as a ``\\x``/``\\u`` escape, and at most
    ``limit`` characters (then ``…``). Never raises."""
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:  # a hostile object's __str__: say what it is instead
        text = f"<{type(value).__name__}>"
    out = []
    for ch in text[: limit + 1]:
        if ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    shown = "".join(out)
    return shown[:limit] + "…" if len(text) > limit or len(shown) > limit else shown


def redact_url(url: object) -> str:
    """``url`` with any user info replaced by ``***`` (``s3://KEY:SECRET@bucket/p`` → ``s3://***@bucket/p``) and
    without its query string or fragment (``?X-Amz-Signature=…``), so a URL can go into an error message or a log
    line without leaking credentials.  Never raises.

    Also when the secret holds a ``/`` (AWS secrets often do), which ends a URL's authority early:
    ``s3://KEY:SEC/RET@bucket/p`` has the authority ``KEY:SEC``, whose colon is not a port's."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text  # a plain path: no user info
    rest = re.split(r"[?#]", rest, maxsplit=1)[0]  # a query string may hold a presigned signature or a token
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority:  # the last '@' of the authority ends the user info (RFC 3986)
        return f"{scheme}://***@{rest[len(authority.rsplit('@', 1)[0]) + 1:]}"
    if ":" in authority and not authority.rsplit(":", 1)[1].isdigit() and "@" in rest:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return f"{scheme}://{rest}"
