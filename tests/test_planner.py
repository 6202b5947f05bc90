"""The rental planner: Young/Daly interval, reserve and deadline arithmetic, and `trainproof plan` end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest

from tests.support.timing import budget
from trainproof.lifecycle.planner import (
    PlanInputs, daly_interval, format_duration, make_plan, parse_duration, plan_document, plan_from_measurements,
    young_interval,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN, HOUR, DAY = 60.0, 3600.0, 86400.0


def tp(*args):
    """`python -m trainproof ARGS`, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "trainproof", *args], cwd=ROOT, capture_output=True, text=True, timeout=budget(60))


# --- The interval formula -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mtbi_s, published_min, digits", [
    (24 * HOUR, 117, 0),   # Fig. 3: M = 24 h, delta = 5 min -> tau_opt = 117 min
    (6 * HOUR, 57, 0),     # Fig. 4: M = 6 h,  delta = 5 min -> tau_opt = 57 min
    (15 * MIN, 9.1, 1),    # Fig. 5: M = 15 min, delta = 5 min -> tau_opt = 9.1 min
])
def test_daly_matches_the_papers_worked_values(mtbi_s, published_min, digits):
    # J. T. Daly, FGCS 22(3) 2006, figure captions (R = 10 min, Ts = 500 h; R and Ts do not enter tau_opt).
    assert round(daly_interval(5 * MIN, mtbi_s) / MIN, digits) == published_min


def test_daly_hand_computed_example():
    # C = 100 s, M = 1800 s: C/(2M) = 1/36, sqrt(C/(2M)) = 1/6, sqrt(2CM) = sqrt(360000) = 600.
    # T = 600 * (1 + (1/3)(1/6) + (1/9)(1/36)) - 100 = 600 + 100/3 + 50/27 - 100 = 14450/27 = 535.185185...
    assert daly_interval(100.0, 1800.0) == pytest.approx(14450 / 27, rel=1e-12)
    assert young_interval(100.0, 1800.0) == pytest.approx(600.0, rel=1e-12)


@pytest.mark.parametrize("c_over_m", [1e-4, 1e-6, 1e-8])
def test_daly_tends_to_young_when_checkpoints_are_cheap(c_over_m):
    m = 10 * DAY
    c = c_over_m * m
    young, daly = young_interval(c, m), daly_interval(c, m)
    # The correction is -C + sqrt(2CM)(sqrt(x)/3 + x/9), x = C/2M: relative size O(sqrt(C/M)).
    assert abs(daly / young - 1) < 2 * math.sqrt(c_over_m)
    assert daly < young  # the "- C" dominates the positive terms for small C/M


@pytest.mark.parametrize("ratio", [2.0, 2.5, 10.0])
def test_daly_is_m_when_a_checkpoint_costs_at_least_2m(ratio):
    assert daly_interval(ratio * HOUR, HOUR) == HOUR


def test_daly_just_below_2m_uses_the_series():
    # x -> 1: T -> 2M (1 + 1/3 + 1/9) - 2M = 8M/9
    assert daly_interval(2 * HOUR * (1 - 1e-12), HOUR) == pytest.approx(8 * HOUR / 9, rel=1e-9)


@pytest.mark.parametrize("c, m", [(0, HOUR), (60, 0), (-1, HOUR)])
def test_interval_needs_positive_inputs(c, m):
    with pytest.raises(ValueError):
        daly_interval(c, m)


