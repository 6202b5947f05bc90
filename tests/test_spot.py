"""The spot-notice watcher against metadata servers on loopback that start serving a notice mid-run."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainproof.lifecycle.spot import SpotConfig, SpotWatcher


class FakeMetadata:
    """Serves 'no notice' until ``arm()``; records the headers it was asked with."""

    def __init__(self, provider: str) -> None:
        self.provider, self.armed, self.requests = provider, False, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_PUT(self):
                outer.requests.append(("PUT", self.path, dict(self.headers)))
                if self.path == "/latest/api/token":
                    self._reply(200, b"tok-123")
                else:
                    self._reply(404, b"")

            def do_GET(self):
                outer.requests.append(("GET", self.path, dict(self.headers)))
                self._reply(*outer.answer(self.path, self.headers))

            def _reply(self, status, body):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, path, headers):
        if self.provider == "aws" and path == "/latest/meta-data/spot/instance-action":
            if headers.get("X-aws-ec2-metadata-token") != "tok-123":
                return 401, b""
            return (200, json.dumps({"action": "terminate", "time": "2026-11-29T10:00:00Z"}).encode()) if self.armed else (404, b"")
        if self.provider == "gcp" and path.startswith("/computeMetadata/v1/instance/preempted"):
            ok = headers.get("Metadata-Flavor") == "Google"
            return (200, b"TRUE" if self.armed else b"FALSE") if ok else (403, b"")
        if self.provider == "azure" and path.startswith("/metadata/scheduledevents"):
            events = [{"EventId": "e1", "EventType": "Preempt", "NotBefore": "soon"}] if self.armed else []
            return 200, json.dumps({"DocumentIncarnation": 1, "Events": events}).encode()
        return 404, b""

    def arm(self):
        self.armed = True

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_watcher_fires_once_when_the_notice_appears(provider):
    meta = FakeMetadata(provider)
    fired = []
    try:
        with SpotWatcher(SpotConfig(provider=provider, endpoint=meta.endpoint, interval_s=0.05), fired.append) as w:
            time.sleep(0.3)
            assert fired == [], "no notice is served yet"
            meta.arm()
            deadline = time.time() + 5
            while not fired and time.time() < deadline:
                time.sleep(0.02)
        assert len(fired) == 1 and w.notice == fired[0]
        assert {"aws": "terminate", "gcp": "GCP", "azure": "Preempt"}[provider] in fired[0]
        polls = [r for r in meta.requests if r[0] == "GET"]
        assert len(polls) >= 3
    finally:
        meta.close()


def test_unreachable_metadata_never_fires():
    fired = []
    cfg = SpotConfig(provider="aws", endpoint="http://127.0.0.1:9", interval_s=0.05, timeout_s=0.2)
    with SpotWatcher(cfg, fired.append):
        time.sleep(0.4)
    assert fired == []


def test_bad_provider_is_refused():
    with pytest.raises(ValueError, match="--spot-notice"):
        SpotConfig(provider="oracle")
