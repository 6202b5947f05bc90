"""A small fault-injecting HTTP/1.1 reverse proxy on loopback, for S3 client tests.

Put it between a client (boto3, s3fs/aiobotocore) and an S3 server (RGW, moto)::

    with S3Server() as s3, FaultProxy(s3.endpoint) as proxy:
        client = s3.boto3_client(proxy.endpoint)
        proxy.set_faults([Fault("slowdown", rate=0.2, methods={"PUT"})], seed=1)
        ...
        proxy.stats.injected["slowdown"]

Fault kinds (``Fault.kind``):

``slowdown``            503 ``SlowDown`` S3 XML error, request not forwarded.
``internal``            500 ``InternalError`` XML, not forwarded.
``forbidden``           403 ``AccessDenied`` XML (``code="InvalidAccessKeyId"`` for that one), not forwarded.
``error``               any S3 XML error: ``status=``, ``code=``, ``message=`` (e.g. 409
                        ``ConditionalRequestConflict``, 400 ``RequestTimeout``), not forwarded.
``reset``               read the whole request, then abort the TCP connection (SO_LINGER 0 -> RST),
                        no response; not forwarded.
``reset_after_forward`` forward the request (the write LANDS upstream), read the upstream response,
                        then RST the client instead of relaying it: the "ambiguous write" (e.g. a
                        ``PUT If-None-Match: *`` that committed but whose 200 was lost; the client's
                        retry then gets 412).
``stall``               read the request, wait ``stall_s`` seconds (client read timeouts), then
                        close the connection without a response; not forwarded.
``stall_after_forward`` forward (the write lands), wait ``stall_s``, then close without relaying.

Selection: for each request the rules are tried in order; a rule *matches* when the method is
in ``methods`` (None = any), ``path_regex`` ``re.search``-es the raw request target (path plus
``?query``, e.g. ``"/bucket/key?uploadId=..."``; None = any), ``path_contains`` is a substring
of it, and ``when(method, target, headers)`` (if given) is true.  A matching rule is eligible
once its first ``skip_first`` matches have passed and while it has injected fewer than
``max_count`` faults; an eligible rule fires when ``rng.random() < rate`` (one draw per eligible
rule, from a ``random.Random(seed)`` reset by every ``set_faults``).  The first rule that fires
wins; otherwise the request is forwarded.  Rules can be changed at any time (thread-safe).

Handy targets: UploadPart = ``methods={"PUT"}, path_contains="partNumber="``;
CompleteMultipartUpload = ``methods={"POST"}, path_contains="uploadId="``;
CreateMultipartUpload = ``methods={"POST"}, path_regex=r"\\?uploads"``.

Forwarding details
------------------
* The ``Host`` header is relayed unchanged, so a SigV4 signature made for the proxy's address
  stays valid at the upstream (checked against moto with IAM auth on, see the tests).  Hop-by-hop
  headers (Connection, Keep-Alive, Proxy-*, TE, Trailer, Transfer-Encoding, Upgrade) and
  ``Expect`` are not relayed; none of them is signed by botocore.
* Request bodies: ``Content-Length`` bodies are relayed byte for byte.  ``Transfer-Encoding:
  chunked`` bodies are de-chunked at the transport level and relayed with a ``Content-Length``
  (HTTP trailer fields, if any, are appended as headers).  An ``aws-chunked`` payload
  (``Content-Encoding: aws-chunked``, ``x-amz-content-sha256: STREAMING-...``) is *content*: its
  own chunk framing and checksum trailer are relayed untouched inside the body.  botocore and
  aiobotocore use aws-chunked trailers only over https; with ``request_checksum_calculation=
  "when_required"`` over http they send plain ``Content-Length`` bodies.
  ``Expect: 100-continue`` is answered by the proxy itself (http.server does it).
* Responses: status, reason and headers relayed (the proxy adds no Server/Date header; of a
  duplicated singleton header such as moto's two ``Server`` headers on errors, only the first);
  bodies with a Content-Length are streamed, others are read whole and sent with a length.
  Client connections are HTTP/1.1 keep-alive; each has its own keep-alive upstream connection,
  re-opened once if a *reused* upstream connection turns out to be stale before any response.
* Everything binds 127.0.0.1; threads are tracked and ``stop()`` closes live connections,
  wakes stalls and joins threads with a bound.

Findings about moto 412 / s3fs mapping are recorded in :mod:`tests.support.s3server`.
"""

