"""One retry layer: tenacity around whole idempotent operations, on transient faults only.

botocore is configured with a single attempt and s3fs with ``retries=1`` (see ``backends.s3``), so an
operation is tried at most ``RetryPolicy.attempts`` times in all, never attempts × 5 × 3.
"""

from __future__ import annotations

import errno
import logging
import threading
from typing import Callable, TypeVar

import tenacity

from trainproof.storage.errors import StoreError, StoreUnavailableError
from trainproof.storage.options import RetryPolicy

log = logging.getLogger("trainproof.storage")
T = TypeVar("T")

# S3 error codes that mean "try again later" (throttling, server-side hiccups, a concurrent conditional
# write: 409 ConditionalRequestConflict means "start the create over").
_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "InternalError", "ServiceUnavailable", "RequestTimeout", "RequestTimeTooSkewed",
    "ConditionalRequestConflict", "OperationAborted",
}
_TRANSIENT_STATUS = {409, 429, 500, 502, 503, 504}
# Never retried, whatever the chain says: a missing object/bucket, a refusal, a lost create-only race.
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
_TRANSIENT_ERRNOS = {errno.EBUSY, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE, errno.EAGAIN}


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _client_error_transient(exc: BaseException) -> bool | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or "Error" not in response:
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in _TRANSIENT_CODES:
        return True
    if code == "PreconditionFailed" or status == 412:
        return False
    return status in _TRANSIENT_STATUS


def _connection_fault(exc: BaseException) -> bool:
    """Connection resets, timeouts and cut bodies, however the client library spells them."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if module.startswith(("botocore", "aiohttp", "urllib3")) and any(
        word in name
        for word in ("Connection", "Timeout", "IncompleteRead", "ResponseParser", "Disconnected", "Payload")
    ):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def is_transient(exc: BaseException) -> bool:
    """True when retrying ``exc`` can help: HTTP 5xx/429/409, S3 throttling codes, connection resets and
    timeouts.  False for 403/404, missing buckets, bad credentials, 412 (a lost create-only race) and
    anything unknown."""
    if isinstance(exc, _PERMANENT) or isinstance(exc, StoreError):  # StoreError: an inner layer already retried
        return False
    for link in _chain(exc):
        verdict = _client_error_transient(link)
        if verdict is not None:
            return verdict
        if _connection_fault(link):
            return True
    return False


class RetryStats:
    """Thread-safe count of retries, so tests and benchmarks can report them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.retries = 0

    def add(self) -> None:
        with self._lock:
            self.retries += 1


def call_with_retry(policy: RetryPolicy, what: str, fn: Callable[[], T], stats: RetryStats | None = None) -> T:
    """Run ``fn`` (a whole idempotent operation) with bounded, logged retries on transient faults.

    Raises the last exception unchanged when attempts or time run out, or at once when it is not transient.
    """

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if stats is not None:
            stats.add()
        exc = state.outcome.exception() if state.outcome else None
        log.warning(
            "retrying %s after transient error (attempt %d/%d, waiting %.1fs): %s",
            what, state.attempt_number, policy.attempts, state.upcoming_sleep, _one_line(exc),
        )

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(policy.attempts) | tenacity.stop_after_delay(policy.total_seconds),
        # exponential back-off plus random jitter, so ranks throttled together don't retry in lockstep
        wait=tenacity.wait_exponential(multiplier=policy.initial_wait, max=policy.max_wait)
        + tenacity.wait_random(0, max(policy.initial_wait, 0.05)),
        retry=tenacity.retry_if_exception(is_transient),
        reraise=True,
        before_sleep=before_sleep,
    )
    return retrying(fn)


def retry_or_unavailable(policy: RetryPolicy, what: str, fn: Callable[[], T], stats: RetryStats | None = None,
                         *, where: str = "") -> T:
    """``call_with_retry``, turning a transient fault that outlasted the budget into StoreUnavailableError
    (a StoreError, which no outer layer retries again: attempts never multiply)."""
    try:
        return call_with_retry(policy, what, fn, stats)
    except Exception as exc:
        if is_transient(exc):
            raise StoreUnavailableError(f"{what}{where} kept failing after retries: {exc}") from exc
        raise


def _one_line(exc: BaseException | None) -> str:
    if exc is None:
        return "?"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:300]}"
