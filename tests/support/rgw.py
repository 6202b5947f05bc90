"""A throw-away Ceph RADOS Gateway (``scripts/rgw.sh``) as the test session's S3 server, shared by every
pytest-xdist worker of one session.

The controlling pytest process (``tests/conftest.py``) only picks a private state folder
(:func:`prepare_session`); the first test that needs S3 starts the gateway there under a file lock
(:func:`session_server`), the other workers find it running and reuse it, and the controller stops it when the
session ends (:func:`end_session`). The gateway is started with the controller as its owner (``RGW_OWNER_PID``),
so a session killed before its clean-up leaves no daemon behind. Two sessions on one machine use two folders
and free ports of their own.

``TRAINPROOF_TEST_RGW``: ``auto`` (default) starts it when a test needs it and skips those tests, saying why,
when it cannot start (no root to install the Debian packages, no apt, not Linux); ``require`` fails them instead
(CI); ``0`` skips them without trying.

:class:`RGWServer` has the face of :class:`tests.support.s3server.S3Server` (``endpoint``, ``create_bucket``,
``boto3_client``, ``s3fs``), so a test does not care which server it got. The S3 user's keys are the suite's
dummy ones (:data:`tests.support.s3server.DUMMY_KEY`): RGW checks every signature for real, so only they work.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager

from tests.support.s3server import DUMMY_KEY, DUMMY_SECRET, Clients

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "rgw.sh")
MODE_ENV = "TRAINPROOF_TEST_RGW"
STATE_ENV = "TRAINPROOF_TEST_RGW_STATE"
OWNER_ENV = "TRAINPROOF_TEST_RGW_OWNER"
START_TIMEOUT = 1200  # the first start may install packages (apt waits up to 600 s for another apt's lock)


class Unavailable(RuntimeError):
    """The gateway could not be started here; the message says why (one line)."""


class RGWServer(Clients):
    """A running gateway: ``endpoint`` is ``http://127.0.0.1:PORT``; buckets are made with the suite's keys."""

    def __init__(self, endpoint: str, state_dir: str, started_s: float = 0.0) -> None:
        self.endpoint = endpoint
        self.state_dir = state_dir
        self.started_s = started_s
        """Seconds the start took in this session (0 for a worker that found it running)."""

    def __repr__(self) -> str:
        return f"RGWServer({self.endpoint!r})"


def mode() -> str:
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "1", "require", "0"):
        raise ValueError(f"{MODE_ENV} must be auto (or 1), require or 0, got {value!r}")
    return "auto" if value == "1" else value


def prepare_session() -> str | None:
    """In the controlling process: a fresh state folder for this session's gateway, handed to the workers through
    the environment (they inherit it). None when an outer session already set one (reuse its gateway)."""
    if os.environ.get(STATE_ENV):
        return None
    state = tempfile.mkdtemp(prefix="trainproof-rgw-")
    os.environ[STATE_ENV] = state
    os.environ[OWNER_ENV] = str(os.getpid())
    return state


def end_session(state: str) -> None:
    """Stop this session's gateway (if one was started) and delete its folder."""
    rgw_dir = os.path.join(state, "rgw")
    if os.path.exists(os.path.join(rgw_dir, "pids")):
        subprocess.run(["bash", SCRIPT, "stop"], env={**os.environ, "RGW_DIR": rgw_dir},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=False)
    shutil.rmtree(state, ignore_errors=True)


@contextmanager
def _locked(path: str):
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def session_server() -> RGWServer:
    """This session's gateway, started by the first caller; Unavailable (the reason) when it cannot run here."""
    state = os.environ.get(STATE_ENV)
    if not state:  # outside a pytest session set up by tests/conftest.py (a bench script): a private folder
        state = prepare_session() or os.environ[STATE_ENV]
    os.makedirs(state, exist_ok=True)
    rgw_dir, failed = os.path.join(state, "rgw"), os.path.join(state, "unavailable")
    with _locked(os.path.join(state, "lock")):
        if os.path.exists(failed):  # another worker tried already: do not pay the start again
            with open(failed) as fh:
                raise Unavailable(fh.read().strip())
        if mode() == "0":
            with open(failed, "w") as fh:
                fh.write(f"{MODE_ENV}=0")
            raise Unavailable(f"{MODE_ENV}=0")
        env_file = os.path.join(rgw_dir, "env")
        if os.path.exists(env_file) and _alive(rgw_dir):
            return RGWServer(_read_env(env_file)["RGW_ENDPOINT"], rgw_dir)
        try:
            return _start(rgw_dir)
        except Unavailable as exc:
            with open(failed, "w") as fh:
                fh.write(str(exc))
            raise