from __future__ import annotations

import collections
import dataclasses
import http.client
import random
import re
import socket
import struct
import threading
import time
import uuid
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable, Mapping
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

__all__ = ["FAULT_KINDS", "Fault", "FaultProxy", "ProxyEvent", "ProxyStats", "s3_error_xml"]

FAULT_KINDS = frozenset(
    {
        "slowdown",
        "internal",
        "forbidden",
        "error",
        "reset",
        "reset_after_forward",
        "stall",
        "stall_after_forward",
    }
)

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)

# Relayed responses keep only the first of these: moto's error responses carry werkzeug's
# "Server" *and* moto's "server: amazon.com", which aiohttp's strict parser (used e.g. under
# `python -X dev`) rejects as "Duplicate 'Server' header found".
_SINGLETON = frozenset(
    {"content-length", "content-location", "content-range", "content-type", "etag", "server"}
)

_ERROR_DEFAULTS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
    "forbidden": (403, "AccessDenied", "Access Denied"),
}
_FORBIDDEN_MESSAGES = {
    "AccessDenied": "Access Denied",
    "InvalidAccessKeyId": "The AWS Access Key Id you provided does not exist in our records.",
    "SignatureDoesNotMatch": "The request signature we calculated does not match the signature "
    "you provided. Check your key and signing method.",
    "ExpiredToken": "The provided token has expired.",
}

_MAX_LINE = 65536


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault rule. See the module docstring for the kinds and the selection rules."""

    kind: str
    rate: float = 1.0
    methods: Iterable[str] | None = None
    path_regex: str | re.Pattern[str] | None = None
    path_contains: str | None = None
    max_count: int | None = None
    skip_first: int = 0
    stall_s: float = 5.0
    status: int | None = None
    code: str | None = None
    message: str | None = None
    when: Callable[[str, str, Mapping[str, str]], bool] | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {sorted(FAULT_KINDS)}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError("rate must be in [0, 1]")
        if self.kind == "error" and (self.status is None or self.code is None):
            raise ValueError("kind='error' needs status= and code=")
        if self.methods is not None:
            object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))
        if isinstance(self.path_regex, str):
            object.__setattr__(self, "path_regex", re.compile(self.path_regex))

    def matches(self, method: str, target: str, headers: Mapping[str, str]) -> bool:
        if self.methods is not None and method.upper() not in self.methods:  # type: ignore[operator]
            return False
        if self.path_contains is not None and self.path_contains not in target:
            return False
        if self.path_regex is not None and not self.path_regex.search(target):  # type: ignore[union-attr]
            return False
        if self.when is not None and not self.when(method, target, headers):
            return False
        return True

    def error_triplet(self) -> tuple[int, str, str]:
        if self.kind == "error":
            return int(self.status), str(self.code), self.message or str(self.code)  # type: ignore[arg-type]
        status, code, message = _ERROR_DEFAULTS[self.kind]
        if self.kind == "forbidden" and self.code:
            code, message = self.code, _FORBIDDEN_MESSAGES.get(self.code, message)
        elif self.code:
            code = self.code
        return self.status or status, code, self.message or message


@dataclasses.dataclass(frozen=True)
class ProxyStats:
    """Snapshot of the proxy's counters."""

    requests: int = 0  # requests read from clients (complete request line + headers)
    forwarded: int = 0  # requests sent upstream (incl. *_after_forward faults)
    injected: Mapping[str, int] = dataclasses.field(default_factory=dict)  # per fault kind
    connections: int = 0  # client TCP connections accepted
    upstream_errors: int = 0  # upstream failures answered with 502

    @property
    def injected_total(self) -> int:
        return sum(self.injected.values())


