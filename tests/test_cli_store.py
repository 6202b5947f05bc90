"""`trainproof ls` / `trainproof gc` through the real entry point, and their one-line errors (exit 2)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time


from trainproof.storage import open_store
from tests.support.timing import budget
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.s3server import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tp(*args, env=None, timeout=budget(120)):
    """Run `python -m trainproof ARGS` as a user would."""
    full_env = dict(os.environ if env is None else env)
    return subprocess.run([sys.executable, "-m", "trainproof", *args], cwd=ROOT, capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def commit(store, step, contract="c"):
    store.commit(step, {"training_state.pt": b"s" * (100 + step)}, contract=contract, world=1, code_version="t")


def test_ls_json_reports_every_status_and_quarantine(tmp_path):
    url = str(tmp_path / "run")
    store = open_store(url)
    commit(store, 1)
    commit(store, 2)
    store.backend.write(f"{store.root}/step-00000003/training_state.pt", b"partial")
    store.quarantine(1, "test reason")
    result = tp("ls", "--store", url, "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [(g["name"], g["status"]) for g in doc["generations"]] == [
        ("step-00000002", "complete"), ("step-00000003", "incomplete")]
    assert doc["newest_complete_step"] == 2 and doc["latest_hint"] == "step-00000002"
    assert doc["quarantined"][0]["reason"] == "test reason"
    table = tp("ls", "--store", url, env={**os.environ, "COLUMNS": "80"})
    assert "step-00000003" in table.stdout and "incomplete" in table.stdout and "quarantined" in table.stdout
    assert doc["quarantined"][0]["name"].startswith("quarantine/step-00000001-")
    assert doc["quarantined"][0]["name"] in table.stdout  # the full name, on one line


def test_ls_shows_what_was_quarantined_beside_an_occupied_quarantine(tmp_path):
    """`quarantine` planted as a file: a generation is moved into a fresh quarantine-<id>/, which ls lists too."""
    url = str(tmp_path / "run")
    store = open_store(url)
    for step in (1, 2):
        commit(store, step)
    store.quarantine(2, "first")
    (tmp_path / "run" / "quarantine").rename(tmp_path / "run" / "kept")
    (tmp_path / "run" / "quarantine").write_bytes(b"x")
    store.quarantine(1, "second")
    doc = json.loads(tp("ls", "--store", url, "--json").stdout)
    [(name, reason)] = [(q["name"], q["reason"]) for q in doc["quarantined"]]
    assert re.fullmatch(r"quarantine-[0-9a-f]{8}/step-00000001-.*", name) and reason == "second"


def test_ls_shows_exports_verdicts_and_why_older_generations_are_kept(tmp_path):
    url = str(tmp_path / "run")
    store = open_store(url)
    for step in range(1, 7):  # 1-3 a fresh start, 4-6 written by a process that resumed from 3
        store.commit(step, {"training_state.pt": b"s" * 10}, contract="c", world=1, code_version="t",
                     extra={"resumed_from": None if step <= 3 else 3})
    store.child("exports").commit(6, {"model_bf16.pt": b"m"}, contract="c", world=1, code_version="t")
    base = store.child("verification")
    base.child("v1").write_file("verification.json", json.dumps({"created_at": "2026-01-01", "verdict": "PASSED"})
                                .encode())
    commit(base.child("v2").child("continuous"), 1)  # no report: running or abandoned
    base.child("v3").write_file("verification.json", b"[1, 2]")  # planted, not a report: shown as none
    doc = json.loads(tp("ls", "--store", url, "--json").stdout)
    assert [g["step"] for g in doc["generations"] if g["kept_for_audit"]] == [2, 3]  # the restore point, the one before
    assert [e["step"] for e in doc["exports"]] == [6]
    assert {v["id"]: v["verdict"] for v in doc["verifications"]} == {"v1": "PASSED", "v2": None, "v3": None}
    table = tp("ls", "--store", url, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "no audit has passed" in table and "exports: step-00000006" in table and "v1 PASSED" in table, table
    base.child("a1").write_file("verification.json", json.dumps(
        {"kind": "audit", "verdict": "PASSED", "settings": {"from": 2, "to": 6}}).encode())
    base.write_file("audited.json", json.dumps({"from": 2, "to": 6, "passed": True, "id": "a1"}).encode())
    assert not any(g["kept_for_audit"] for g in json.loads(tp("ls", "--store", url, "--json").stdout)["generations"])


def test_gc_keeps_the_newest_and_dry_run_deletes_nothing(tmp_path):
    url = str(tmp_path / "run")
    store = open_store(url)
    for step in (1, 2, 3, 4):
        commit(store, step)
    dry = tp("gc", "--store", url, "--keep", "2", "--dry-run")
    assert dry.returncode == 0 and "would delete step-00000001" in dry.stdout
    assert "would keep the 2 newest complete" in dry.stdout and "kept" not in dry.stdout
    assert len(store.scan()) == 4
    real = tp("gc", "--store", url, "--keep", "1")
    assert real.returncode == 0, real.stderr
    assert [g.step for g in store.scan()] == [4]


def test_gc_keeps_the_generations_around_a_restore_point_until_an_audit_passed_across_it(tmp_path):
    url = str(tmp_path / "run")
    store = open_store(url)
    for step in range(1, 9):  # 1-3 a fresh start, 4-6 resumed from 3, 7-8 resumed from 6 (the newest two record 6)
        restored = None if step <= 3 else (3 if step <= 6 else 6)
        store.commit(step, {"training_state.pt": b"s" * (100 + step)}, contract="c", world=1, code_version="t",
                     extra={"resumed_from": restored})
    real = tp("gc", "--store", url, "--keep", "2")
    assert real.returncode == 0, real.stderr
    assert [g.step for g in store.scan()] == [5, 6, 7, 8]
    assert "and 2 around restore points no audit has passed (step-00000005, step-00000006)" in real.stdout
    store.child("verification").child("a1").write_file("verification.json", json.dumps(
        {"kind": "audit", "verdict": "PASSED", "settings": {"from": 5, "to": 8}}).encode())
    store.child("verification").write_file("audited.json", json.dumps({"from": 5, "to": 8, "passed": True,
                                                                       "id": "a1"}).encode())
    again = tp("gc", "--store", url, "--keep", "2")
    assert again.returncode == 0 and "around restore points" not in again.stdout, again.stdout + again.stderr
    assert [g.step for g in store.scan()] == [7, 8]


def test_gc_keep_verifications_removes_only_older_verifications(tmp_path):
    url = str(tmp_path / "run")
    store = open_store(url)
    for step in (1, 2):
        commit(store, step)
    store.child("exports").commit(2, {"model_bf16.pt": b"m"}, contract="c", world=1, code_version="t")
    base = store.child("verification")
    for i, vid in enumerate(("a", "b", "c")):  # oldest first
        v = base.child(vid)
        commit(v.child("continuous"), 1)
        v.write_file("verification.json", json.dumps({"created_at": f"2026-01-0{i + 1}T00:00:00+00:00"}).encode())
    commit(base.child("running").child("continuous"), 1)  # no report yet: never removed
    dry = tp("gc", "--store", url, "--keep-verifications", "1", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would remove verification/a" in dry.stdout and "would remove verification/b" in dry.stdout
    assert "would keep 1 with a report and 1 without one" in dry.stdout
    assert {e.name for e in base.list_dir()} == {"a", "b", "c", "running"}
    real = tp("gc", "--store", url, "--keep-verifications", "1")
    assert real.returncode == 0, real.stderr
    assert {e.name for e in base.list_dir()} == {"c", "running"}
    assert [g.step for g in store.scan()] == [1, 2] and [g.step for g in store.child("exports").scan()] == [2]
    assert tp("gc", "--store", url).returncode == 2  # neither --keep nor --keep-verifications


def test_gc_orders_verifications_by_when_the_store_wrote_them_never_by_what_a_report_claims(tmp_path):
    """Planted reports dated in the future do not push the genuine newest audit out; a 100 000-deep report and one
    with a numeric date are counted as no report, with no traceback; the newest genuine one stays."""
    url = str(tmp_path / "run")
    store = open_store(url)
    commit(store, 1)
    base = store.child("verification")
    now = time.time()
    reports = {
        "genuine-old": json.dumps({"created_at": "2026-01-01T00:00:00+00:00", "verdict": "PASSED"}).encode(),
        "planted-future-1": json.dumps({"created_at": "2999-01-01T00:00:00+00:00", "verdict": "PASSED"}).encode(),
        "planted-future-2": json.dumps({"created_at": "2999-01-02T00:00:00+00:00", "verdict": "PASSED"}).encode(),
        "planted-deep": b"[" * 100_000 + b"]" * 100_000,
        "planted-numeric": json.dumps({"created_at": 99999999999, "verdict": 1}).encode(),
        "genuine-new": json.dumps({"created_at": "2026-01-02T00:00:00+00:00", "verdict": "PASSED"}).encode(),
    }
    for age, (vid, raw) in zip(range(len(reports), 0, -1), reports.items()):
        base.child(vid).write_file("verification.json", raw)
        os.utime(tmp_path / "run" / "verification" / vid / "verification.json", (now - 60 * age, now - 60 * age))
    listed = {v["id"]: v for v in json.loads(tp("ls", "--store", url, "--json").stdout)["verifications"]}
    assert listed["planted-numeric"]["verdict"] is None and listed["planted-deep"]["created_at"] is None
    result = tp("gc", "--store", url, "--keep-verifications", "1")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    left = {e.name for e in base.list_dir()}
    assert "genuine-new" in left and not {"planted-future-1", "planted-future-2", "genuine-old"} & left, left
    assert "planted-deep" in left  # no readable report: like a running one, only --abandoned-hours removes it


def test_gc_abandoned_hours_removes_only_verifications_left_without_a_report(tmp_path):
    """A verification that died before its report is removed once nothing under it was written for the stated
    age; one still running (recent writes), and every one with a report, stay."""
    url = str(tmp_path / "run")
    store = open_store(url)
    commit(store, 1)
    base = store.child("verification")
    for vid in ("abandoned", "running", "reported"):
        commit(base.child(vid).child("continuous"), 1)
    base.child("reported").write_file("verification.json", json.dumps({"created_at": "2026-01-01"}).encode())
    two_days_ago = time.time() - 48 * 3600
    for folder in ("abandoned", "reported"):
        for path in (tmp_path / "run" / "verification" / folder).rglob("*"):
            os.utime(path, (two_days_ago, two_days_ago))
    result = tp("gc", "--store", url, "--abandoned-hours", "24")
    assert result.returncode == 0, result.stderr
    assert "removed verification/abandoned" in result.stdout, result.stdout
    assert {e.name for e in base.list_dir()} == {"running", "reported"} and [g.step for g in store.scan()] == [1]


def test_keep_every_keeps_a_permanent_series_that_ls_shows_and_gc_keeps(tmp_path):
    """A real run commits every 3 steps with --keep 2 --keep-every 10: its own retention keeps the first generation
    at or after each multiple of 10 (12, 21, 30, 42; none lands on one) besides the 2 newest; `ls` marks them, `gc`
    keeps them under the rule the run recorded, and only `--keep-every off` would let them go."""
    from tests.test_train_helpers import run

    url = str(tmp_path / "run")
    done = run(url, "--max-steps", "45", "--checkpoint-every", "3", "--keep", "2", "--keep-every", "10")
    assert done.code == 0, done.stderr
    store = open_store(url)
    assert [g.step for g in store.scan()] == [12, 21, 30, 42, 45]
    listed = tp("ls", "--store", url, "--json")
    doc = json.loads(listed.stdout)
    assert doc["keep_every"] == "10"
    assert [g["step"] for g in doc["generations"] if g["permanent"]] == [12, 21, 30, 42]
    assert "permanent (--keep-every 10)" in tp("ls", "--store", url).stdout
    kept = tp("gc", "--store", url, "--keep", "1")
    assert kept.returncode == 0 and "the permanent series (--keep-every 10)" in kept.stdout, kept.stdout + kept.stderr
    assert [g.step for g in store.scan()] == [12, 21, 30, 42, 45]
    off = tp("gc", "--store", url, "--keep", "1", "--keep-every", "off", "--dry-run")
    assert [ln.split()[2] for ln in off.stdout.splitlines() if ln.startswith("would delete step")] == [
        f"step-{s:08d}" for s in (12, 21, 30, 42)]
    _assert_one_line_exit_2(tp("gc", "--store", url, "--keep", "1", "--keep-every", "6x"), "--keep-every", "6h")
    _assert_one_line_exit_2(tp("train", "--store", url, "--keep-every", "0"), "--keep-every",
                            "a step count (1000) or a duration (90s, 10m, 6h")


def test_gc_refuses_keep_zero(tmp_path):
    result = tp("gc", "--store", str(tmp_path), "--keep", "0")
    assert result.returncode == 2


def _assert_one_line_exit_2(result, *needles):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("trainproof: error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_bucket_is_one_line_exit_2(s3_env):
    result = tp("ls", "--store", "s3://no-such-bucket-here/run")
    _assert_one_line_exit_2(result, "no-such-bucket-here", "does not exist")


def test_unreachable_endpoint_is_retried_then_exit_1_never_2(s3_env):
    """A MinIO pod still starting looks like this: retrying can help, so a Job must not be failed for good."""
    env = dict(os.environ, AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}")
    result = tp("ls", "--store", f"s3://{s3_env}/run", env=env)
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("trainproof: error:")]
    assert len(lines) == 1 and "cannot reach" in lines[0] and "127.0.0.1" in lines[0], result.stderr
    assert "Error" not in lines[0], lines[0]  # what happened, not the exception classes it went through
    # The documented budget (docs/storage.md: 6 attempts, 120 s), not a shorter one: a pod still starting needs it.
    assert result.stderr.count("retrying check bucket") == 5 and "Traceback" not in result.stderr
    assert "attempt 5/6" in result.stderr, result.stderr


def test_refused_credentials_are_one_line_exit_2_and_never_printed(s3_server, s3_env):
    with FaultProxy(s3_server.endpoint) as proxy:
        proxy.set_faults([Fault(kind="forbidden", code="InvalidAccessKeyId",
                                message="The AWS Access Key Id you provided does not exist in our records.")])
        env = dict(os.environ, AWS_ENDPOINT_URL=proxy.endpoint, AWS_SECRET_ACCESS_KEY="sekrit-value-123")
        result = tp("ls", "--store", f"s3://{s3_env}/run", env=env)
    _assert_one_line_exit_2(result, "refused (403)")
    assert "sekrit-value-123" not in result.stdout + result.stderr
    assert proxy.stats.injected.get("forbidden", 0) == 1, "a 403 must fail fast, without retries"


def test_bad_url_scheme_is_exit_2():
    _assert_one_line_exit_2(tp("ls", "--store", "ftp://x/y"), "unsupported store URL scheme")


# --- Store URLs are parsed strictly: a typo is one line (exit 2), and nothing is written anywhere ------------------

TYPOS = [("s3//{bucket}/runs/demo", "did you mean s3://{bucket}/runs/demo?"),
         ("s3:/{bucket}/runs/demo", "did you mean s3://{bucket}/runs/demo?"),
         ("s3:{bucket}/runs/demo", "did you mean s3://{bucket}/runs/demo?"),
         ("gs//{bucket}/runs/demo", "for a folder of that name write ./gs//{bucket}/runs/demo"),
         ("gs://{bucket}/runs/demo", "for Google Cloud Storage use its S3 API"),
         ("file://{name}/demo", "did you mean file:///{name}/demo or the folder {name}/demo?")]


def _files_under(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _refused_everywhere(tmp_path, bucket: str, env=None) -> None:
    """Every typo, through `train` and `export --dest` as a user types them from an empty working directory."""
    name = f"tp-typo-{os.getpid()}-{abs(hash(str(tmp_path))) % 10**8}"  # file://NAME/demo once wrote /demo
    assert not os.path.exists(f"/{name}") and not os.path.exists("/demo")
    work = tmp_path / "cwd"
    work.mkdir()
    full_env = dict(os.environ if env is None else env, PYTHONPATH=ROOT)
    for typo, meant in TYPOS:
        url = typo.format(bucket=bucket, name=name)
        for args in (["train", "--store", url, "--max-steps", "1"],
                     ["export", "--store", str(tmp_path / "no-run"), "--dest", url]):
            result = subprocess.run([sys.executable, "-m", "trainproof", *args], cwd=work, env=full_env,
                                    capture_output=True, text=True, timeout=budget(120))
            _assert_one_line_exit_2(result, url, meant.format(bucket=bucket, name=name))
    assert _files_under(work) == [] and not (tmp_path / "no-run").exists()
    assert not os.path.exists(f"/{name}") and not os.path.exists("/demo")


def test_a_mistyped_store_url_on_a_folder_is_one_line_and_writes_nothing(tmp_path):
    _refused_everywhere(tmp_path, "mlteam")


def test_a_mistyped_store_url_with_s3_configured_writes_nothing_to_the_bucket(tmp_path, s3_server, s3_env):
    _refused_everywhere(tmp_path, s3_env)
    assert s3_server.boto3_client().list_objects_v2(Bucket=s3_env).get("KeyCount") == 0


def test_plain_paths_stay_plain(tmp_path):
    """What looks a little like a URL but is written as a path trains where it says."""
    from trainproof.storage.store import url_problem

    for path in ("runs/demo", "runs//demo", "./s3//x", "./runs:v2", str(tmp_path / "s3:" / "x"), "file:///tmp/x",
                 "file://localhost/tmp/x", "s3://b/p", "s3a://b/p", "memory://x/run"):
        assert url_problem(path) is None, path
    result = subprocess.run([sys.executable, "-m", "trainproof", "train", "--store", "./s3//bucket/run",
                             "--max-steps", "1"], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT),
                            capture_output=True, text=True, timeout=budget(300))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "s3" / "bucket" / "run" / "plan.json").exists()


def _unwritable(tmp_path) -> str:
    """A folder this process cannot write: a read-only one for a normal user; under /sys for root (which
    permissions do not stop, and where nothing can be made)."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        return str(locked / "run")
    return f"/sys/trainproof-test-{os.getpid()}/run"


