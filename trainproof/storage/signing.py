"""Authenticated generations: HMAC-SHA256 signatures and a chain of manifests (optional, off without a key).

Without a key nothing here runs and nothing is authenticated: manifests are written and read exactly as before.

**Keys** (read once, by ``StoreOptions.from_env``):

- ``TRAINPROOF_SIGNING_KEY``: the key that signs (and verifies);
- ``TRAINPROOF_SIGNING_KEY_FILE``: a file holding it (a mounted Kubernetes Secret; one trailing newline is
  stripped).  The manifests mount that Secret as *optional*, so a variable naming a file that does not exist
  means "no key", with one warning line (make the mount non-optional to fail instead);
- ``TRAINPROOF_SIGNING_KEYS_ACCEPTED`` / ``TRAINPROOF_SIGNING_KEYS_ACCEPTED_FILE``: further keys accepted when
  verifying (comma- or newline-separated), for rotation: sign with the new key, accept the old one until its
  generations are gone, then drop it (its generations then become foreign).

A key is identified by its ``key_id``, the first 16 hex digits of sha256(key): recorded beside each MAC so a
verifier picks the right key, and safe to print.  The key itself is held by :class:`Keyring`, whose ``repr``
hides it, and it is never logged, written or put into an exception message.

**What is signed.**  ``signature = {"alg": "hmac-sha256", "key_id": ..., "mac": hex}`` is added to every
``COMPLETE.json`` (generations and export bundles, committed by the same ``trainproof.storage.commit``) and to the run's
``plan.json`` (``trainproof.format.contract``).  The MAC covers the *canonical content*: the JSON object without its
``signature`` field, sorted keys, no whitespace, ASCII.  A manifest's step, contract, world, every file's size
and sha256, its anchor and its predecessor are all inside it.

**The chain.**  A signed generation's manifest also holds

- ``anchor``: sha256 of the bytes of the ``plan.json`` at the store's root (null where there is none, e.g. the
  export folder).  plan.json is create-only, signed and, when signing, holds a random ``run_id``, so the anchor
  names one run: a signed generation of *another* run (same key, even the same settings) has another anchor;
- ``predecessor`` and ``predecessor_step``: sha256 of the ``COMPLETE.json`` bytes of the newest in-chain
  generation below it at commit time, and its step (both null for the first one).

Chain rule, applied by discovery to the generations whose signature is valid and whose anchor is this run's
(whatever their contract, world or file status), in ascending step order:

1. predecessor null: in chain when no generation below it is (the start of the run), else a second start;
2. predecessor present (a signed generation of this run with that digest): in chain when that one is in chain,
   sits at ``predecessor_step``, and no generation in chain lies between the two (else: a fork, or the
   continuation of an abandoned branch);
3. predecessor absent (deleted by retention, quarantined): in chain when no generation in chain lies at or
   above ``predecessor_step`` and below it.  So retention (which deletes the oldest) and world changes (whose
   retention deletes only the current world's) never break the chain, while a branch from a deleted step is
   still a fork once anything in chain continued that step.  (Once the branch point *and* its continuation
   are deleted, that knowledge is gone: of two branches the lower one is then taken.  Only a key holder, or
   a genuine abandoned branch of this run, can provide a branch; see SECURITY.md.)

A folder without a ``plan.json`` (the export bundles, ``<run>/exports`` or ``--dest``) has no chain: bundles
may be committed in any step order, so they carry a null anchor and predecessor and are checked by signature
alone (an export's signed manifest names its source state, which ``export`` compares before reusing one).

A rejected generation is *foreign*: skipped with one warning line, never resumed from, never deleted.
The digests are over whole manifests, and a manifest's step is signed, so renaming a folder breaks the
folder/step check and copying bytes never changes a digest.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
from typing import Iterable, Mapping

from trainproof.storage.errors import StoreConfigError

log = logging.getLogger("trainproof.storage")

ALG = "hmac-sha256"
SIGNATURE = "signature"
ENV_KEY, ENV_KEY_FILE = "TRAINPROOF_SIGNING_KEY", "TRAINPROOF_SIGNING_KEY_FILE"
ENV_ACCEPTED, ENV_ACCEPTED_FILE = "TRAINPROOF_SIGNING_KEYS_ACCEPTED", "TRAINPROOF_SIGNING_KEYS_ACCEPTED_FILE"
_HEX = re.compile(r"^[0-9a-f]+\Z")
_MAX_KEY_FILE = 64 * 1024  # a key file is a few bytes; never read a huge one whole


class SigningConfigError(StoreConfigError):
    """The signing configuration is unusable (an empty key, an unreadable key file): exit 2, like any store
    configuration error.  Its message names the variable and the file, never the key."""


def key_id(key: bytes) -> str:
    """First 16 hex digits of sha256(key): names a key without revealing it."""
    return hashlib.sha256(key).hexdigest()[:16]


def canonical(document: Mapping) -> bytes:
    """The signed bytes: ``document`` without its signature, sorted keys, no whitespace, ASCII."""
    body = {k: v for k, v in document.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def digest(raw: bytes) -> str:
    """sha256 hex of stored bytes (a manifest's digest in the chain, a plan's anchor)."""
    return hashlib.sha256(raw).hexdigest()


class Keyring:
    """The signing key and the keys accepted for verification.  Its ``repr`` shows key ids only."""

    __slots__ = ("_signing", "_accepted")

    def __init__(self, signing: bytes, accepted: Iterable[bytes] = ()) -> None:
        if not signing:
            raise SigningConfigError(f"{ENV_KEY} is empty")
        self._signing = signing
        # The signing key always verifies; accepted ones only verify (rotation).
        self._accepted = {key_id(k): k for k in (signing, *accepted) if k}

    def __repr__(self) -> str:
        return f"Keyring(signing={self.key_id!r}, accepted={sorted(self._accepted)!r})"

    __str__ = __repr__

    @property
    def key_id(self) -> str:
        """The signing key's id."""
        return key_id(self._signing)

    def sign(self, document: Mapping) -> dict:
        """``document`` with a ``signature`` over its canonical content (an old signature is replaced)."""
        mac = hmac.new(self._signing, canonical(document), hashlib.sha256).hexdigest()
        return {**{k: v for k, v in document.items() if k != SIGNATURE},
                SIGNATURE: {"alg": ALG, "key_id": self.key_id, "mac": mac}}

    def problem(self, document: Mapping) -> str | None:
        """Why ``document``'s signature is not acceptable (None when it is): absent, malformed, by a key not
        accepted, or a MAC that does not match its content.  Never raises on hostile input."""
        sig = document.get(SIGNATURE)
        if sig is None:
            return "unsigned (a signing key is configured)"
        if not isinstance(sig, dict) or sig.get("alg") != ALG or not isinstance(sig.get("key_id"), str) \
                or not isinstance(sig.get("mac"), str) or not _HEX.match(sig["mac"]):
            return "malformed signature"
        key = self._accepted.get(sig["key_id"])
        if key is None:
            return f"signed with a key that is not accepted (key id {sig['key_id'][:16]!r})"
        try:
            expected = hmac.new(key, canonical(document), hashlib.sha256).hexdigest()
        except (TypeError, ValueError):  # a value json cannot write canonically (NaN was refused earlier)
            return "content cannot be canonicalised"
        if not hmac.compare_digest(expected, sig["mac"]):
            return f"wrong signature (key id {sig['key_id'][:16]}): changed after signing, or forged"
        return None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Keyring | None":
        """The keys the environment configures (see the module docstring), or None without a signing key."""
        env = os.environ if env is None else env
        signing = _value(env, ENV_KEY, ENV_KEY_FILE)
        if not signing:
            return None
        accepted_text = _value(env, ENV_ACCEPTED, ENV_ACCEPTED_FILE) or ""
        accepted = [k.strip().encode() for k in re.split(r"[,\n]", accepted_text) if k.strip()]
        return cls(signing.encode(), accepted)