@dataclasses.dataclass(frozen=True)
class ProxyEvent:
    """One request as the proxy handled it. ``outcome`` is ``"forwarded"``, a fault kind,
    ``"upstream_error"`` or ``"bad_request"``; ``status`` is what the client got (None: nothing)."""

    method: str
    target: str
    outcome: str
    status: int | None


def s3_error_xml(code: str, message: str, resource: str = "", request_id: str = "") -> bytes:
    """An S3 REST error body."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(resource)}</Resource><RequestId>{escape(request_id)}</RequestId>"
        f"<HostId>{escape(request_id)}</HostId></Error>"
    ).encode()


class _BadRequest(Exception):
    pass


class _ClientGone(Exception):
    pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # FaultProxy.stop() joins its own tracked threads, with a bound
    allow_reuse_address = True

    def __init__(self, addr, handler, proxy: "FaultProxy"):
        self.proxy = proxy
        super().__init__(addr, handler)

    def shutdown_request(self, request):  # noqa: D401 - socketserver hook
        # An aborted connection must not send FIN first (shutdown(SHUT_WR)): close -> RST.
        if self.proxy._take_aborted(request):
            self.close_request(request)
        else:
            super().shutdown_request(request)

    def handle_error(self, request, client_address):  # keep test output clean
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = 60.0  # idle keep-alive client connections (overridden per proxy)

    # -- connection lifecycle -----------------------------------------------------------------
    def setup(self) -> None:
        self.timeout = self.server.proxy.idle_timeout
        super().setup()
        try:  # headers and body go out in separate writes: avoid Nagle + delayed-ACK stalls
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self._upstream: http.client.HTTPConnection | None = None
        self._upstream_used = False
        self.server.proxy._register(self.connection, threading.current_thread())

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        finally:
            self._close_upstream()
            self.server.proxy._unregister(self.connection, threading.current_thread())

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - silence
        pass

    def __getattr__(self, name: str):
        # do_GET, do_PUT, do_POST, do_HEAD, do_DELETE, ... all go to the proxy.
        if name.startswith("do_"):
            return self._proxy_request
        raise AttributeError(name)

    # -- request handling ---------------------------------------------------------------------
    def _proxy_request(self) -> None:
        proxy = self.server.proxy
        method, target = self.command, self.path
        try:
            body, extra_headers = self._read_body()
        except _ClientGone:
            self.close_connection = True
            return
        except _BadRequest as exc:
            proxy._count_request(method, target, None, bad=True)
            self._send_simple(400, "BadRequest", str(exc), close=True)
            proxy._event(method, target, "bad_request", 400)
            return
        fault = proxy._count_request(method, target, self.headers)
        kind = fault.kind if fault else None
        try:
            if fault is None:
                status = self._forward_and_relay(method, target, body, extra_headers)
                proxy._event(method, target, "forwarded" if status != 502 else "upstream_error", status)
            elif kind in ("slowdown", "internal", "forbidden", "error"):
                status, code, message = fault.error_triplet()
                self._send_simple(status, code, message, head=(method == "HEAD"))
                proxy._event(method, target, kind, status)
            elif kind == "reset":
                self._abort()
                proxy._event(method, target, kind, None)
            elif kind == "reset_after_forward":
                self._forward_only(method, target, body, extra_headers)
                self._abort()
                proxy._event(method, target, kind, None)
            elif kind == "stall":
                proxy._stopping.wait(fault.stall_s)
                self.close_connection = True
                proxy._event(method, target, kind, None)
            elif kind == "stall_after_forward":
                self._forward_only(method, target, body, extra_headers)
                proxy._stopping.wait(fault.stall_s)
                self.close_connection = True
                proxy._event(method, target, kind, None)
            else:  # pragma: no cover - Fault validates kinds
                raise AssertionError(kind)
        except (_ClientGone, OSError, http.client.HTTPException):
            self.close_connection = True

    def _read_exact(self, n: int) -> bytes:
        data = self.rfile.read(n)
        if len(data) != n:
            raise _ClientGone()
        return data

    def _read_line(self) -> bytes:
        line = self.rfile.readline(_MAX_LINE + 1)
        if not line:
            raise _ClientGone()
        if len(line) > _MAX_LINE:
            raise _BadRequest("line too long")
        return line

    def _read_body(self) -> tuple[bytes | None, list[tuple[str, str]]]:
        """Returns (body or None, extra headers to send upstream)."""
        te = self.headers.get("Transfer-Encoding")
        if te is not None:
            codings = [c.strip().lower() for c in te.split(",") if c.strip()]
            if codings != ["chunked"]:
                raise _BadRequest(f"unsupported Transfer-Encoding {te!r}")
            parts: list[bytes] = []
            while True:
                line = self._read_line()
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise _BadRequest("bad chunk size line") from None
                if size == 0:
                    break
                parts.append(self._read_exact(size))
                if self._read_line() not in (b"\r\n", b"\n"):
                    raise _BadRequest("missing CRLF after chunk")
            extra: list[tuple[str, str]] = []
            while True:  # trailer section
                line = self._read_line()
                if line in (b"\r\n", b"\n"):
                    break
                name, sep, value = line.decode("latin-1").partition(":")
                if not sep:
                    raise _BadRequest("bad trailer field")
                extra.append((name.strip(), value.strip()))
            body = b"".join(parts)
            extra.append(("Content-Length", str(len(body))))
            return body, extra
        cl = self.headers.get("Content-Length")
        if cl is not None:
            try:
                n = int(cl)
                if n < 0:
                    raise ValueError
            except ValueError:
                raise _BadRequest("bad Content-Length") from None
            return self._read_exact(n), []
        return None, []

    def _upstream_headers(self, extra: list[tuple[str, str]]) -> list[tuple[str, str]]:
        conn_tokens = {
            t.strip().lower() for v in self.headers.get_all("Connection", []) for t in v.split(",")
        }
        skip = _HOP_BY_HOP | conn_tokens | {"expect"}
        out = [(k, v) for k, v in self.headers.items() if k.lower() not in skip]
        return out + extra

    def _close_upstream(self) -> None:
        if self._upstream is not None:
            try:
                self._upstream.close()
            except OSError:
                pass
            self._upstream = None

    def _send_upstream(self, method, target, body, extra) -> http.client.HTTPResponse:
        proxy = self.server.proxy
        headers = self._upstream_headers(extra)
        for attempt in (0, 1):
            reused = self._upstream is not None and self._upstream_used
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(
                    proxy.upstream_host, proxy.upstream_port, timeout=proxy.upstream_timeout
                )
                self._upstream_used = False
            conn = self._upstream
            try:
                conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                for k, v in headers:
                    conn.putheader(k, v)
                conn.endheaders(body)
                resp = conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._close_upstream()
                if reused and attempt == 0:
                    continue  # stale keep-alive connection: nothing reached the upstream app
                raise
            except Exception:
                self._close_upstream()
                raise
            self._upstream_used = True
            proxy._count_forward()
            return resp
        raise AssertionError("unreachable")

    def _forward_only(self, method, target, body, extra) -> None:
        """Forward, read and discard the response (the side effect lands upstream)."""
        try:
            resp = self._send_upstream(method, target, body, extra)
            resp.read()
            if resp.will_close:
                self._close_upstream()
        except (OSError, http.client.HTTPException):
            self.server.proxy._count_upstream_error()
            self._close_upstream()

    def _forward_and_relay(self, method, target, body, extra) -> int:
        try:
            resp = self._send_upstream(method, target, body, extra)
        except (OSError, http.client.HTTPException) as exc:
            self.server.proxy._count_upstream_error()
            self._send_simple(502, "BadGateway", f"upstream error: {exc!r}", head=(method == "HEAD"))
            return 502
        try:
            headers, seen = [], set()
            for k, v in resp.getheaders():
                lk = k.lower()
                if lk in _HOP_BY_HOP or (lk in _SINGLETON and lk in seen):
                    continue
                seen.add(lk)
                headers.append((k, v))
            no_body = method == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
            streaming = not no_body and resp.length is not None and not resp.chunked
            data = b""
            if no_body:
                # Mark the (empty) response read: http.client keeps an unread HEAD/204 response as the connection's
                # current one, and the next request on a kept-alive upstream (RGW; moto closes every connection)
                # would then fail with ResponseNotReady.
                resp.read()
            elif not streaming:
                data = resp.read()
                headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
                headers.append(("Content-Length", str(len(data))))
            self.send_response_only(resp.status, resp.reason)
            for k, v in headers:
                self.send_header(k, v)
            self.end_headers()
            if streaming:
                while True:
                    chunk = resp.read(1 << 16)
                    if not chunk:
                        break
                    self.wfile.write(chunk)
            elif data:
                self.wfile.write(data)
            if resp.will_close:
                self._close_upstream()
            return resp.status
        except BaseException:
            self._close_upstream()  # response possibly half-read: do not reuse
            raise

    def _send_simple(self, status: int, code: str, message: str, *, head: bool = False,
                     close: bool = False) -> None:
        request_id = uuid.uuid4().hex[:16].upper()
        body = s3_error_xml(code, message, urlsplit(self.path).path, request_id)
        self.send_response_only(status)
        self.send_header("x-amz-request-id", request_id)
        self.send_header("x-amz-id-2", request_id)
        self.send_header("Date", formatdate(usegmt=True))
        self.send_header("Server", "AmazonS3")
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if head else str(len(body)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _abort(self) -> None:
        """Make this connection end with a TCP RST and no response."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.server.proxy._mark_aborted(self.connection)


