"""The metrics a person watches during a long run: TensorBoard event files of every step, read back with
TensorBoard's own reader, through a resume; a planted name where they go never stops a run."""

from __future__ import annotations

import pytest

from tests.test_train_helpers import run


def _scalars(folder) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer().AddRunsFromDirectory(str(folder))
    mux.Reload()
    out: dict[str, dict[int, float]] = {}
    for run_name, tags in mux.Runs().items():
        for tag in tags["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in mux.Scalars(run_name, tag)})
    return out


def test_tensorboard_shows_every_step_of_a_resumed_run(tmp_path):
    pytest.importorskip("tensorboard")
    store = tmp_path / "run"
    first = run(store, "--max-steps", "6", "--checkpoint-every", "3", "--keep", "1")
    second = run(store, "--max-steps", "12", "--checkpoint-every", "3", "--keep", "1")
    assert first.code == second.code == 0, first.stderr + second.stderr
    logged = {e["step"]: e for r in (first, second) for e in r.events if e.get("event") == "step"}
    shown = _scalars(store / "tensorboard")
    assert sorted(shown["train/loss"]) == list(range(1, 13)) == sorted(logged)
    for step, event in logged.items():
        assert shown["train/loss"][step] == pytest.approx(event["loss"], rel=1e-6)  # float32 in the event file
        assert shown["train/lr"][step] == pytest.approx(event["lr"], rel=1e-6)
        assert shown["train/steps_per_s"][step] > 0
    assert len(list((store / "tensorboard").iterdir())) == 2  # one file a process: a resume never rewrites one


def test_a_name_planted_where_event_files_go_never_stops_the_run(tmp_path):
    store = tmp_path / "run"
    store.mkdir()
    (store / "tensorboard").write_text("not a folder")
    result = run(store, "--max-steps", "3")
    assert result.code == 0 and "no TensorBoard event files" in result.stderr, result.stderr
    off = run(tmp_path / "off", "--max-steps", "2", "--tensorboard", "off")
    assert off.code == 0 and not (tmp_path / "off" / "tensorboard").exists()


def _export(store) -> dict:
    import json
    import subprocess
    import sys

    from tests.support.timing import budget
    from tests.test_train_helpers import ROOT, train_env

    result = subprocess.run([sys.executable, "-m", "trainproof", "export", "--store", str(store)], cwd=ROOT,
                            env=train_env(), capture_output=True, text=True, timeout=budget(300))
    assert result.returncode == 0, result.stderr
    (bundle,) = (store / "exports").glob("step-*/")
    assert (bundle / "loss.png").exists()
    return json.loads((bundle / "metrics.json").read_text())["history"]


def test_the_metrics_history_outlives_retention(tmp_path):
    """--keep 2 over 500 steps, a commit every 50: the generations of steps 1-450 are deleted, yet every step's
    loss is still in the run (each generation's rows kept under history/, chain-checked) and the export's curve
    covers steps 1-500."""
    from tests.test_train_helpers import load_state

    store = tmp_path / "run"
    result = run(store, "--max-steps", "500", "--checkpoint-every", "50", "--keep", "2")
    assert result.code == 0, result.stderr
    assert sorted(p.name for p in store.glob("step-*")) == ["step-00000450", "step-00000500"]
    logged = {e["step"]: e["loss"] for e in result.events if e.get("event") == "step"}
    state = load_state(store, history="full")
    steps, losses = state["history"]["step"].tolist(), state["history"]["loss"].tolist()
    assert list(steps) == list(range(1, 501)) and dict(zip(steps, losses)) == logged  # bit for bit
    covered = _export(store)
    assert covered["complete"] and covered["first_step"] == 1 and covered["last_step"] == 500, covered


def test_a_planted_kept_copy_shortens_the_curve_and_never_fails_the_export(tmp_path):
    """Another run's rows put where this run keeps its own (anyone with the bucket's keys could): the chain check
    refuses them, the curve starts after them, the export succeeds."""
    import json
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    for store, seed in ((a, "1"), (b, "2")):
        assert run(store, "--max-steps", "100", "--checkpoint-every", "20", "--keep", "1", "--seed", seed).code == 0
    from trainproof.storage import open_store

    contract = json.loads((a / "plan.json").read_text())["contract"]
    shutil.rmtree(a / "history" / "step-00000040")  # committed again, with run b's rows under run a's contract
    rows = (b / "history" / "step-00000040" / "history.pt").read_bytes()
    open_store(str(a)).child("history").commit(40, {"history.pt": rows}, contract=contract, world=1, code_version="x")
    covered = _export(a)
    assert not covered["complete"] and covered["first_step"] == 41 and "not this run's" in covered["stopped"]
