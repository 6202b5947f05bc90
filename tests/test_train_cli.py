"""``trainproof train`` as a user drives it: contract refusals, idempotent targets, environment options,
fallback past a poisoned newest generation, summary.json, and one-line handled failures.

Real ``python -m trainproof train`` processes where the process matters (a run, its environment, its store);
the Typer app in this process (CliRunner) for invocations that fail early or do no training.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.test_train_helpers import finish, history_rows, load_state, parse_events, run_all, start


class _Evil:
    """Stands for any pickled object: weights-only loading must refuse it."""


def _poison_newest(store_dir: Path, step: int) -> None:
    """Commit, through the real store, a generation whose state carries a pickled object."""
    from trainproof.storage import open_store

    store = open_store(str(store_dir))
    plan = json.loads(store.read_file("plan.json"))
    state = load_state(store_dir)
    state["progress"]["step"] = step
    state["meta"]["payload"] = _Evil()
    buf = io.BytesIO()
    torch.save(state, buf)
    store.commit(step, {"training_state.pt": buf.getvalue()}, contract=plan["contract"], world=1,
                 code_version=state["meta"]["code_version"], digests={"state": "training_state.pt"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Real processes: a base run of 10 steps, then variations on copies of it, run side by side."""
    d = tmp_path_factory.mktemp("cli")
    (base,) = run_all((d / "base", "--max-steps", "10"))
    assert base.code == 0, base.stderr
    for name in ("seed", "poisoned"):
        shutil.copytree(d / "base", d / name)
    _poison_newest(d / "poisoned", 11)
    env = {"TRAINPROOF_STORE": str(d / "env"), "TRAINPROOF_MAX_STEPS": "3", "TRAINPROOF_CHECKPOINT_EVERY": "1",
           "TRAINPROOF_KEEP": "2"}
    procs = {
        "seed": start(d / "seed", "--max-steps", "12", "--seed", "99"),
        "poisoned": start(d / "poisoned", "--max-steps", "12"),
        "env": start(None, env=env),
    }
    results = {name: finish(p) for name, p in procs.items()}
    return {"dir": d, "base": base, **results}


@pytest.fixture
def cli():
    """``trainproof train`` in this process through the Typer app (cheap: torch is already imported)."""
    from trainproof.cli import _register, app

    _register()
    runner = CliRunner()
    no_options = {k: None for k in os.environ if k.startswith("TRAINPROOF_")}
    saved = logging.root.handlers[:], logging.root.level
    yield lambda *args: runner.invoke(app, ["train", *args], env=no_options)
    # The command points logging at the runner's (now closed) stderr: give pytest its handlers back.
    logging.root.handlers[:], _ = saved
    logging.root.setLevel(saved[1])


def _copy_of_base(runs, tmp_path: Path) -> Path:
    shutil.copytree(runs["dir"] / "base", tmp_path / "run")
    return tmp_path / "run"


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_another_seed_is_refused_naming_the_field(runs):
    assert runs["seed"].code == 2
    line = _one_line(runs["seed"].stderr)
    assert "seed (stored 1234, now 99)" in line and "new --store" in line


def test_another_task_config_is_refused_naming_the_key(runs, cli, tmp_path):
    store = _copy_of_base(runs, tmp_path)
    (tmp_path / "lr.json").write_text('{"lr": 0.01}')
    result = cli("--store", str(store), "--max-steps", "12", "--config", str(tmp_path / "lr.json"))
    assert result.exit_code == 2
    assert "task_config.lr (stored 0.03, now 0.01)" in _one_line(result.stderr)
    assert not (store / "step-00000011").exists()  # nothing was trained or written


def test_max_steps_is_an_idempotent_target(runs, cli, tmp_path):
    store = _copy_of_base(runs, tmp_path)
    before = (store / "step-00000010" / "COMPLETE.json").read_text()
    result = cli("--store", str(store), "--max-steps", "10")
    assert result.exit_code == 0, result.output
    events = parse_events(result.stdout)
    assert events[-1]["event"] == "done" and events[-1]["step"] == 10
    assert [e["event"] for e in events if e["event"] in ("step", "checkpoint")] == []
    assert (store / "step-00000010" / "COMPLETE.json").read_text() == before  # not rewritten


def test_resume_never_refuses_a_store_with_generations(runs, cli, tmp_path):
    result = cli("--store", str(_copy_of_base(runs, tmp_path)), "--max-steps", "12", "--resume", "never")
    assert result.exit_code == 2
    assert "--resume never" in _one_line(result.stderr)