def test_an_unwritable_store_folder_is_one_line_and_exit_2(tmp_path):
    """A read-only or forbidden folder is an operator's mistake (exit 2, its path named, no exception class); a
    reader such as ls still works there."""
    store = _unwritable(tmp_path)
    result = tp("train", "--store", store, "--max-steps", "1")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("trainproof: error: --store ") and "cannot be written" in lines[-1], lines
    assert "Traceback" not in result.stderr and "Error:" not in lines[-1] and not os.path.exists(store)
    assert tp("ls", "--store", store).returncode == 0


def test_store_create_makes_the_bucket_a_run_then_trains_in(s3_server, s3_env, tmp_path):
    """`trainproof store create`: the bucket is made (once: a second call says it exists), access is checked, and
    a run trains there; a bad name is one line, exit 2; a folder is made too."""
    bucket = f"{s3_env}-made"
    url = f"s3://{bucket}/runs/demo"
    first, again = tp("store", "create", url), tp("store", "create", url)
    assert first.returncode == 0 and "created the bucket" in first.stdout, first.stderr
    assert again.returncode == 0 and "the bucket exists" in again.stdout, again.stderr
    s3_server.boto3_client().head_bucket(Bucket=bucket)
    assert tp("train", "--store", url, "--max-steps", "1").returncode == 0
    _assert_one_line_exit_2(tp("store", "create", "s3://Bad_Name/x"), "not a valid bucket name")
    folder = tmp_path / "new" / "run"
    made = tp("store", "create", str(folder))
    assert made.returncode == 0 and "created the folder" in made.stdout and folder.is_dir(), made.stderr
