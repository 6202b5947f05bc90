"""``verify --audit`` of a run with a forged far-future generation: no replay of millions of steps."""

from __future__ import annotations

from trainproof.format.state import STATE_FILE
from trainproof.storage import open_store
from tests.support.timing import budget
from tests.test_train_helpers import run
from tests.test_verify_helpers import cli  # noqa: F401  (a fixture)


def test_a_forged_far_generation_does_not_buy_a_huge_replay(cli, tmp_path):
    store = tmp_path / "run"
    assert run(store, "--max-steps", "4", "--checkpoint-every", "2", "--keep", "0").code == 0
    s = open_store(str(store))
    manifest = s.load(4).info.manifest
    s.commit(99_999_999, {STATE_FILE: s.load(4).files[STATE_FILE]}, contract=manifest["contract"], world=1,
             code_version=manifest["code_version"], digests={"state": STATE_FILE})
    result = cli("verify", "--store", str(store), "--audit", "--id", "forged")
    assert result.exit_code == 2, result.output
    assert "would replay 99999995 steps (4 -> 99999999)" in " ".join(result.stderr.split())
    # the cap is the run's own plan's: a replay within it is still accepted on request
    result = cli("verify", "--store", str(store), "--audit", "--from", "2", "--to", "4", "--id", "ok")
    assert result.exit_code == 0, result.output + result.stderr


def test_the_audit_writes_only_its_results_no_probe_no_delete(s3_server, s3_env, tmp_path):
    """Run through a proxy that records every request: the audit (a real process) reads the run, writes only under
    ``<run>/verification/``, creates no create-only probe object and deletes nothing — what the audit
    CronJob's read-mostly credentials (infra/iam/audit-policy.json) allow."""
    import os
    import subprocess
    import sys

    from tests.support.faultproxy import FaultProxy
    from tests.test_train_helpers import ROOT, train_env

    store = f"s3://{s3_env}/runs/audited"
    assert run(store, "--max-steps", "4", "--checkpoint-every", "2", "--keep", "0").code == 0
    with FaultProxy(s3_server.endpoint) as proxy:
        env = {**train_env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        result = subprocess.run([sys.executable, "-m", "trainproof", "verify", "--store", store, "--audit", "--id", "a1"],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget(600))
        events = list(proxy.events)
    assert result.returncode == 0, result.stderr
    writes = [e for e in events if e.method in ("PUT", "POST", "DELETE")]
    assert writes, "the proxy saw no write at all: the audit did not go through it"
    assert not [e for e in writes if ".trainproof-probe" in e.target], writes
    assert not [e for e in writes if e.method == "DELETE"], writes
    # Its results under verification/a1/, and verification/audited.json (the span it proved, which retention
    # reads): nothing outside verification/, which is all the audit policy lets it write.
    outside = [e for e in writes if f"/{s3_env}/runs/audited/verification/a1/" not in e.target
               and not e.target.endswith(f"/{s3_env}/runs/audited/verification/audited.json")]
    assert not outside, outside
    assert os.environ.get("TRAINPROOF_S3_CREATE_ONLY") is None
