"""The code identity recorded in every state and generation: the version plus a digest of the installed code.

``trainproof 0.1.0`` alone says nothing about what ran: two checkouts with other resume code both call
themselves 0.1.0. The identity is ``trainproof <version>+<12 hex>``, the hex being the first 12 digits of a
sha256 over the sorted ``trainproof/`` Python sources (relative path, then content, for each
file), so any edit of the trainer or the store changes it, and nothing outside them (tests, docs, a
user's task module) does.

Why it is not part of the run contract: plan.json records it, but the contract hash and the plan
comparison (trainproof.format.contract) leave it out, so a code upgrade never makes an existing run "foreign".
A resume under another identity is decided explicitly instead (trainproof.train.resume.code_decision): refused
(exit 2) unless ``--allow-code-change``, which is recorded in ``meta.code_changes``.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import trainproof

ROOT = Path(trainproof.__file__).resolve().parent.parent
PACKAGES = ("trainproof",)


def source_digest(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> str:
    """sha256 hex over every ``*.py`` file under ``root/<package>`` (sorted by relative path)."""
    h = hashlib.sha256()
    files = sorted(p for pkg in packages for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts)
    for path in files:
        rel = path.relative_to(root).as_posix().encode()
        data = path.read_bytes()
        # Length-prefixed: no two different file sets can produce the same byte stream.
        h.update(len(rel).to_bytes(8, "big") + rel + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


@functools.cache
def code_version() -> str:
    """``trainproof <version>+<12 hex of the source digest>`` (computed once per process)."""
    return f"trainproof {trainproof.__version__}+{source_digest()[:12]}"
