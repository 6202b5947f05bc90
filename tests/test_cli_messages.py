"""What a person reads: exit codes and one-line messages of the rough edges a user hits first, through the real
entry point (``python -m trainproof``), plus the regression fixture's opt-in learning-rate floor."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.support.timing import budget
from tests.test_train_helpers import ROOT, run, train_env

CONTRACT = re.compile(r"\b[0-9a-f]{64}\b")


def job(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainproof", *args], cwd=ROOT, env=train_env(env), capture_output=True,
                          text=True, timeout=timeout)


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("trainproof: error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_export_of_a_step_that_does_not_exist_is_a_usage_error_naming_the_steps(tmp_path):
    assert run(tmp_path / "run", "--max-steps", "2", "--checkpoint-every", "1").code == 0
    result = job("export", "--store", str(tmp_path / "run"), "--step", "999")
    assert result.returncode == 2, result.stderr
    line = _one_error_line(result)
    assert "step 999" in line and "complete steps: 1, 2" in line and "Corrupt" not in line


def test_a_store_under_a_file_is_exit_2_at_once(tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    t0 = time.monotonic()
    result = job("train", "--store", str(tmp_path / "afile" / "run"), "--max-steps", "1")
    assert result.returncode == 2 and time.monotonic() - t0 < budget(10)  # no retries of a write that can never work
    assert "afile is a file" in _one_error_line(result)


def test_a_config_value_of_the_wrong_type_names_the_key(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"lr": "fast"}))
    result = job("train", "--store", str(tmp_path / "run"), "--config", str(tmp_path / "c.json"))
    assert result.returncode == 2
    line = _one_error_line(result)
    assert "'lr' must be a number" in line and "'fast'" in line and "not supported" not in line


def test_the_start_line_is_readable_and_says_the_target_is_the_tasks_default(tmp_path):
    result = job("train", "--store", str(tmp_path / "run"), env={"TRAINPROOF_LOG_FORMAT": "rich", "COLUMNS": "250"})
    assert result.returncode == 0, result.stderr
    start = next(ln for ln in result.stdout.splitlines() if ln.startswith("start "))
    assert "step 0 -> 10 (the task's default: no --max-steps given)" in start
    assert not CONTRACT.search(start) and re.search(r"contract [0-9a-f]{12}\b", start)
    assert "{" not in start and "seed 1234" in start  # no raw dicts


def test_after_sigterm_the_last_line_says_how_to_resume(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "trainproof", "train", "--store", str(tmp_path / "run"),
                             "--max-steps", "1000000"], cwd=ROOT, env=train_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in proc.stdout:  # wait until it trains
        if '"event": "step"' in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=budget(120))
    assert proc.returncode == 75, err
    assert err.strip().splitlines()[-1].endswith("run the same command again to resume")


def test_regression_lr_min_is_opt_in_and_leaves_the_fixture_alone():
    from trainproof.tasks import load_task

    fixture, floored = load_task("regression"), load_task("regression", {"lr_min": 1e-3})
    assert "lr_min" not in fixture.config() and floored.config()["lr_min"] == 1e-3  # fixture's contract unchanged
    lrs = {}
    for name, task in (("fixture", fixture), ("floored", floored)):
        model = task.build_model()
        opt = task.build_optimizer(model)
        sched = task.build_scheduler(opt)
        seen = []
        for _ in range(60):
            opt.step()
            sched.step()
            seen.append(opt.param_groups[0]["lr"])
        lrs[name] = seen
    assert lrs["fixture"][9] == 0.00375  # the protocol's next learning rate after 10 steps
    assert lrs["floored"][:9] == lrs["fixture"][:9]  # the same decay until the floor
    assert min(lrs["floored"]) == 1e-3 and lrs["fixture"][-1] < 1e-7
    assert isinstance(fixture.build_scheduler(fixture.build_optimizer(fixture.build_model())),
                      torch.optim.lr_scheduler.StepLR)  # the fixture's own scheduler, not an imitation


@pytest.mark.parametrize("endpoint, why", [
    ("http://user:secret@127.0.0.1:9000", "holds credentials"),
    ("http://[::1", "is malformed"),
    ("http://127.0.0.1:99999", "is malformed"),
    ("ftp://127.0.0.1:9000", "is not http"),
    ("http://127.0.0.1:9000/?X-Amz-Signature=secretsig", "query string"),
])
def test_a_malformed_endpoint_is_one_line_exit_2_without_secrets(tmp_path, endpoint, why):
    result = subprocess.run([sys.executable, "-m", "trainproof", "ls", "--store", "s3://bucket/run", "--endpoint-url",
                             endpoint], cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=budget(120))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and why in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert "secret" not in result.stderr


def test_a_store_url_query_string_is_refused_and_never_printed():
    result = subprocess.run([sys.executable, "-m", "trainproof", "ls", "--store", "s3://bucket/run?X-Amz-Signature=sig1"],
                            cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=budget(120))
    assert result.returncode == 2 and "query string" in result.stderr and "sig1" not in result.stderr, result.stderr


def test_every_help_is_whole_at_80_columns():
    """`--help` of every command in an 80-column terminal: no line wider, no option name cut ("…")."""
    import click
    import typer
    from typer.testing import CliRunner

    import trainproof.cli as cli

    cli._register()
    root = typer.main.get_command(cli.app)
    commands: list[tuple[list[str], click.Command]] = [([], root)]
    for path, command in commands:
        for name, sub in getattr(command, "commands", {}).items():
            commands.append(([*path, name], sub))
    assert len(commands) > 8, [p for p, _ in commands]
    for path, command in commands:
        out = CliRunner().invoke(cli.app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80).output
        assert "Usage:" in out and "…" not in out, (path, out)
        assert max(map(len, out.splitlines())) <= 80, (path, out)
        for param in command.params:
            for flag in (param.opts if not getattr(param, "hidden", False) else []):
                assert flag in out, (path, flag)


def test_a_verification_over_its_budget_is_refused_before_anything_runs(tmp_path):
    """The plan is said before anything runs; over --budget-steps it is one line naming what shrinks it, exit 2,
    and no path has started (nothing under verification/)."""
    result = job("verify", "--store", str(tmp_path / "run"), "--budget-steps", "30")
    line = _one_error_line(result)
    assert result.returncode == 2 and "over --budget-steps 30" in line and "--cuts" in line, line
    assert "--samples 8: epochs of 2 steps" in line, line
    assert "plan: 9 paths (continuous 18 steps, 3 epochs of 6), 80 steps trained" in result.stderr
    assert not list((tmp_path / "run").rglob("step-*"))


def test_the_plan_counts_every_path_and_commit():
    from trainproof.proof.budget import Plan

    plan = Plan.of(steps=18, cut=5, extra_cuts=[6, 9], steps_per_epoch=6, every=4, state_bytes=1000)
    assert plan.paths == [18, 5, 13, 13, 12, 9] and plan.steps == 70
    assert plan.commits == 4 + 1 + 3 + 3 + 3 + 2 and plan.bytes == plan.commits * 1000
    assert Plan.of(steps=18, cut=5, extra_cuts=[], steps_per_epoch=6, every=0, state_bytes=1).commits == 4
    # A frozen base is stored once per path, not per generation.
    lora = Plan.of(steps=18, cut=5, extra_cuts=[6, 9], steps_per_epoch=6, every=4, state_bytes=1000, frozen_bytes=10**6)
    assert lora.bytes == plan.commits * 1000 + 6 * 10**6


def test_the_size_estimate_counts_adam_for_trainable_parameters_and_a_frozen_base_once():
    import torch

    from trainproof.proof.budget import ADAM_COPIES, OVERHEAD, state_bytes

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    model[0].requires_grad_(False)  # the base, frozen; the head trains
    assert state_bytes(model) == (OVERHEAD + ADAM_COPIES * (100 * 10 + 10) * 4, (100 * 100 + 100) * 4)
    from trainproof.proof.budget import plan_sizes

    per_generation, frozen = state_bytes(model)
    assert plan_sizes(per_generation, frozen, sharded=False) == {"state_bytes": per_generation, "frozen_bytes": frozen}
    # FSDP shards keep the frozen base in every generation (stored apart only by a replicated run)
    assert plan_sizes(per_generation, frozen, sharded=True) == {"state_bytes": per_generation + frozen,
                                                                "frozen_bytes": 0}


@pytest.mark.parametrize("steps_per_epoch,global_batch", [(4092, 8), (300, 32), (40, 1)])
def test_the_samples_a_refused_plan_suggests_make_it_fit(steps_per_epoch, global_batch):
    """A packed dataset's default verify (three epochs of thousands of steps) is refused naming a --samples value;
    the plan of that many samples (the default cuts, short epochs still crossed) is within the budget."""
    import re

    from trainproof.errors import ConfigError
    from trainproof.proof.budget import Plan, check_budget
    from trainproof.proof.cuts import plan_cuts

    def plan(spe: int) -> Plan:
        extra, steps, _ = plan_cuts(protocol_cut=5, steps=10, steps_per_epoch=spe, chosen=None, seed=1234)
        return Plan.of(steps=steps, cut=5, extra_cuts=extra, steps_per_epoch=spe, every=1, state_bytes=2**20)

    samples = steps_per_epoch * global_batch
    with pytest.raises(ConfigError) as refused:
        check_budget(plan(steps_per_epoch), max_steps=500, max_gib=20.0, cuts_given=False, samples=samples,
                     global_batch=global_batch)
    fewer = int(re.search(r"--samples (\d+)", str(refused.value)).group(1))
    assert fewer < samples and fewer % global_batch == 0
    short = plan(fewer // global_batch)
    assert short.paths[0] >= 3 * short.steps_per_epoch  # three epochs, their boundaries crossed
    check_budget(short, max_steps=500, max_gib=20.0, cuts_given=False, samples=fewer, global_batch=global_batch)


def test_the_first_samples_of_a_task_are_another_experiment_of_the_same_task():
    from trainproof.errors import ConfigError
    from trainproof.tasks import load_task
    from trainproof.tasks.base import first_samples
    from trainproof.train.variant import Variant

    whole = load_task("regression")
    identity = whole.data_identity()
    part = Variant.parse('{"samples": 8}').apply(load_task("regression"))
    assert part.num_samples() == 8 and whole.num_samples() == 24
    assert part.data_identity() not in (identity, first_samples(load_task("regression"), 12).data_identity())
    assert first_samples(load_task("regression"), 24).data_identity() == identity  # all of them: the task itself
    for bad in ("0", "25", "true", '"8"'):
        with pytest.raises(ConfigError, match="samples"):
            Variant.parse('{"samples": %s}' % bad).apply(load_task("regression"))


def test_a_target_already_reached_says_nothing_is_trained(tmp_path):
    """--max-steps is a total: a run already past it exits 0 (idempotent) and says why nothing happened."""
    store = tmp_path / "run"
    assert run(store, "--max-steps", "4").code == 0
    again = run(store, "--max-steps", "3")
    assert again.code == 0 and "nothing to train: the run is at step 4, past its target of 3" in again.stderr
    assert again.last("done")["step"] == 4
    more = run(store, "--steps", "1")
    assert more.code == 0 and "nothing to train" not in more.stderr and more.last("done")["step"] == 5