class FaultProxy:
    """Threaded HTTP/1.1 reverse proxy on 127.0.0.1 that injects S3-style faults.

    ``FaultProxy(upstream_endpoint, *, port=0, seed=0, upstream_timeout=60, idle_timeout=60)``;
    context manager; ``.endpoint`` is ``http://127.0.0.1:PORT``.
    """

    def __init__(
        self,
        upstream_endpoint: str,
        *,
        port: int = 0,
        seed: int = 0,
        upstream_timeout: float = 60.0,
        idle_timeout: float = 60.0,
        max_events: int = 10000,
    ):
        u = urlsplit(upstream_endpoint)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"upstream must be http://host:port, got {upstream_endpoint!r}")
        self.upstream_endpoint = upstream_endpoint
        self.upstream_host: str = u.hostname
        self.upstream_port: int = u.port or 80
        self.upstream_timeout = upstream_timeout
        self.idle_timeout = idle_timeout
        self._port = port
        self._lock = threading.RLock()
        self._rules: list[Fault] = []
        self._rule_state: list[list[int]] = []  # [matched, injected] per rule
        self._rng = random.Random(seed)
        self._seed = seed
        self._requests = 0
        self._forwarded = 0
        self._injected: collections.Counter[str] = collections.Counter()
        self._connections = 0
        self._upstream_errors = 0
        self._events: collections.deque[ProxyEvent] = collections.deque(maxlen=max_events)
        self._live: dict[socket.socket, threading.Thread] = {}
        self._threads: set[threading.Thread] = set()
        self._aborted: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._serve_thread: threading.Thread | None = None
        self.port = 0

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "FaultProxy":
        if self._server is not None:
            return self
        self._stopping.clear()
        self._server = _Server(("127.0.0.1", self._port), _Handler, self)
        self.port = self._server.server_address[1]
        self._serve_thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
            name=f"faultproxy-{self.port}", daemon=True,
        )
        self._serve_thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()  # wakes stalls
        server.shutdown()
        server.server_close()
        if self._serve_thread is not None:
            self._serve_thread.join(timeout)
        with self._lock:
            live = list(self._live)
            threads = set(self._threads)
        for sock in live:  # unblock handlers waiting on idle keep-alive connections
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("FaultProxy is not started")
        return f"http://127.0.0.1:{self.port}"

    # -- fault rules --------------------------------------------------------------------------
    def set_faults(self, faults: Iterable[Fault], seed: int | None = None) -> None:
        """Replace the rules (and their counters); re-seed the RNG (with ``seed`` or the last one)."""
        faults = list(faults)
        for f in faults:
            if not isinstance(f, Fault):
                raise TypeError(f"expected Fault, got {type(f).__name__}")
        with self._lock:
            if seed is not None:
                self._seed = seed
            self._rng = random.Random(self._seed)
            self._rules = faults
            self._rule_state = [[0, 0] for _ in faults]

    def clear_faults(self) -> None:
        self.set_faults([])

    @property
    def faults(self) -> list[Fault]:
        with self._lock:
            return list(self._rules)

    def fault_counts(self) -> list[tuple[Fault, int, int]]:
        """(rule, matched, injected) for each current rule."""
        with self._lock:
            return [(f, s[0], s[1]) for f, s in zip(self._rules, self._rule_state)]

    # -- counters -----------------------------------------------------------------------------
    @property
    def stats(self) -> ProxyStats:
        with self._lock:
            return ProxyStats(
                requests=self._requests,
                forwarded=self._forwarded,
                injected=dict(self._injected),
                connections=self._connections,
                upstream_errors=self._upstream_errors,
            )

    @property
    def events(self) -> list[ProxyEvent]:
        with self._lock:
            return list(self._events)

    def wait_for_events(self, count: int, timeout: float = 5.0) -> list[ProxyEvent]:
        """The events once there are at least ``count`` (a request's event is recorded after its response went
        out, so a client can see the response a moment before the event exists), or as they are at ``timeout``."""
        deadline = time.monotonic() + timeout
        while len(self.events) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.events

    def reset_stats(self) -> None:
        with self._lock:
            self._requests = self._forwarded = self._connections = self._upstream_errors = 0
            self._injected.clear()
            self._events.clear()

    # -- internal hooks (called from handler threads) -----------------------------------------
    def _count_request(self, method, target, headers, bad: bool = False) -> Fault | None:
        with self._lock:
            self._requests += 1
            if bad:
                return None
            for rule, state in zip(self._rules, self._rule_state):
                if not rule.matches(method, target, headers):
                    continue
                state[0] += 1
                if state[0] <= rule.skip_first:
                    continue
                if rule.max_count is not None and state[1] >= rule.max_count:
                    continue
                if self._rng.random() < rule.rate:
                    state[1] += 1
                    self._injected[rule.kind] += 1
                    return rule
            return None

    def _count_forward(self) -> None:
        with self._lock:
            self._forwarded += 1

    def _count_upstream_error(self) -> None:
        with self._lock:
            self._upstream_errors += 1

    def _event(self, method, target, outcome, status) -> None:
        with self._lock:
            self._events.append(ProxyEvent(method, target, outcome, status))

    def _register(self, sock, thread) -> None:
        with self._lock:
            self._connections += 1
            self._live[sock] = thread
            self._threads.add(thread)

    def _unregister(self, sock, thread) -> None:
        with self._lock:
            self._live.pop(sock, None)
            self._threads.discard(thread)

    def _mark_aborted(self, sock) -> None:
        with self._lock:
            self._aborted.add(sock)

    def _take_aborted(self, sock) -> bool:
        with self._lock:
            if sock in self._aborted:
                self._aborted.discard(sock)
                return True
            return False