def _value(env: Mapping[str, str], name: str, file_name: str) -> str | None:
    value = env.get(name)
    if value:
        return value
    path = env.get(file_name)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_KEY_FILE + 1)
    except FileNotFoundError:
        # A Secret mounted as optional (an overlay finishing an unsigned run): no file means no key.
        log.warning("%s names %s, which does not exist: running without it (unsigned); make the Secret's mount "
                    "non-optional to refuse instead", file_name, path)
        return None
    except OSError as exc:
        raise SigningConfigError(f"{file_name}: cannot read {path}: {exc.strerror or exc.__class__.__name__}") from None
    if len(raw) > _MAX_KEY_FILE:
        raise SigningConfigError(f"{file_name}: {path} is larger than {_MAX_KEY_FILE} bytes; not a key file")
    try:
        text = raw.decode("utf-8", "strict")
    except UnicodeDecodeError:  # never echo the bytes: they are (part of) a key
        raise SigningConfigError(f"{file_name}: {path} is not UTF-8 text") from None
    text = text[:-1] if text.endswith("\n") else text  # one trailing newline (echo, kubectl --from-file)
    text = text[:-1] if text.endswith("\r") else text
    if not text:
        raise SigningConfigError(f"{file_name}: {path} is empty")
    return text


def chain(members: list[tuple[int, str, dict]]) -> dict[int, str | None]:
    """Apply the chain rule to ``members``: (step, manifest digest, manifest) of every generation whose
    signature and anchor are valid.  Returns step → None when in chain, else the reason it is not."""
    present = {d: step for step, d, _ in members}
    out: dict[int, str | None] = {}
    accepted: list[int] = []
    for step, _d, manifest in sorted(members, key=lambda m: m[0]):
        pred, pred_step = manifest.get("predecessor"), manifest.get("predecessor_step")
        if pred is None:
            problem = None if not accepted else "out of chain: a second first generation (null predecessor)"
        elif not isinstance(pred, str) or not isinstance(pred_step, int) or isinstance(pred_step, bool) \
                or not 0 <= pred_step < step:
            problem = "out of chain: malformed predecessor"
        elif pred in present and (present[pred] != pred_step or out.get(pred_step, "") is not None):
            problem = f"out of chain: continues step-{pred_step:08d}, which is not in chain"
        else:
            # Present (and in chain) or deleted: no generation in chain may lie between it and this one, else
            # this one continues a branch that another already continued (a fork, or an abandoned branch).
            first = pred_step + 1 if pred in present else pred_step
            between = [s for s in accepted if first <= s < step]
            problem = None if not between else (
                f"out of chain: continues step-{pred_step:08d}, but step-{between[-1]:08d} already continued it "
                "(a fork, or an abandoned branch)")
        out[step] = problem
        if problem is None:
            accepted.append(step)
    return out
