"""A spot interruption notice stops a real training process like SIGTERM: finish the step, commit, exit 75."""

from __future__ import annotations

import time
from pathlib import Path

from tests.support.timing import budget
from tests.test_spot import FakeMetadata
from tests.test_train_helpers import finish, start

HOOKS = {"TPHOOK_STEP_DELAY": "0.02"}


def _wait_for_generation(store: Path, proc, timeout: float = 60) -> None:
    end = time.time() + timeout
    while not list(store.glob("*/COMPLETE.json")):
        assert proc.poll() is None and time.time() < end, "no generation was committed"
        time.sleep(0.05)


def test_aws_notice_commits_and_exits_75(tmp_path):
    meta = FakeMetadata("aws")
    store = tmp_path / "run"
    try:
        proc = start(store, "--task", "regression", "--max-steps", "100000", "--checkpoint-every", "10",
                     "--spot-notice", "aws", "--spot-endpoint", meta.endpoint, "--spot-interval", "0.05",
                     env=HOOKS)
        _wait_for_generation(store, proc)
        meta.arm()
        result = finish(proc, timeout=budget(60))
    finally:
        meta.close()
    assert result.code == 75, result.stderr
    stopped = result.last("stopped")
    assert stopped["reason"] == "spot-notice" and stopped["signals"] == []
    assert "terminate" in stopped["notices"][0]
    assert "spot interruption notice" in result.stderr and "terminate" in result.stderr
    step = stopped["step"]
    assert step < 100000
    assert (store / f"step-{step:08d}" / "COMPLETE.json").exists(), sorted(p.name for p in store.iterdir())
    assert any(r[0] == "GET" and r[1].endswith("spot/instance-action") for r in meta.requests)
