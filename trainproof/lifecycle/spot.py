"""Spot interruption notices: poll the cloud's instance metadata and ask the loop to stop before the reclaim.

A notice goes through the same path as SIGTERM (a flag the loop reads at the next step boundary: finish the
step, commit, exit 75), so the emergency checkpoint starts up to two minutes (AWS) or 30 seconds (GCP, Azure)
before the machine disappears, instead of at the very end of the grace period.

- aws: ``/latest/meta-data/spot/instance-action`` (IMDSv2 token, v1 fallback); a notice is a 200 with JSON
  ``{"action": ..., "time": ...}``, a 404 means none;
- gcp: ``/computeMetadata/v1/instance/preempted`` (``Metadata-Flavor: Google``); a notice is the body ``TRUE``;
- azure: ``/metadata/scheduledevents?api-version=2020-07-01`` (``Metadata: true``); a notice is an event with
  ``EventType`` ``Preempt``.

The base URL is configurable (``--spot-endpoint``), which is how the tests serve a notice on loopback.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

from trainproof.train.config import setting

log = logging.getLogger("trainproof.spot")
PROVIDERS = ("none", "aws", "gcp", "azure")
_DEFAULT_BASE = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal",
                 "azure": "http://169.254.169.254"}


@dataclass(frozen=True, kw_only=True)
class SpotConfig:
    """Which metadata service to watch."""

    provider: str = setting("none", f"Watch spot interruption notices: {'|'.join(PROVIDERS)}; a notice stops like "
                            "SIGTERM (commit, exit 75).", flag="spot_notice")
    endpoint: str | None = setting(None, "Metadata service base URL (default: the provider's link-local address).",
                                   flag="spot_endpoint")
    interval_s: float = setting(5.0, "Seconds between metadata polls.", flag="spot_interval")
    """AWS gives two minutes' notice; GCP and Azure about 30 s."""
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise ValueError(f"--spot-notice must be one of {', '.join(PROVIDERS)}, got {self.provider!r}")
        if self.interval_s <= 0:
            raise ValueError("the spot poll interval must be positive")

    @property
    def base(self) -> str:
        return (self.endpoint or _DEFAULT_BASE.get(self.provider, "")).rstrip("/")


def _get(url: str, headers: dict, timeout: float, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - metadata URL from config
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def check_aws(cfg: SpotConfig) -> str | None:
    """The AWS instance-action notice, or None."""
    headers = {}
    try:  # IMDSv2 when available; IMDSv1 otherwise
        status, token = _get(f"{cfg.base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"},
                             cfg.timeout_s, method="PUT")
        if status == 200 and token:
            headers["X-aws-ec2-metadata-token"] = token.decode()
    except OSError:
        pass
    status, body = _get(f"{cfg.base}/latest/meta-data/spot/instance-action", headers, cfg.timeout_s)
    if status != 200:
        return None
    try:
        doc = json.loads(body)
        return f"AWS spot {doc.get('action', 'interruption')} at {doc.get('time', '?')}"
    except ValueError:
        return "AWS spot interruption notice"


def check_gcp(cfg: SpotConfig) -> str | None:
    """GCP's preempted flag, or None."""
    status, body = _get(f"{cfg.base}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"},
                        cfg.timeout_s)
    return "GCP preemption notice" if status == 200 and body.strip().upper() == b"TRUE" else None


def check_azure(cfg: SpotConfig) -> str | None:
    """An Azure scheduled Preempt event, or None."""
    status, body = _get(f"{cfg.base}/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"},
                        cfg.timeout_s)
    if status != 200:
        return None
    try:
        events = json.loads(body).get("Events", [])
    except (ValueError, AttributeError):
        return None
    for ev in events:
        if ev.get("EventType") == "Preempt":
            return f"Azure Preempt event {ev.get('EventId', '?')} not before {ev.get('NotBefore', '?')}"
    return None


_CHECKS = {"aws": check_aws, "gcp": check_gcp, "azure": check_azure}


class SpotWatcher:
    """A daemon thread that polls the metadata service and calls ``on_notice(reason)`` once.

    Poll failures (the service briefly unreachable) are logged at debug level and polling goes on: a missing
    notice must never stop training, and a notice must never be missed because of one failed poll.
    """

    def __init__(self, cfg: SpotConfig, on_notice: Callable[[str], None]) -> None:
        self.cfg, self.on_notice = cfg, on_notice
        self.notice: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "SpotWatcher":
        if self.cfg.provider != "none":
            self._thread = threading.Thread(target=self._run, name="spot-watcher", daemon=True)
            self._thread.start()
            log.info("watching %s spot interruption notices at %s every %.0fs", self.cfg.provider, self.cfg.base,
                     self.cfg.interval_s)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.timeout_s * 3 + 1)

    def __enter__(self) -> "SpotWatcher":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        check = _CHECKS[self.cfg.provider]
        while not self._stop.is_set():
            try:
                reason = check(self.cfg)
            except OSError as exc:
                log.debug("spot metadata poll failed: %s", exc)
                reason = None
            if reason:
                self.notice = reason
                log.warning("spot interruption notice: %s; checkpointing at the next step boundary", reason)
                self.on_notice(reason)
                return
            self._stop.wait(self.cfg.interval_s)
