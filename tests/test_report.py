"""``trainproof report``: a run stopped by SIGTERM, killed by SIGKILL between commits and finished, in real processes;
the report's attempts, redone steps and buckets against what the test saw; planted and damaged attempt records
never crash the report nor change a run."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tests.support.timing import budget
from tests.test_dist_helpers import read_until
from trainproof.storage import open_store
from tests.test_train_helpers import ROOT, finish, run, start, train_env

TARGET = 40
ARGS = ("--max-steps", str(TARGET), "--checkpoint-every", "5", "--log-format", "json")
HOOKS = {"TPHOOK_STEP_DELAY": "0.05", "TPHOOK_ATTEMPT_REFRESH": "0"}  # the record rewritten after every step


def report(store, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainproof", "report", "--store", str(store), *args], cwd=ROOT,
                          env=train_env(), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """One run of TARGET steps in three attempts: stopped by SIGTERM, killed by SIGKILL between commits, finished;
    with what the test saw of it. Shared by the tests of the report over it."""
    store = tmp_path_factory.mktemp("report") / "run"
    t0 = time.time()
    lines: list[str] = []
    first = start(store, *ARGS, env=HOOKS)
    read_until(first, lambda e: e.get("event") == "checkpoint" and e["step"] >= 10, lines)
    first.send_signal(signal.SIGTERM)
    stopped = finish(first)
    assert stopped.code == 75, stopped.stderr
    cut = stopped.last("stopped")["committed_step"]

    second = start(store, *ARGS, env=HOOKS)
    read_until(second, lambda e: e.get("event") == "checkpoint" and e["step"] >= 20, lines)
    seen = read_until(second, lambda e: e.get("event") == "step" and e["step"] % 5 == 3, lines)["step"]
    second.kill()  # three steps past a commit (or eight, the last one in flight): redone by the next attempt
    finish(second)

    third = run(store, *ARGS, env=HOOKS)
    t1 = time.time()
    assert third.code == 0, third.stderr
    return SimpleNamespace(store=store, t0=t0, t1=t1, cut=cut, seen=seen, resumed=third.last("resume")["step"])


def test_the_report_of_a_run_stopped_killed_and_finished_matches_what_happened(interrupted):
    store, t0, t1, cut, seen, resumed = (interrupted.store, interrupted.t0, interrupted.t1, interrupted.cut,
                                         interrupted.seen, interrupted.resumed)
    assert resumed % 5 == 0 and seen - 8 <= resumed <= seen - 3  # the commit of seen - 3 may still have been in flight

    done = report(store, "--json", "--price-per-hour", "3.6")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    a1, a2, a3 = doc["attempts"]
    assert [a["resumed_from"] for a in doc["attempts"]] == [0, cut, resumed]
    assert (a1["end"], a1["reason"], a1["last_step"], a1["redone_steps"]) == ("stopped", "signal", cut, 0)
    # The killed attempt's record is rewritten after every step here: it says the step it reached, or (the kill
    # landed between a step and its record) the one before; what the next attempt redid is exactly that far.
    assert a2["end"].startswith("killed") and seen - 1 <= a2["last_step"] <= seen
    assert a2["redone_steps"] == a2["last_step"] - resumed
    assert (a3["end"], a3["last_step"], a3["redone_steps"]) == ("done", TARGET, 0)
    assert doc["steps_kept"] == TARGET and doc["redone_steps"] == a2["redone_steps"] and doc["interruptions"] == 2
    assert a1["commits"] == cut // 5 + (cut % 5 != 0) and a3["commits"] == (TARGET - resumed) // 5  # + the stop's
    # Wall time: from the first process's start to the last one's end, inside what the test measured around them
    # (less each process's interpreter start before trainproof is imported and its exit after its last event).
    assert t1 - t0 - budget(6.0) < doc["wall_s"] < t1 - t0
    assert abs(sum(b["seconds"] for b in doc["buckets"].values()) - doc["wall_s"]) < 0.05
    productive = doc["buckets"]["productive"]["seconds"]
    assert productive >= TARGET * 0.05 * 0.9  # every kept step slept 0.05 s
    redone = doc["buckets"]["redone_steps"]["seconds"]
    assert a2["redone_steps"] * 0.05 * 0.9 <= redone <= a2["redone_steps"] * 0.05 * 3
    assert doc["cost"]["total"] == round(doc["wall_s"] / 3600 * 3.6, 2)
    table = report(store)
    assert table.returncode == 0 and "goodput" in table.stdout and "redone" in table.stdout, table.stderr


def test_steps_slowed_beside_a_background_commit_are_checkpoint_interference_not_productive(tmp_path):
    """Each step that runs while a commit is in flight (held there 0.6 s after its read-back) takes 0.15 s longer
    (test hooks): the record counts those steps apart from the others, and the report moves what they cost beside the
    commits out of productive time into checkpoint_interference, priced by the difference of the two means."""
    extra = 0.15
    hooks = {"TPHOOK_STEP_DELAY": "0.03", "TPHOOK_SAVE_DELAY": "0.6", "TPHOOK_COMMIT_INTERFERENCE": str(extra)}
    result = run(tmp_path / "run", "--max-steps", "40", "--checkpoint-every", "10", "--log-format", "json",
                 env=hooks)
    assert result.code == 0, result.stderr
    record = json.loads(next((tmp_path / "run" / "attempts").glob("*.json")).read_text())
    times = record["step_times"]
    # Every step but the first (warm-up) is timed: the one after a checkpoint began from the end of its blocked time.
    assert times["commit_n"] >= record["commits"] + 3 and times["clear_n"] >= 10, (times, record)
    assert times["commit_n"] + times["clear_n"] == 39, times
    done = report(tmp_path / "run", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    interference = doc["buckets"]["checkpoint_interference"]["seconds"]
    # The step after each landing counts as beside its commit (freeing the snapshot slows it in a real run) but the
    # hook only slows steps while a commit runs: at most one such step per commit is not slowed here.
    slowed = times["commit_n"] * extra
    assert 0.7 * (times["commit_n"] - record["commits"]) * extra <= interference, (interference, times, record)
    assert interference <= slowed + times["commit_n"] * budget(0.1), (interference, times)
    (attempt,) = doc["attempts"]
    assert attempt["checkpoint_interference_s"] == pytest.approx(interference, abs=0.002)
    assert doc["buckets"]["productive"]["seconds"] == pytest.approx(attempt["train_s"] - interference, abs=0.01)


def test_on_demand_price_adds_what_the_run_saved_computed_from_its_own_buckets(interrupted):
    """Per-second prices (3600 and 36000 an hour) make every figure visible: each bucket's cost, the total, the
    on-demand cost of the productive time and the saving follow from the seconds the report itself shows."""
    paid, on_demand = 3600.0, 36000.0
    done = report(interrupted.store, "--json", "--price-per-hour", "3600", "--on-demand-price", "36000")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    seconds = {k: b["seconds"] for k, b in doc["buckets"].items()}
    assert doc["cost"] == {**{k: round(v / 3600 * paid, 2) for k, v in seconds.items()},
                           "total": round(doc["wall_s"] / 3600 * paid, 2)}
    od = doc["on_demand"]
    cost, total = seconds["productive"] / 3600 * on_demand, doc["wall_s"] / 3600 * paid
    assert (od["price_per_hour"], od["price_per_hour_paid"]) == (on_demand, paid)
    assert (od["cost"], od["paid"], od["saved"]) == (round(cost, 2), round(total, 2), round(cost - total, 2))
    assert od["saved_share"] == round((cost - total) / cost, 4) and "productive" in od["basis"]
    table = report(interrupted.store, "--price-per-hour", "3600", "--on-demand-price", "36000")
    assert table.returncode == 0 and f"saved {round(cost - total, 2):.2f}" in " ".join(table.stdout.split()), \
        table.stdout
    alone = report(interrupted.store, "--on-demand-price", "36000")
    assert alone.returncode == 2 and "--price-per-hour" in alone.stderr and "Traceback" not in alone.stderr


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("where", ["local", "s3"])
def test_png_draws_the_timeline_of_a_finished_run_and_of_one_whose_last_attempt_has_no_end(interrupted, tmp_path,
                                                                                         where, request):
    """--png writes a local PNG of a sensible size, for the finished run and for a run on a folder or S3 whose
    records end with a killed attempt and one killed during its start-up (no step, no end): in progress or crashed,
    it still plots, and --json still says what the records show."""
    png = tmp_path / "goodput.png"
    done = report(interrupted.store, "--png", str(png))
    assert done.returncode == 0 and f"wrote {png}" in done.stderr, done.stderr
    width, height = _png_size(png)
    assert 500 <= width <= 2000 and 200 <= height <= 1500, (width, height)

    url = str(tmp_path / "crashed") if where == "local" else f"s3://{request.getfixturevalue('s3_env')}/p/crashed"
    # The stopped one and the killed one (the kill may have left a ".tmp-" file of a record being rewritten).
    records = sorted((interrupted.store / "attempts").glob("*.json"),
                     key=lambda p: json.loads(p.read_text())["started_at"])[:2]
    target = open_store(url).child("attempts")
    for record in records:
        target.write_file(record.name, record.read_bytes())
    started = json.loads(records[1].read_text())["updated_at"]
    target.write_file("zz-starting.json", json.dumps({"schema": "trainproof.attempt/1", "started_at": started,
                                                      "updated_at": started}).encode())
    crashed = tmp_path / "crashed.png"
    result = report(url, "--json", "--png", str(crashed))
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [a["end"].split()[0] for a in doc["attempts"]] == ["stopped", "killed", "killed"] and not doc["skipped"], doc
    # The last one never restored: it says nothing about where the run continued, so nothing counts as redone yet.
    assert doc["attempts"][2]["last_step"] is None and doc["attempts"][2]["resumed_from"] is None
    assert [a["redone_steps"] for a in doc["attempts"]] == [0, 0, 0] and doc["steps_kept"] == \
        doc["attempts"][1]["last_step"]
    width, height = _png_size(crashed)
    assert 500 <= width <= 2000 and 200 <= height <= 1500, (width, height)


def test_planted_and_damaged_records_never_crash_the_report_nor_change_a_run(tmp_path):
    store = tmp_path / "run"
    attempts = store / "attempts"
    attempts.mkdir(parents=True)
    (attempts / "deep.json").write_text('{"a":' * 50_000 + "1" + "}" * 50_000)
    (attempts / "huge.json").write_bytes(b'{"x": "' + b"y" * 200_000 + b'"}')
    (attempts / "types.json").write_text(json.dumps({"schema": "trainproof.attempt/1", "started_at": 5,
                                                     "updated_at": "x"}))
    (attempts / "backwards.json").write_text(json.dumps({
        "schema": "trainproof.attempt/1", "started_at": "2030-01-01T00:00:00+00:00",
        "updated_at": "2020-01-01T00:00:00+00:00"}))
    (attempts / "neg.json").write_text(json.dumps({
        "schema": "trainproof.attempt/1", "started_at": "2020-01-01T00:00:00+00:00",
        "updated_at": "2020-01-01T00:00:01+00:00", "train_s": -1e308, "resumed_from": 10 ** 30}))
    result = run(store, "--max-steps", "6", "--log-format", "json")
    assert result.code == 0, result.stderr
    done = report(store, "--json")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    doc = json.loads(done.stdout)
    assert len(doc["attempts"]) == 1 and doc["attempts"][0]["last_step"] == 6
    assert sorted(s.split(":")[0] for s in doc["skipped"]) == ["backwards.json", "deep.json", "huge.json",
                                                               "neg.json", "types.json"]


def test_attempts_occupied_by_a_file_costs_a_warning_not_the_run(tmp_path):
    store = tmp_path / "run"
    store.mkdir()
    (store / "attempts").write_bytes(b"x")
    result = run(store, "--max-steps", "4", "--log-format", "json")
    assert result.code == 0 and "attempt record" in result.stderr, result.stderr
    done = report(store)
    assert done.returncode == 0, done.stderr


def test_png_without_matplotlib_is_one_clear_line(monkeypatch, tmp_path):
    """Without matplotlib --png is refused with what to install (exit 2 through the CLI), never a traceback."""
    from trainproof.cli.common import UsageError
    from trainproof.cli.report import _write_png
    from trainproof.lifecycle.goodput import Report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(UsageError, match=r"--png needs matplotlib \(pip install matplotlib"):
        _write_png(tmp_path / "goodput.png", Report(), {"wall_s": 0.0, "buckets": {}, "goodput": None}, "x")
    assert not (tmp_path / "goodput.png").exists()


def test_the_newest_attempt_stopped_after_its_last_commit_has_those_steps_redone_not_kept():
    """A SIGTERM whose final commit did not fit in the grace (exit 75, steps after the last commit): the next attempt
    resumes from that commit, so those steps are redone even before it starts; an attempt still running (no end)
    has its uncommitted steps counted as trained until it ends."""
    from trainproof.lifecycle.goodput import Attempt, Report, summary

    def attempt(start: float, end: str | None, resumed: int, last: int, committed: int) -> Attempt:
        return Attempt(name=f"{start}.json", started=start, updated=start + 100, ended=start + 100 if end else None,
                       end=end, reason="signal" if end == "stopped" else None, resumed_from=resumed, last_step=last,
                       startup_s=1.0, restore_s=0.0, train_s=(last - resumed) * 0.5, blocked_s=0.0, commits=1,
                       committed_step=committed, finish_s=0.0)

    skipped_final = Report(attempts=[attempt(0, "stopped", 0, 100, 80)])
    assert skipped_final.redone() == [20]
    doc = summary(skipped_final)
    assert (doc["steps_kept"], doc["redone_steps"]) == (80, 20)
    assert doc["buckets"]["productive"]["seconds"] == pytest.approx(80 * 0.5)
    running = Report(attempts=[attempt(0, None, 0, 100, 80)])
    assert running.redone() == [0] and summary(running)["steps_kept"] == 100
    # Once a next attempt exists, where it resumed decides, as for any attempt.
    resumed = Report(attempts=[attempt(0, "stopped", 0, 100, 80), attempt(200, "done", 80, 150, 150)])
    assert resumed.redone() == [20, 0] and summary(resumed)["steps_kept"] == 150
