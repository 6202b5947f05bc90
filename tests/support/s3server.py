"""moto's S3 in server mode on loopback, plus boto3 / s3fs client helpers for tests.

Usage::

    from tests.support.s3server import S3Server, dummy_aws_env

    def test_x(monkeypatch):
        for k, v in dummy_aws_env().items():
            monkeypatch.setenv(k, v)
        with S3Server() as srv:
            bucket = srv.create_bucket()          # unique name
            s3 = srv.boto3_client()
            fs = srv.s3fs()                        # or make_s3fs(proxy.endpoint)

Notes
-----
* Port: ``ThreadedMotoServer(port=0)`` binds an ephemeral port atomically (werkzeug's
  ``make_server`` accepts port 0; ``get_host_and_port()`` reports the real one), so there is no
  find-then-bind race.  :func:`free_port` exists for other servers that need a number up front.
* Global state: moto keeps its backends in module globals of *this process*.  Every
  ``S3Server`` (and any ``moto.mock_aws`` in the same process) shares one S3 namespace, and
  ``POST /moto-api/reset`` (:meth:`S3Server.reset`) wipes all of it.  Prefer a unique bucket per
  test (:func:`unique_bucket_name`, the default of :meth:`S3Server.create_bucket`) over resets.
  The only other global we touch: with ``quiet=True`` the ``werkzeug`` logger's level is raised
  to WARNING if it was unset (otherwise werkzeug logs every request to stderr), and one private
  boto3 Session is cached here to create clients (models load once; never boto3's default one).
* Credentials: clients made here always get explicit dummy credentials.  Code under test that
  builds its own clients should run with :func:`dummy_aws_env` applied (``monkeypatch.setenv``)
  so nothing reads real credentials, config files or the EC2 metadata service.
* moto does not verify SigV4 signatures by default (see ``POST /moto-api/reset-auth`` for the
  IAM-auth mode, which does; it is process-global).  It does not check Content-MD5 or checksums.

Findings (moto 5.2.5, botocore 1.43, s3fs 2026.9)
--------------------------------------------------
* ``put_object(IfNoneMatch="*")`` on an existing key -> HTTP 412, error
  ``{"Code": "PreconditionFailed", "Condition": "If-None-Match", ...}`` (same shape as AWS).
* ``complete_multipart_upload(IfNoneMatch="*")`` when the key exists -> the same 412 with
  ``Condition: If-None-Match``.  The multipart upload is NOT consumed: it stays listed by
  ListMultipartUploads until aborted (s3fs aborts it in its ``except`` path).
* s3fs ``translate_boto_error`` maps ``PreconditionFailed`` + ``Condition == "If-None-Match"`` to
  ``FileExistsError`` (``__cause__`` is the ``ClientError``), so with moto
  ``fs.pipe_file(p, data, mode="create")`` raises ``FileExistsError`` the second time, both for a
  single PUT and for the multipart path (``len(data) >= 2 * chunksize``).  A 412 *without* the
  Condition element (some S3-compatible servers) would instead surface as
  ``OSError(errno.EINVAL)`` -- code that needs to tell "lost the race" apart must check both.
* aiohttp (under s3fs/aiobotocore) silently re-sends an idempotent request (PUT, GET, HEAD,
  DELETE; not POST) ONCE after a connection reset/disconnect (``ClientSession._retry_connection``),
  below botocore's ``total_max_attempts`` and s3fs's ``retries``.  So a create-only PUT that
  committed but lost its response comes back as ``FileExistsError`` on the *first* call: a 412
  from s3fs can be your own write -- read the object back and compare.  boto3 (urllib3, called
  with ``retries=False``) does not do this: it raises ``ConnectionClosedError``.
* s3fs/aiobotocore report a connection reset as ``botocore.exceptions.EndpointConnectionError``
  ("Could not connect to the endpoint URL"; not an ``OSError``; ``__context__`` is aiohttp's
  ``ClientOSError(104)``), passed through untranslated, even when the request was delivered.
* CompleteMultipartUpload (POST, not re-sent) that commits but loses its response: s3fs then
  aborts the upload, gets ``NoSuchUpload`` and raises ``FileNotFoundError`` (``__cause__``: the
  AbortMultipartUpload ClientError, the EndpointConnectionError further down the ``__context__``
  chain) -- while the object exists.
* Other s3fs mappings with ``fs.retries = 1``: 503 SlowDown -> ``OSError(errno.EBUSY)``,
  500 InternalError -> ``OSError(errno.EREMOTEIO)``, 403 AccessDenied -> ``PermissionError``;
  the original ``ClientError`` is ``__cause__``.
* moto's error responses carry two ``Server`` headers (werkzeug's and ``server: amazon.com``);
  aiohttp's strict response parser (e.g. under ``python -X dev``) rejects them with "Duplicate
  'Server' header found" -- direct s3fs-to-moto error paths fail in dev mode; through
  :class:`~tests.support.faultproxy.FaultProxy` (which de-duplicates) they work.
* moto's werkzeug server answers every request with ``Connection: close`` (no upstream keep-alive).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import urllib.request
import uuid
from typing import Any, Iterator

import boto3
from botocore.config import Config

try:  # moto[server] is a test extra
    from moto.server import ThreadedMotoServer
except ImportError:  # pragma: no cover - surfaced as a clear error on use
    ThreadedMotoServer = None  # type: ignore[assignment,misc]

__all__ = [
    "Clients",
    "DUMMY_KEY",
    "DUMMY_SECRET",
    "REGION",
    "S3Server",
    "client_config",
    "dummy_aws_env",
    "free_port",
    "make_boto3_client",
    "make_s3fs",
    "unique_bucket_name",
]

DUMMY_KEY = "testing"
DUMMY_SECRET = "testing"
REGION = "us-east-1"


def dummy_aws_env() -> dict[str, str]:
    """Environment for hermetic S3 tests: dummy credentials, fixed region, no IMDS, no proxies.

    Apply with ``monkeypatch.setenv`` (this function sets nothing itself).
    """
    return {
        "AWS_ACCESS_KEY_ID": DUMMY_KEY,
        "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral port that was free a moment ago (bind 0, read, close). Racy by nature;
    prefer binding port 0 directly where the server allows it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def unique_bucket_name(prefix: str = "tp") -> str:
    """A valid, unique S3 bucket name (lowercase, 3..63 chars)."""
    prefix = "".join(c for c in prefix.lower() if c.isalnum() or c == "-").strip("-") or "tp"
    return f"{prefix[:30]}-{uuid.uuid4().hex[:20]}"


_SESSION_LOCK = threading.Lock()
_SESSION: boto3.session.Session | None = None


def _shared_session() -> boto3.session.Session:
    """A private boto3 session (not boto3's module default) reused to create clients.

    Clients always get explicit credentials and region, so the session's own credential chain
    is never consulted.  Callers hold ``_SESSION_LOCK`` (botocore sessions are not thread-safe).
    """
    global _SESSION
    if _SESSION is None:
        _SESSION = boto3.session.Session()
    return _SESSION


def client_config(
    *,
    total_max_attempts: int | None = 1,
    connect_timeout: float = 5,
    read_timeout: float = 30,
    **overrides: Any,
) -> Config:
    """botocore Config for talking to a loopback S3: path-style addressing, checksums only when
    required, ``total_max_attempts`` attempts (None = botocore's default retry policy)."""
    kw: dict[str, Any] = {
        "region_name": REGION,
        "s3": {"addressing_style": "path"},
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
        "connect_timeout": connect_timeout,
        "read_timeout": read_timeout,
    }
    if total_max_attempts is not None:
        kw["retries"] = {"mode": "standard", "total_max_attempts": total_max_attempts}
    kw.update(overrides)
    return Config(**kw)


def make_boto3_client(
    endpoint_url: str,
    *,
    key: str = DUMMY_KEY,
    secret: str = DUMMY_SECRET,
    total_max_attempts: int | None = 1,
    connect_timeout: float = 5,
    read_timeout: float = 30,
    **config_overrides: Any,
):
    """A boto3 S3 client for ``endpoint_url`` with explicit credentials (never boto3's default
    session; one private botocore session is shared so service models load only once)."""
    with _SESSION_LOCK:
        return _shared_session().client(
            "s3",
            endpoint_url=endpoint_url,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            region_name=REGION,
            config=client_config(
                total_max_attempts=total_max_attempts,
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                **config_overrides,
            ),
        )


def make_s3fs(
    endpoint_url: str,
    *,
    key: str = DUMMY_KEY,
    secret: str = DUMMY_SECRET,
    total_max_attempts: int = 1,
    fs_retries: int = 1,
    connect_timeout: float = 5,
    read_timeout: float = 30,
    **fs_kwargs: Any,
):
    """An ``s3fs.S3FileSystem`` for ``endpoint_url``: no instance cache, no listings cache, path
    addressing, checksums only when required, one retry layer only (``fs.retries = fs_retries``,
    botocore ``total_max_attempts``)."""
    import s3fs

    config_kwargs = {
        "s3": {"addressing_style": "path"},
        "retries": {"mode": "standard", "total_max_attempts": total_max_attempts},
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
        "connect_timeout": connect_timeout,
        "read_timeout": read_timeout,
    }
    config_kwargs.update(fs_kwargs.pop("config_kwargs", {}))
    client_kwargs = {"region_name": REGION}
    client_kwargs.update(fs_kwargs.pop("client_kwargs", {}))
    fs = s3fs.S3FileSystem(
        key=key,
        secret=secret,
        endpoint_url=endpoint_url,
        client_kwargs=client_kwargs,
        config_kwargs=config_kwargs,
        skip_instance_cache=True,
        use_listings_cache=False,
        **fs_kwargs,
    )
    fs.retries = fs_retries
    return fs


class Clients:
    """Client helpers of a server whose ``endpoint`` is set (moto's :class:`S3Server`, the Ceph gateway of
    ``tests.support.rgw``): a test does not care which server it got."""

    endpoint: str

    def boto3_client(self, endpoint_url: str | None = None, **kwargs: Any):
        """boto3 S3 client for this server (or ``endpoint_url``, e.g. a FaultProxy in front of
        it); kwargs go to :func:`make_boto3_client`."""
        return make_boto3_client(endpoint_url or self.endpoint, **kwargs)

    def s3fs(self, endpoint_url: str | None = None, **kwargs: Any):
        """s3fs filesystem for this server (or ``endpoint_url``); kwargs go to :func:`make_s3fs`."""
        return make_s3fs(endpoint_url or self.endpoint, **kwargs)

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (unique name if none given) directly on the server; returns its name."""
        name = name or unique_bucket_name()
        self.boto3_client().create_bucket(Bucket=name)
        return name


class S3Server(Clients):
    """moto S3 server on loopback. Context manager; ``.endpoint`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, quiet: bool = True):
        if ThreadedMotoServer is None:  # pragma: no cover
            raise RuntimeError("moto[server] is not installed (pip install 'moto[server]')")
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("S3Server binds loopback only")
        self._host = host
        self._port = port
        self._quiet = quiet
        self._server: Any = None
        self.host: str = host
        self.port: int = 0

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "S3Server":
        if self._server is not None:
            return self
        if self._quiet:
            wz = logging.getLogger("werkzeug")
            if wz.level == logging.NOTSET:
                wz.setLevel(logging.WARNING)
        srv = ThreadedMotoServer(ip_address=self._host, port=self._port, verbose=False)
        srv.start()
        self._server = srv
        self.host, self.port = srv.get_host_and_port()
        return self

    def stop(self) -> None:
        srv, self._server = self._server, None
        if srv is None:
            return
        srv.stop()  # shutdown() + join the serving thread
        inner = getattr(srv, "_server", None)  # ThreadedMotoServer does not close the socket
        if inner is not None:
            try:
                inner.server_close()
            except OSError:
                pass

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("S3Server is not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _moto_api(self, path: str, data: bytes = b"") -> bytes:
        # text/plain: werkzeug would parse urllib's default form content type away from .data
        req = urllib.request.Request(
            self.endpoint + path, data=data, method="POST", headers={"Content-Type": "text/plain"}
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=30) as resp:
            return resp.read()

    def reset(self) -> None:
        """Wipe ALL moto state in this process (``POST /moto-api/reset``): every bucket of every
        S3Server and mock_aws in the process.  Per-test unique buckets are usually better."""
        self._moto_api("/moto-api/reset")

    @contextlib.contextmanager
    def iam_auth(self) -> Iterator[tuple[str, str]]:
        """Turn on moto's IAM authentication -- which verifies SigV4 signatures -- and yield
        ``(access_key_id, secret_access_key)`` of a new allow-all IAM user.

        PROCESS-GLOBAL while active (``POST /moto-api/reset-auth``): every moto server and
        mock in this process then rejects unknown keys and bad signatures.  The previous
        setting is restored on exit.
        """
        with _SESSION_LOCK:
            iam = _shared_session().client(
                "iam",
                endpoint_url=self.endpoint,
                aws_access_key_id=DUMMY_KEY,
                aws_secret_access_key=DUMMY_SECRET,
                region_name=REGION,
            )
        user = unique_bucket_name("tp-user")
        iam.create_user(UserName=user)
        iam.put_user_policy(
            UserName=user,
            PolicyName="allow-all",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
                }
            ),
        )
        key = iam.create_access_key(UserName=user)["AccessKey"]
        answer = json.loads(self._moto_api("/moto-api/reset-auth", b"0"))
        previous = answer.get("PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT", "inf")
        try:
            yield key["AccessKeyId"], key["SecretAccessKey"]
        finally:
            self._moto_api("/moto-api/reset-auth", str(previous).encode())
