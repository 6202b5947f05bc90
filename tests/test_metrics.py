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
