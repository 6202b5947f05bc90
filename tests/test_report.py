"""``trainproof report``: a run stopped by SIGTERM, killed by SIGKILL between commits and finished, in real processes;
the report's attempts, redone steps and buckets against what the test saw; planted and damaged attempt records
never crash the report nor change a run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from tests.test_dist_helpers import read_until
from tests.test_train_helpers import ROOT, finish, run, start, train_env

TARGET = 40
ARGS = ("--max-steps", str(TARGET), "--checkpoint-every", "5", "--log-format", "json")
HOOKS = {"TPHOOK_STEP_DELAY": "0.05", "TPHOOK_ATTEMPT_REFRESH": "0"}  # the record rewritten after every step


def report(store, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainproof", "report", "--store", str(store), *args], cwd=ROOT,
                          env=train_env(), capture_output=True, text=True, timeout=120)


def test_the_report_of_a_run_stopped_killed_and_finished_matches_what_happened(tmp_path):
    store = tmp_path / "run"
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
    resumed = third.last("resume")["step"]
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
    assert t1 - t0 - 6.0 < doc["wall_s"] < t1 - t0
    assert abs(sum(b["seconds"] for b in doc["buckets"].values()) - doc["wall_s"]) < 0.05
    productive = doc["buckets"]["productive"]["seconds"]
    assert productive >= TARGET * 0.05 * 0.9  # every kept step slept 0.05 s
    redone = doc["buckets"]["redone_steps"]["seconds"]
    assert a2["redone_steps"] * 0.05 * 0.9 <= redone <= a2["redone_steps"] * 0.05 * 3
    assert doc["cost"]["total"] == round(doc["wall_s"] / 3600 * 3.6, 2)
    table = report(store)
    assert table.returncode == 0 and "goodput" in table.stdout and "redone" in table.stdout, table.stderr


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