# --- Durations ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, seconds", [
    ("90s", 90), ("10m", 600), ("6h", 21600), ("7d", 604800), ("1h30m", 5400), ("45", 45), ("0.5", 0.5),
    ("2.5h", 9000), (" 3D ", 259200), ("250ms", 0.25),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["7x", "", "h", "-5", "1h 30m", "nan", "inf", "10m-"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize("seconds, text", [(603060, "6d23h31m"), (1570, "26m10s"), (45.9, "45s"), (0, "0s"),
                                           (86400, "1d"), (3601, "1h1s")])
def test_format_duration_rounds_down_and_train_parses_it_back(seconds, text):
    from trainproof.lifecycle.signals import parse_deadline  # what `train --deadline` uses

    assert format_duration(seconds) == text
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert parse_deadline(text, now=now) == now + timedelta(seconds=math.floor(seconds))


# --- The plan ---------------------------------------------------------------------------------------------------

TYPICAL = dict(rental_s=7 * DAY, mtbi_s=6 * HOUR, checkpoint_s=60, restart_s=180, export_s=300, verify_s=600,
               step_s=10)


def test_typical_seven_day_plan_worked_out():
    start = datetime(2026, 12, 1, 9, 0, tzinfo=timezone.utc)
    plan = make_plan(PlanInputs(**TYPICAL, start=start))
    # sqrt(2 * 60 * 21600) = 1609.97; x = 60/43200; 1609.97 * (1 + sqrt(x)/3 + x/9) - 60 = 1570.2 -> 1570 s
    assert plan.interval_s == 1570
    assert plan.interval_steps == 157                                    # 1570 s / 10 s
    assert plan.checkpoint_fraction == pytest.approx(60 / 1630)          # C / (T + C)
    assert plan.lost_per_interruption_s == pytest.approx(1630 / 2 + 180)  # (T + C)/2 + R = 995 s
    assert plan.overhead_fraction == pytest.approx(60 / 1630 + 995 / 21600)
    assert plan.expected_interruptions == pytest.approx(28.0)            # 7 d / 6 h
    assert plan.keep == 6                                                # ceil(7200 / 1630) + 1
    assert plan.reserve_s == 1740                                        # 1.5 * (10+60+180+300+600) = 1725 -> 29 min
    assert plan.deadline_after_start_s == 7 * 86400 - 1740
    assert plan.deadline == "6d23h31m"
    assert plan.deadline_at == datetime(2026, 12, 8, 8, 31, tzinfo=timezone.utc)
    assert plan.grace_s == 130                                           # 10 + 1.5 * 60 + 30
    assert plan.drill_s == 240
    assert plan.env() == {"TRAINPROOF_CHECKPOINT_EVERY_SECONDS": "1570", "TRAINPROOF_KEEP": "6",
                          "TRAINPROOF_DEADLINE": "6d23h31m"}
    assert plan.warnings == ()


def test_interval_does_not_depend_on_the_rental_length():
    plans = [make_plan(PlanInputs(**{**TYPICAL, "rental_s": d * DAY})) for d in (3, 7, 30)]
    assert {p.interval_s for p in plans} == {1570} and {p.keep for p in plans} == {6}
    assert [p.deadline for p in plans] == ["2d23h31m", "6d23h31m", "29d23h31m"]


def test_keep_never_below_two():
    assert make_plan(PlanInputs(rental_s=DAY, rollback_s=0)).keep == 2


def test_rental_shorter_than_the_reserve_is_refused():
    with pytest.raises(ValueError, match="shorter than the reserve"):
        make_plan(PlanInputs(rental_s=20 * MIN))


def test_expensive_checkpoints_and_long_steps_warn():
    plan = make_plan(PlanInputs(rental_s=3 * DAY, mtbi_s=10 * MIN, checkpoint_s=30 * MIN, step_s=2 * HOUR))
    assert plan.interval_s == 600 and plan.interval_steps == 1
    assert any("twice the mean time" in w for w in plan.warnings)
    assert any("longer than the interval" in w for w in plan.warnings)


@pytest.mark.parametrize("field, value", [("rental_s", 0), ("mtbi_s", -1), ("checkpoint_s", 0), ("export_s", -1),
                                          ("step_s", 0), ("safety", 0.9), ("rollback_s", -1)])
def test_inputs_are_validated(field, value):
    with pytest.raises(ValueError):
        PlanInputs(**{**TYPICAL, field: value})


def test_naive_start_is_refused():
    with pytest.raises(ValueError, match="time zone"):
        PlanInputs(**TYPICAL, start=datetime(2026, 12, 1, 9, 0))


def test_measurement_hook_replaces_the_assumed_timings():
    assumed = PlanInputs(**TYPICAL)
    plan = plan_from_measurements(assumed, checkpoint_s=240.0, export_s=None, step_s=2.0)
    assert plan.inputs.checkpoint_s == 240.0 and plan.inputs.export_s == 300 and plan.inputs.step_s == 2.0
    assert plan.interval_s == round(daly_interval(240.0, 6 * HOUR))
    assert plan.interval_s > make_plan(assumed).interval_s  # slower saves -> checkpoint less often


def test_plan_document_is_json_ready():
    doc = json.loads(json.dumps(plan_document(make_plan(PlanInputs(**TYPICAL)))))
    assert doc["interval_s"] == 1570 and doc["env"]["TRAINPROOF_KEEP"] == "6" and doc["deadline_at"] is None


# --- `trainproof plan` through the real entry point -------------------------------------------------------------


def test_cli_json():
    r = tp("plan", "--rental", "7d", "--mtbi", "6h", "--step-seconds", "10", "--start", "2026-12-01T09:00:00Z", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["interval_s"] == 1570 and doc["interval_steps"] == 157 and doc["keep"] == 6
    assert doc["deadline"] == "6d23h31m" and doc["deadline_at"] == "2026-12-08T08:31:00+00:00"
    assert doc["inputs"]["checkpoint_s"] == 60 and doc["inputs"]["export_s"] == 300


def test_cli_text_names_every_figure():
    r = tp("plan", "--rental", "3d", "--step-seconds", "0.5", "--checkpoint-seconds", "2m", "--start",
           "2026-12-01T09:00:00+00:00")
    assert r.returncode == 0, r.stderr
    for needle in ("checkpoint interval", "expected overhead", "lost per interruption", "interruptions",
                   "keep", "final reserve", "stop grace", "deadline", "--checkpoint-every-seconds",
                   "--checkpoint-every ", "2026-12-0"):
        assert needle in r.stdout


def test_cli_env_lines():
    r = tp("plan", "--rental", "30d", "--step-seconds", "10", "--env")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["TRAINPROOF_CHECKPOINT_EVERY_SECONDS=1570", "TRAINPROOF_KEEP=6",
                                     "TRAINPROOF_DEADLINE=29d23h31m"]


@pytest.mark.parametrize("args, message", [
    (["--rental", "7x"], "not a duration"),
    (["--rental", "20m"], "shorter than the reserve"),
    (["--rental", "7d", "--mtbi", "0"], "--mtbi must be > 0"),
    (["--rental", "7d", "--json", "--env"], "either --json or --env"),
    (["--rental", "7d", "--start", "yesterday"], "not an ISO time"),
])
def test_cli_handled_errors_are_one_line_and_exit_2(args, message):
    r = tp("plan", *args)
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_cli_lists_plan():
    r = tp("--help")
    assert r.returncode == 0 and "plan" in r.stdout