def test_a_poisoned_newest_generation_is_skipped_loudly_and_quarantined(runs):
    from trainproof.storage import open_store

    r = runs["poisoned"]
    assert r.code == 0, r.stderr
    assert r.last("resume")["step"] == 10  # fell back past step 11
    assert "step-00000011" in r.stderr and "pickled object" in r.stderr
    store = open_store(str(runs["dir"] / "poisoned"))
    assert any(name.startswith("quarantine/step-00000011") for name, _ in store.quarantined())
    final = load_state(runs["dir"] / "poisoned")
    assert final["progress"]["step"] == 12
    assert history_rows(final)[:10] == history_rows(load_state(runs["dir"] / "base"))


def test_options_come_from_trainproof_environment_variables(runs):
    r = runs["env"]
    assert r.code == 0, r.stderr
    assert r.last("done")["step"] == 3
    assert [e["step"] for e in r.events if e["event"] == "checkpoint"] == [1, 2, 3]  # TRAINPROOF_CHECKPOINT_EVERY
    assert sorted(p.name for p in (runs["dir"] / "env").glob("step-*")) == ["step-00000002", "step-00000003"]


def test_summary_json_describes_the_run(runs):
    summary = json.loads((runs["dir"] / "base" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["exit_code"] == 0
    assert summary["step"] == 10 and summary["next_lr"] == 0.00375
    assert [c["step"] for c in summary["checkpoints"]] == [10]
    plan = json.loads((runs["dir"] / "base" / "plan.json").read_text())
    assert summary["contract"] == plan["contract"]
    assert {"task", "task_config", "seed", "world", "objective", "data_identity", "state_schema"} <= set(plan)


# -- configuration errors: no training starts ------------------------------------------------------------

@pytest.mark.parametrize(("args", "message"), [
    (["--max-steps", "3", "--steps", "2"], "not both"),
    (["--max-steps", "0"], "--max-steps must be >= 1"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--deadline", "soonish"], "--deadline"),
    (["--deadline", "2000-01-01T00:00:00Z"], "already past"),
    (["--task", "nope"], "unknown task"),
    (["--resume", "sometimes"], "--resume must be one of"),
    (["--task", "tinylm", "--device", "cuda"], "no CUDA device"),
    (["--task", "regression", "--device", "cuda"], "CPU only"),
])
def test_configuration_errors_exit_2_with_one_line(cli, tmp_path, args, message):
    if "tinylm" in args and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    result = cli("--store", str(tmp_path / "run"), *args)
    assert result.exit_code == 2, result.output
    assert message in _one_line(result.output)


def test_a_missing_store_is_a_usage_error(cli):
    result = cli("--max-steps", "2")
    assert result.exit_code == 2 and "--store" in result.output


def test_a_store_that_is_a_file_is_a_configuration_error(cli, tmp_path):
    (tmp_path / "file").write_text("x")
    result = cli("--store", str(tmp_path / "file"))
    assert result.exit_code == 2 and "not a folder" in _one_line(result.output)


def test_checkpoint_cadence_by_steps_and_by_seconds():
    from trainproof.train.saver import SaveClock

    now = [1000.0]
    by_steps = SaveClock(every_steps=3)
    assert [s for s in range(1, 10) if by_steps.due(s)] == [3, 6, 9]
    by_time = SaveClock(every_seconds=60, clock=lambda: now[0])
    now[0] += 59
    assert not by_time.due(1)
    now[0] += 1
    assert by_time.due(2)
    by_time.mark()
    assert not by_time.due(3)  # the interval restarts at each commit
    assert not SaveClock().due(100)  # both off: only the final / stop checkpoints


def test_a_checkpoint_is_due_only_after_a_step_not_yet_saved():
    """The periodic decision (trainproof.train.saver.save_due) on plain values: never a step already committed or
    being committed in the background, else the step cadence or the seconds since the last checkpoint."""
    from trainproof.train.saver import save_due

    every = {"every_steps": 5, "every_seconds": 60.0}
    assert save_due(10, saved_through=5, elapsed_s=0.0, **every)
    assert not save_due(10, saved_through=10, elapsed_s=999.0, **every)  # committed, or in flight
    assert not save_due(11, saved_through=10, elapsed_s=59.0, **every)
    assert save_due(11, saved_through=10, elapsed_s=60.0, **every)
    assert not save_due(11, saved_through=0, elapsed_s=1e9, every_steps=0, every_seconds=0.0)  # both off


def test_a_verifier_variant_is_one_hidden_value_checked_at_the_edge():
    """The verifier's modes travel as one value (trainproof.train.variant): round trip, refusals in one line."""
    from trainproof.errors import ConfigError
    from trainproof.train.variant import Variant

    plain = Variant()
    assert plain.argv() == [] and Variant.parse(None) == plain and Variant.parse("{}") == plain
    objective = Variant(objective_check=True, batch_size=8, micro_batch_size=3, negative_control="mean-of-microbatch-means")
    option, text = objective.argv()
    assert option == "--variant" and Variant.parse(text) == objective
    for bad, said in [('{"grad_clip": -1}', "grad_clip"), ('{"batch_size": 4}', "objective check only"),
                      ('{"negative_control": "mean"}', "negative_control"), ('{"lr": 1}', "unknown field"),
                      ("[1]", "JSON object"), ("{", "JSON object"), ('{"objective_check": true, "batch_size": 0}', "batch_size")]:
        with pytest.raises(ConfigError, match=said):
            Variant.parse(bad)


# -- each setting declared once ----------------------------------------------------------------------------

OWN_OPTIONS = {"store", "config", "deadline", "rental_ends", "variant", "endpoint_url", "region", "path_style"}
"""The options of ``train`` that are not a field of its options objects (each declared once in trainproof/cli)."""
FILLED_OTHERWISE = {"store", "task_config", "variant", "deadline", "deadline_margin_s"}
"""TrainConfig fields with no option of their own: --store, --config, --variant, --deadline/--rental-ends, none."""
RECORDED = {"task", "max_steps", "steps", "checkpoint_every", "checkpoint_every_seconds", "keep", "keep_every", "seed",
            "device", "deadline", "allow_world_change", "dist_timeout_s", "allow_code_change", "variant", "sync_checkpoint",
            "stop_grace_s", "fsdp", "data_workers", "prefetch"}


def test_every_train_option_is_a_field_declared_once_and_the_record_follows_the_fields():
    """The options of ``train`` come from the fields of TrainConfig, SpotConfig and LaunchConfig (their flag,
    variable, default and help), except the few it declares itself; what each state records is the fields declared
    recorded."""
    from dataclasses import MISSING, fields
    from datetime import datetime, timedelta, timezone

    import typer

    from trainproof.cli import _register, app
    from trainproof.lifecycle.spot import SpotConfig
    from trainproof.train.config import TrainConfig
    from trainproof.train.launch import LaunchConfig
    from trainproof.train.variant import Variant

    _register()
    options = {p.name: p for p in typer.main.get_command(app).commands["train"].params}
    declared = {f.name: f for cls in (TrainConfig, SpotConfig, LaunchConfig) for f in fields(cls) if f.metadata.get("help")}
    assert set(options) == set(declared) | OWN_OPTIONS and not set(declared) & OWN_OPTIONS
    for name, f in declared.items():
        flag = (f.metadata["flag"] or name).upper()
        option = options[name]
        assert (option.opts, option.envvar) == ([f"--{flag.lower().replace('_', '-')}"], f"TRAINPROOF_{flag}"), name
        assert (option.default, option.help, option.show_envvar) == (f.default, f.metadata["help"], True), name
    unset = {f.name for f in fields(TrainConfig) if f.name not in declared}
    assert unset == FILLED_OTHERWISE
    assert all(f.default is not MISSING for f in fields(LaunchConfig) if f.name in declared)

    at = datetime.now(timezone.utc) + timedelta(hours=1)
    record = TrainConfig(store="memory://x", deadline=at, variant=Variant(grad_clip=1.0), fsdp=True).recorded()
    assert set(record) == RECORDED
    assert (record["deadline"], record["variant"], record["fsdp"], record["seed"]) == (at.isoformat(), {"grad_clip": 1.0},
                                                                                      True, 1234)
    assert TrainConfig(store="memory://x").recorded()["deadline"] is None


def test_the_stop_line_names_the_committed_step_not_the_one_reached():
    from trainproof.cli.train import stop_line
    from trainproof.train.loop import Outcome

    def line(step, committed):
        return stop_line(Outcome(exit_code=75, reason="signal", step=step, target=40, committed_step=committed))

    assert "after committing step 30 of 40" in line(30, 30)
    assert "at step 31 of 40; the last committed step is 30 (the 1 after it will be trained again)" in line(31, 30)
    assert "before any step was committed" in line(0, None) and "committing" not in line(0, None)

