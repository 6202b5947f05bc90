"""``verify --audit`` of a run with a forged far-future generation: no replay of millions of steps."""

from __future__ import annotations

from job.train.state import STATE_FILE
from storage import open_store
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
