"""``verify``'s ``live_vs_restored`` check (issue 38, item 1): what the continuous process had in memory at a cut equals
what the resumed process restored, exactly, component by component.

A save bug in every generation (the GradScaler's growth tracker saved as 0, injected by the test wrapper
tests/support/hooked.py, never in the product; a task whose ``state_dict()`` saves a stale counter) makes every stored
state agree with every other: only the live state shows it. Each broken run exits 1 naming ``live_vs_restored`` and
the component; its correct twin passes. Real ``python -m trainproof verify`` processes, on the cheapest settings (one
cut, no objective check, no export).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.test_verify_helpers import read_report, trainproof

SCALED = '''
    from trainproof.tasks.regression import RegressionConfig, RegressionTask


    class Scaled(RegressionTask):
        precision = "fp16"  # float16 autocast with a GradScaler, on the CPU too


    def factory(config):
        return Scaled(RegressionConfig())
'''

COUNTING = '''
    import torch

    from trainproof.tasks.regression import RegressionConfig, RegressionTask


    class Counting(RegressionTask):
        """Counts its loss computations (a warm-up a thousand steps away would read it) and checkpoints the count;
        the broken one saves the count it started with instead of the one it reached."""

        def __init__(self, broken):
            super().__init__(RegressionConfig())
            self.broken, self.calls, self.first = broken, 0, 0

        def loss_sum(self, model, batch):
            self.calls += 1
            return super().loss_sum(model, batch)

        def state_dict(self):
            return {"calls": torch.tensor(self.first if self.broken else self.calls)}

        def load_state_dict(self, state):
            self.calls = int(state["calls"]) if state else 0
            if self.broken:
                self.first = self.calls


    def factory(config):
        return Counting(config.get("broken", False))
'''


def _verify(tmp_path, module: str, source: str, config: dict | None = None, env: dict | None = None):
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    store = str(tmp_path / "run")
    args = ["--config", str(tmp_path / "cfg.json")] if config is not None else []
    if config is not None:
        (tmp_path / "cfg.json").write_text(json.dumps(config))
    result = trainproof("verify", "--store", store, "--task", f"{module}:factory", *args, "--id", "v", "--no-export",
                        "--cuts", "5", "--no-objective-check", env={"PYTHONPATH": str(tmp_path), **(env or {})})
    return result, read_report(store, "v")


@pytest.mark.parametrize("broken", [True, False], ids=["tracker-saved-as-0", "correct"])
def test_a_grad_scaler_saved_with_its_tracker_at_0_fails_live_vs_restored(tmp_path, broken):
    """Every generation (the continuous path's too) holds a growth tracker of 0: the stored states agree, the
    trajectories only part after 2 000 steps. The resumed process restored 0 where the continuous one had 5."""
    result, report = _verify(tmp_path, "scaled", SCALED, env={"TPHOOK_SAVE_BUG": "scaler_tracker"} if broken else None)
    out = " ".join(result.stdout.split())
    live = report["live_vs_restored"]
    assert live["components"]["grad_scaler"] >= 5 and report["exercised"]["resume"]["grad_scaler"] is True
    assert {c["path"]: c["step"] for c in live["compared"]} == {"resume": 5, "resume_without_rng": 5}
    if not broken:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert report["live_vs_restored_passed"] is True and report["live_vs_restored_negative_detected"] is True
        assert "live_vs_restored_passed: true" in out
        return
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    # Every stored state agrees: only the live state catches it.
    assert report["positive"] is True and report["cut_checkpoint_ok"] is True
    assert report["failing_checks"] == ["live_vs_restored.grad_scaler"], report["failing_checks"]
    row = next(c for c in report["checks"]["live_vs_restored"] if c["name"] == "grad_scaler")
    assert row["detail"] == "grad_scaler._growth_tracker differs at step 5 (resume: live int 5 vs restored int 0)"
    assert row["first_step"] == 5 and row["max_abs_diff"] == 5.0
    assert "live_vs_restored.grad_scaler" in out and "grad_scaler._growth_tracker differs at step 5" in out


@pytest.mark.parametrize("broken", [True, False], ids=["stale-count", "correct"])
def test_a_task_that_saves_a_stale_counter_fails_on_its_attributes(tmp_path, broken):
    """The task's ``state_dict()`` saves the count it started with: stored task states agree on every path (0), the
    live task object counted 5 loss computations, the restored one 0."""
    result, report = _verify(tmp_path, "counting", COUNTING, {"broken": broken})
    if not broken:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert report["live_vs_restored_passed"] is True and report["live_vs_restored"]["components"]["task_state"]
        return
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["positive"] is True
    assert report["failing_checks"] == ["live_vs_restored.task_attributes"], report["failing_checks"]
    assert any("task_attributes.calls differs at step 5 (resume: live int 5 vs restored int 0)" in line
               for line in report["diagnosis"]), report["diagnosis"]
