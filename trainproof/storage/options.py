"""Store settings: keyword-only dataclasses the CLI fills in; S3 ones default from the standard AWS variables.

S3 credentials are never held here: botocore finds them itself (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, IRSA web identity, instance metadata), so nothing secret can end up in a log or a repr.
The signing key is held here (``signing``), inside a ``Keyring`` whose repr shows key ids only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from trainproof.storage.digest import PART_ENV, parse_part_mib
from trainproof.storage.errors import StoreConfigError
from trainproof.storage.limits import Limits
from trainproof.storage.signing import Keyring
from trainproof.storage.spool import CONCURRENCY, PART_SIZE

MIN_PART_SIZE = 5 * 2**20  # S3's smallest multipart part (all but the last)

_CHECKSUM_MODES = ("auto", "when_supported", "when_required")
_CREATE_ONLY_MODES = ("require", "weak", "private")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Bounded retries around whole idempotent operations (the only retry layer: botocore and s3fs are
    set to a single attempt each, so attempts never multiply)."""

    attempts: int = 6
    """Most attempts per operation, the first included."""
    total_seconds: float = 120.0
    """Give up once this much time has passed since the first attempt."""
    initial_wait: float = 0.2
    """First back-off; it doubles each retry, with random jitter, up to ``max_wait``."""
    max_wait: float = 10.0
    """Longest single back-off."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.total_seconds <= 0 or self.initial_wait < 0 or self.max_wait < 0:
            raise ValueError("RetryPolicy times must be positive")


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """How to reach the store.  Only the S3 fields matter for ``s3://`` URLs."""

    endpoint_url: str | None = None
    """S3 endpoint (MinIO, Ceph, a proxy); None means AWS.  Default: ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``."""
    region: str | None = None
    """Default: ``AWS_REGION`` or ``AWS_DEFAULT_REGION``, else us-east-1."""
    path_style: bool | None = None
    """Path-style addressing (``endpoint/bucket/key``), which MinIO needs.  None: on when ``endpoint_url`` is set."""
    checksum: str = "auto"
    """botocore's request/response checksum mode.  ``auto``: AWS gets ``when_supported``; any custom endpoint gets
    ``when_required``, because botocore >= 1.36's default CRC checksums break MinIO, Ceph and other S3-compatibles."""
    profile: str | None = None
    """Named AWS profile; default ``AWS_PROFILE`` (handled by botocore)."""
    create_only: str = "require"
    """``require``: refuse an endpoint that ignores ``If-None-Match: *`` (probed once per store).
    ``weak``: accept it; commits then rely on check-then-write, which two concurrent writers can race.
    ``private``: a prefix no other process writes (the audit's own replay under ``verification/<id>/``): writes
    are still create-only, but nothing is probed or swept, so a read-only audit leaves no probe object and needs
    no delete permission."""
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    sweep_multipart_older_than: float | None = 3600.0
    """On open for writing, abort unfinished multipart uploads under the run prefix older than this many
    seconds (left by writers killed mid-upload; they cost storage).  None disables the sweep."""
    limits: Limits = field(default_factory=Limits)
    """Caps on what is read from the store (manifest size, claimed file size, entries per scan)."""
    signing: Keyring | None = None
    """Signing and accepted keys (``trainproof.storage.signing``); None: generations are neither signed nor checked.
    Default from ``TRAINPROOF_SIGNING_KEY*``; its repr shows key ids only."""
    part_size: int = PART_SIZE
    """Bytes per multipart part and per ranged read of large objects (spools). Default 8 MiB, or
    ``TRAINPROOF_PART_SIZE_MB``; at least 5 MiB (S3's minimum part)."""
    concurrency: int = CONCURRENCY
    """Parts in flight at once per transfer (upload, read-back verify, download). Default 8, or
    ``TRAINPROOF_IO_CONCURRENCY``. Memory of a transfer is about ``part_size × (concurrency + 1)`` (a download's one
    part more: the queue of its one writer, trainproof.storage.spool)."""

    def __post_init__(self) -> None:
        if self.part_size < MIN_PART_SIZE:
            raise ValueError(f"part size must be at least {MIN_PART_SIZE // 2**20} MiB (S3's smallest multipart "
                             f"part), got {self.part_size} bytes; set TRAINPROOF_PART_SIZE_MB to 5 or more")
        if not 1 <= self.concurrency <= 64:
            raise ValueError(f"I/O concurrency must be 1..64, got {self.concurrency}; set TRAINPROOF_IO_CONCURRENCY")
        if self.checksum not in _CHECKSUM_MODES:
            raise ValueError(f"checksum must be one of {_CHECKSUM_MODES}, got {self.checksum!r}")
        if self.create_only not in _CREATE_ONLY_MODES:
            raise ValueError(f"create_only must be one of {_CREATE_ONLY_MODES}, got {self.create_only!r}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> "StoreOptions":
        """Options from the standard AWS variables (and ``TRAINPROOF_*``), then ``overrides`` (None values
        ignored). Every setting is read here, once: a bad value is a StoreConfigError naming the variable."""
        env = os.environ if env is None else env
        try:
            base = cls(
                endpoint_url=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None,
                region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
                profile=env.get("AWS_PROFILE") or None,
                checksum=env.get("TRAINPROOF_S3_CHECKSUM", "auto"),
                create_only=env.get("TRAINPROOF_S3_CREATE_ONLY", "require"),
                signing=Keyring.from_env(env),
                part_size=_env_int(env, "TRAINPROOF_PART_SIZE_MB", PART_SIZE // 2**20) * 2**20,
                concurrency=_env_int(env, "TRAINPROOF_IO_CONCURRENCY", CONCURRENCY),
            )
            # The digest part size (trainproof.storage.digest): refused here, at the edge.
            parse_part_mib(env.get(PART_ENV))
            return replace(base, **{k: v for k, v in overrides.items() if v is not None})
        except ValueError as exc:  # a bad environment variable: exit 2 with its message, not a traceback
            raise StoreConfigError(str(exc)) from None

    def checksum_mode(self) -> str:
        """The botocore setting to use for this endpoint."""
        if self.checksum != "auto":
            return self.checksum
        return "when_supported" if self.endpoint_url is None else "when_required"

    def use_path_style(self) -> bool:
        return self.endpoint_url is not None if self.path_style is None else self.path_style


def _env_int(env, name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {raw!r}") from None
