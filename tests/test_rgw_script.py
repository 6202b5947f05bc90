"""``scripts/rgw.sh``, the throw-away Ceph RADOS Gateway the suite's S3 tests run against: a second one starts
beside the session's (its own folder and ports), answers signed requests, and is stopped and deleted once the
process that owns it is gone; a taken port is refused before anything starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.timing import budget
from tests.support import rgw
from tests.test_infra import tool

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts" / "rgw.sh")


def _script(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT, *args], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=rgw.START_TIMEOUT)


def _ceph_daemons_in(folder: str) -> list[int]:
    """Pids of ceph daemons whose command line names ``folder`` (their --conf / CEPH_CONF)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if comm in ("ceph-mon", "ceph-osd", "radosgw") and folder.encode() in environ:
            found.append(int(pid))
    return found


def test_the_script_passes_shellcheck():
    out = subprocess.run([tool("shellcheck"), "--severity=style", SCRIPT], capture_output=True, text=True, timeout=budget(60))
    assert out.returncode == 0, out.stdout


def test_a_taken_port_is_refused_before_anything_starts(s3_server, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = _script("start", RGW_DIR=str(tmp_path / "rgw"), RGW_PORT=str(taken.getsockname()[1]), RGW_NO_INSTALL="1")
    assert out.returncode == 1 and "already in use" in out.stderr, out.stderr
    assert not (tmp_path / "rgw").exists()


def test_a_second_gateway_runs_beside_the_sessions_and_goes_with_its_owner(s3_server, tmp_path):
    owner = subprocess.Popen(["sleep", "600"])
    folder = str(tmp_path / "rgw")
    try:
        out = _script("start", RGW_DIR=folder, RGW_OWNER_PID=str(owner.pid), RGW_NO_INSTALL="1",
                      RGW_ACCESS_KEY="second", RGW_SECRET_KEY="second-secret")
        assert out.returncode == 0, out.stderr[-3000:]
        values = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
        assert values["RGW_ENDPOINT"] != s3_server.endpoint
        client = rgw.RGWServer(values["RGW_ENDPOINT"], folder).boto3_client(key="second", secret="second-secret")
        client.create_bucket(Bucket="second")
        client.put_object(Bucket="second", Key="k", Body=b"v")
        assert client.get_object(Bucket="second", Key="k")["Body"].read() == b"v"
        assert _script("status", RGW_DIR=folder).returncode == 0
        assert _ceph_daemons_in(folder)
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 60
    while (_ceph_daemons_in(folder) or os.path.exists(folder)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ceph_daemons_in(folder) and not os.path.exists(folder)
    s3_server.create_bucket()  # the session's gateway was left alone


@pytest.mark.parametrize("value", ["maybe", "yes"])
def test_a_bad_mode_is_named(value, monkeypatch):
    monkeypatch.setenv(rgw.MODE_ENV, value)
    with pytest.raises(ValueError, match=rgw.MODE_ENV):
        rgw.mode()


@pytest.mark.parametrize("mode, outcome", [("auto", "1 skipped"), ("require", "1 error")])
def test_where_no_gateway_can_start_the_s3_tests_skip_saying_why_or_fail_when_required(mode, outcome, tmp_path):
    """A session whose gateway could not start (recorded by the first worker that tried) skips every S3 test with
    the reason; ``TRAINPROOF_TEST_RGW=require`` (CI on machines that can run it) fails them instead."""
    (tmp_path / "unavailable").write_text("radosgw is not installed and cannot be installed here (simulated)")
    env = {**os.environ, rgw.STATE_ENV: str(tmp_path), rgw.MODE_ENV: mode}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider", "-n", "0",
                          "tests/test_storage_contract.py::test_empty_store_has_no_latest[s3]"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget(300))
    assert outcome in out.stdout, out.stdout[-3000:]
    assert "(simulated)" in out.stdout
    assert ("TRAINPROOF_TEST_RGW=require but" in out.stdout) == (mode == "require")