def session_summary(state: str) -> str | None:
    """One line for the end of the session: whether the S3 tests had a gateway, and how long it took to start."""
    failed, started = os.path.join(state, "unavailable"), os.path.join(state, "started")
    if os.path.exists(failed):
        with open(failed) as fh:
            return f"S3 tests skipped: {fh.read().strip()}"
    if os.path.exists(started):
        with open(started) as fh:
            return f"S3 tests ran against a Ceph RADOS Gateway on loopback, started in {fh.read().strip()} s"
    return None


def _start(rgw_dir: str) -> RGWServer:
    problem = _cannot_run()
    if problem:
        raise Unavailable(problem)
    env = {**os.environ, "RGW_DIR": rgw_dir, "RGW_ACCESS_KEY": DUMMY_KEY, "RGW_SECRET_KEY": DUMMY_SECRET}
    owner = os.environ.get(OWNER_ENV)
    if owner:
        env["RGW_OWNER_PID"] = owner
    started, why = time.monotonic(), ""
    for _ in range(2):  # a free port picked by the script can be taken before the daemon binds it: once more
        try:
            out = subprocess.run(["bash", SCRIPT, "start"], env=env, capture_output=True, text=True,
                                 timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            why = f"scripts/rgw.sh start took over {START_TIMEOUT} s"
            break
        if out.returncode == 0:
            values = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
            took = time.monotonic() - started
            with open(os.path.join(os.path.dirname(rgw_dir), "started"), "w") as fh:
                fh.write(f"{took:.1f}\n")
            return RGWServer(values["RGW_ENDPOINT"], rgw_dir, took)
        errors = [ln for ln in out.stderr.splitlines() if "error:" in ln]
        why = (errors[-1] if errors else (out.stderr.strip().splitlines() or ["no output"])[-1]).strip()
        if "already in use" not in why:
            break
    subprocess.run(["bash", SCRIPT, "stop"], env=env, capture_output=True, timeout=120, check=False)
    raise Unavailable(f"scripts/rgw.sh could not start a Ceph RADOS Gateway here: {why}")


def _cannot_run() -> str | None:
    """Why the script cannot work on this machine, when that is known without trying."""
    if not os.path.exists("/proc") or shutil.which("bash") is None or shutil.which("curl") is None:
        return "the Ceph RADOS Gateway needs Linux with bash and curl"
    if all(shutil.which(b) for b in ("radosgw", "ceph-mon", "ceph-osd")):
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return ("radosgw, ceph-mon and ceph-osd are not installed and cannot be installed here (needs root and "
                "apt-get: apt-get install --no-install-recommends radosgw ceph-mon ceph-osd)")
    return None


def _alive(rgw_dir: str) -> bool:
    out = subprocess.run(["bash", SCRIPT, "status"], env={**os.environ, "RGW_DIR": rgw_dir},
                         capture_output=True, timeout=60, check=False)
    return out.returncode == 0


def _read_env(path: str) -> dict[str, str]:
    with open(path) as fh:
        return dict(line.strip().split("=", 1) for line in fh if "=" in line)


@contextmanager
def bench_endpoint():
    """For a benchmark run by hand: the S3 endpoint in ``AWS_ENDPOINT_URL``, else a gateway of its own (started
    here, with dummy credentials in the environment, stopped on exit)."""
    from tests.support.s3server import dummy_aws_env

    own = None
    if not os.environ.get("AWS_ENDPOINT_URL"):
        os.environ.update(dummy_aws_env())
        own = prepare_session()
        os.environ["AWS_ENDPOINT_URL"] = session_server().endpoint
    try:
        yield os.environ["AWS_ENDPOINT_URL"]
    finally:
        if own:
            end_session(own)



@contextmanager
def bench_bucket(bucket: str):
    """:func:`bench_endpoint`, with ``bucket`` created there when it is missing: the endpoint."""
    import boto3

    with bench_endpoint() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint)
        if bucket not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
            client.create_bucket(Bucket=bucket)
        yield endpoint
