"""The code identity (version + digest of the trainproof/ sources) in every state and generation; a resume
under other code is refused (exit 2) unless ``--allow-code-change``, which is recorded; plan.json's contract does
not depend on it; retention keeps the generation the newest restore started from until an audit passed across it.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import torch

from trainproof.format.contract import build_plan, contract_of
from trainproof.format.identity import code_version, source_digest
from trainproof.format.protect import audited_past, restore_protection
from trainproof.storage import open_store
from trainproof.storage.generations import COMPLETE, GenerationInfo
from trainproof.storage.retention import RetentionPolicy, plan_retention
from tests.test_train_helpers import load_state, run
from tests.test_verify_helpers import read_report, trainproof

OLD = "trainproof 0.0.9+000000000000"


def test_the_identity_is_the_version_plus_a_digest_of_the_sources(tmp_path):
    assert re.fullmatch(r"trainproof 0\.1\.0\+[0-9a-f]{12}", code_version())
    root = Path(__file__).resolve().parent.parent
    for pkg in ("trainproof",):
        shutil.copytree(root / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_digest(tmp_path)[:12] == code_version().rsplit("+", 1)[1]
    (tmp_path / "README.md").write_text("not code")  # outside trainproof/: no change
    assert source_digest(tmp_path)[:12] == code_version().rsplit("+", 1)[1]
    with (tmp_path / "trainproof" / "storage" / "retention.py").open("a") as f:
        f.write("\n# an edit\n")
    assert source_digest(tmp_path)[:12] != code_version().rsplit("+", 1)[1]


def test_the_contract_does_not_depend_on_the_code_identity():
    kw = dict(task="regression", task_config={}, data_identity="d" * 64, seed=1, world=1, objective="o")
    a, b = build_plan(code_version=OLD, **kw), build_plan(code_version=code_version(), **kw)
    assert a["code_version"] != b["code_version"] and a["contract"] == b["contract"] == contract_of(b)


def _rewrite_code_version(src: Path, dst: Path, step: int) -> None:
    """A copy of run ``src`` whose generation ``step`` was written by other code (state meta and manifest)."""
    store, copy = open_store(str(src)), open_store(str(dst))
    copy.write_file("plan.json", store.read_file("plan.json"), create_only=True)
    plan = json.loads(store.read_file("plan.json"))
    state = load_state(src, step)
    state["meta"]["code_version"] = OLD
    buf = io.BytesIO()
    torch.save(state, buf)
    copy.commit(step, {"training_state.pt": buf.getvalue()}, contract=plan["contract"], world=1, code_version=OLD,
                digests={"state": "training_state.pt"})


def test_resuming_under_other_code_is_refused_unless_allowed_and_then_recorded(tmp_path):
    first = run(tmp_path / "run", "--max-steps", "4", "--log-format", "json")
    assert first.code == 0, first.stderr
    state = load_state(tmp_path / "run")
    assert state["meta"]["code_version"] == code_version() and state["meta"]["code_changes"] == []
    manifest = open_store(str(tmp_path / "run")).scan()[-1].manifest
    assert manifest["code_version"] == code_version() and manifest["extra"]["resumed_from"] is None
    _rewrite_code_version(tmp_path / "run", tmp_path / "old", 4)

    refused = run(tmp_path / "old", "--max-steps", "6", "--log-format", "json")
    assert refused.code == 2 and "--allow-code-change" in refused.stderr and OLD in refused.stderr

    allowed = run(tmp_path / "old", "--max-steps", "6", "--log-format", "json", "--allow-code-change")
    assert allowed.code == 0, allowed.stderr
    after = load_state(tmp_path / "old")
    change = [{"step": 4, "from": OLD, "to": code_version()}]
    assert after["meta"]["code_changes"] == change and after["meta"]["code_version"] == code_version()
    assert after["meta"]["trainer"]["resumed_from"] == 4
    newest = open_store(str(tmp_path / "old")).scan()[-1].manifest
    assert newest["extra"]["resumed_from"] == 4 and newest["extra"]["code_changes"] == change
    summary = json.loads((tmp_path / "old" / "summary.json").read_text())
    assert summary["code_changes"] == change

    # The default audit replays from the restore point (written by the old code) and says it crosses the change.
    audit = trainproof("verify", "--store", str(tmp_path / "old"), "--audit", "--id", "a")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    span = read_report(str(tmp_path / "old"), "a")["audit_span"]
    assert (span["from"], span["to"], span["crosses_code_change"], span["replay_crosses_code_change"]) == (4, 6, True, True)
    assert span["code_versions"] == {"from": OLD, "to": code_version(), "replay": code_version()}
    assert "crosses a code change" in span["summary"]
    assert "--allow-code-change" in read_report(str(tmp_path / "old"), "a")["paths"]["replay"]["command"]


def _info(step: int) -> GenerationInfo:
    return GenerationInfo(step=step, name=f"step-{step:08d}", status=COMPLETE, manifest={"contract": "c", "world": 1})


def test_retention_keeps_protected_steps():
    gens = [_info(s) for s in range(1, 8)]
    plain = [g.step for g in plan_retention(gens, RetentionPolicy(keep=2, grace_seconds=0.0), now=0.0)]
    kept = [g.step for g in plan_retention(gens, RetentionPolicy(keep=2, grace_seconds=0.0, protect={3}), now=0.0)]
    assert plain == [1, 2, 3, 4, 5] and kept == [1, 2, 4, 5]


def _resumed(step: int, resumed_from) -> GenerationInfo:
    manifest = {"contract": "c", "world": 1, "extra": {"resumed_from": resumed_from}}
    return GenerationInfo(step=step, name=f"step-{step:08d}", status=COMPLETE, manifest=manifest)


def test_every_restore_point_among_the_newest_and_the_generation_before_it_are_kept_until_audited(tmp_path):
    store = open_store(str(tmp_path / "run"))
    # Steps 1-3 by a fresh start, 4-7 by a process resumed from 3, 8-9 by one resumed from 7 (this process).
    gens = [_resumed(s, None) for s in (1, 2, 3)] + [_resumed(s, 3) for s in (4, 5, 6, 7)] + [_resumed(s, 7) for s in (8, 9)]
    rule = restore_protection(store, 7, keep=4)
    assert rule(gens) == {2, 3, 6, 7}  # 3 (recorded by 6 and 7, among the 4 newest) and 7 (ours), each with the one before
    policy = RetentionPolicy(keep=4, grace_seconds=0.0, protect_rule=rule)
    assert [g.step for g in plan_retention(gens, policy, now=0.0)] == [1, 4, 5]
    assert restore_protection(store, None, keep=2)(gens) == {6, 7}  # only what the 2 newest recorded
    assert restore_protection(store, None, keep=2)(gens[:3]) == frozenset()  # a fresh run protects nothing
    audits = store.child("verification")
    _audited(audits, 6, 9)
    assert rule(gens) == {2, 3}  # the audit 6 -> 9 passed across 7, not across 3
    _audited(audits, 2, 9, passed=False)
    assert rule(gens) == {2, 3, 6, 7}
    _audited(audits, 2, 9)
    assert rule(gens) == frozenset()
    audits.write_file("audited.json", b"[" * 100000)  # unreadable (too deep, too big): nothing is released
    assert rule(gens) == {2, 3, 6, 7}


def _audited(audits, start: int, end: int, *, passed: bool = True, report: bool = True, vid: str = "a1") -> None:
    """What a finished audit leaves: its report under ``verification/<vid>/`` and the record naming it."""
    if report:
        audits.child(vid).write_file("verification.json", json.dumps({
            "kind": "audit", "verdict": "PASSED" if passed else "FAILED",
            "settings": {"from": start, "to": end}}).encode())
    audits.write_file("audited.json", json.dumps({"from": start, "to": end, "passed": passed, "id": vid}).encode())


def test_an_audit_record_releases_nothing_unless_it_is_the_runs_own(tmp_path, monkeypatch):
    """A planted ``audited.json`` claiming every step audited (what the audit CronJob's credential may write) used to
    release every restore point. Without a key it counts only when its own report is a passed audit of the same span
    within the run; with a key only when signed."""
    gens = [_resumed(s, None) for s in (1, 2, 3)] + [_resumed(s, 3) for s in (4, 5, 6)]
    store = open_store(str(tmp_path / "run"))
    rule = restore_protection(store, 3, keep=2)
    audits = store.child("verification")
    protected = {2, 3}
    assert rule(gens) == protected
    audits.write_file("audited.json", json.dumps({"from": 0, "to": 10**9, "passed": True}).encode())
    assert rule(gens) == protected  # names no verification
    _audited(audits, 0, 10**9)  # a planted report too, but a span past the run's newest generation
    assert rule(gens) == protected
    _audited(audits, 2, 6, report=False)
    audits.child("a1").write_file("verification.json", json.dumps({
        "kind": "audit", "verdict": "PASSED", "settings": {"from": 2, "to": 5}}).encode())  # another span
    assert rule(gens) == protected
    audits.write_file("audited.json", json.dumps({"from": 2, "to": 6, "passed": True, "id": "../a1"}).encode())
    assert rule(gens) == protected  # not a verification's name
    _audited(audits, 2, 6)
    assert rule(gens) == frozenset()  # the run's own audit (without a key, what it looks like)
    monkeypatch.setenv("TRAINPROOF_SIGNING_KEY", "k" * 32)
    keyed = open_store(str(tmp_path / "run"))
    keyed_rule = restore_protection(keyed, 3, keep=2)
    assert keyed_rule(gens) == protected  # unsigned: ignored with a key
    record = json.loads(keyed.child("verification").read_file("audited.json"))
    keyed.child("verification").write_file("audited.json", json.dumps(keyed.options.signing.sign(record)).encode())
    assert keyed_rule(gens) == frozenset()
    assert audited_past({"from": 5, "to": 6, "passed": True}, 5) and not audited_past({"from": 5, "to": 5}, 5)
    assert not audited_past({"from": True, "to": 9, "passed": True}, 5)


def test_restore_points_recorded_in_stored_manifests_are_read_defensively(tmp_path):
    store = open_store(str(tmp_path / "run"))
    odd = [_resumed(1, None), _resumed(2, True), _resumed(3, "2"), _resumed(4, -1), _resumed(5, 2.0),
           GenerationInfo(step=6, name="step-00000006", status=COMPLETE,
                          manifest={"contract": "c", "world": 1, "extra": []}), _resumed(7, 10**30)]
    assert restore_protection(store, None, keep=10)(odd) == frozenset()  # none is a step of this run
    broken = RetentionPolicy(keep=1, grace_seconds=0.0, protect_rule=lambda gens: 1 / 0)
    assert plan_retention(odd, broken, now=0.0) == []  # a rule that fails deletes nothing


def test_a_forged_newest_generation_resumed_without_a_key_cannot_cost_the_genuine_one_before_it(tmp_path):
    store = open_store(str(tmp_path / "run"))
    # Genuine 1..5; a planted step-00000009 (recording any restore point it likes) was resumed by this process.
    gens = [_resumed(s, None) for s in range(1, 6)] + [_resumed(9, 1)] + [_resumed(s, 9) for s in (10, 11)]
    rule = restore_protection(store, 9, keep=2)
    doomed = [g.step for g in plan_retention(gens, RetentionPolicy(keep=2, grace_seconds=0.0, protect_rule=rule), now=0.0)]
    assert 5 not in doomed and 9 not in doomed and doomed == [1, 2, 3, 4]
