"""Nothing stored at a name the run writes next can stop it: the step it commits, ``quarantine``, an export bundle's
name, the spool folder ``.spool`` (``deadline.json``: tests/test_train_deadline.py).

A co-tenant plants an occupant at the step the restarted run commits next: a plain file, a symlink, a FIFO, a folder
whose ``COMPLETE.json`` is a folder, with ``quarantine`` itself a file or a symlink leading out of the run; on S3 one
empty object named like the step. Or genuine generations of *another build* (the same task, settings and seed,
trained by a copy of trainproof with one comment changed: nothing forged) sit above the run. Each used to crash-loop
the Job (exit 1 at the commit, every restart) or, with ``--keep``, make retention delete what the run committed.

Now the occupant is moved aside under quarantine (the entry itself, a link never followed) and the run proceeds:
real ``train`` processes, exit 0, the final state bitwise equal to an untouched run's, nothing written outside the
run, nothing genuine deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hostile import trained
from tests.test_train_helpers import ROOT, differences, kept_differences, load_state, run, train_env, trajectory

TARGET = 8
NEXT = 4
"""The step the restarted run commits next (it resumes at 3)."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The untouched run: 8 steps, a generation at every one."""
    return trained(tmp_path_factory, "reference", TARGET, 1)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """The run before its restart: trained to step 3."""
    return trained(tmp_path_factory, "three", 3, 1)


@pytest.fixture(scope="module")
def other_build(tmp_path_factory):
    """The same run (task, settings, seed) trained to step 8 by another build of trainproof: a copy of the package
    with one comment changed, so its code identity differs and nothing else does."""
    base = tmp_path_factory.mktemp("other-build")
    shutil.copytree(ROOT / "trainproof", base / "trainproof", ignore=shutil.ignore_patterns("__pycache__"))
    with open(base / "trainproof" / "tasks" / "regression.py", "a") as fh:
        fh.write("# another build\n")
    store = base / "run"
    env = {**train_env(None), "PYTHONPATH": str(base)}
    done = subprocess.run([sys.executable, "-m", "trainproof", "train", "--store", str(store), "--max-steps",
                           str(TARGET), "--checkpoint-every", "1", "--keep", "0", "--log-format", "json"],
                          cwd=base, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return store


def _code_version(generation: Path) -> str:
    return json.loads((generation / "COMPLETE.json").read_text())["code_version"]


def _plant(run_dir: Path, kind: str, outside: Path) -> None:
    step = run_dir / f"step-{NEXT:08d}"
    if kind == "file":
        step.write_bytes(b"x")
    elif kind == "symlink":  # a link to a folder outside the run: a commit through it would write there
        step.symlink_to(outside, target_is_directory=True)
    elif kind == "fifo":
        os.mkfifo(step)
    elif kind == "marker-folder":
        (step / "COMPLETE.json").mkdir(parents=True)
    elif kind == "quarantine-symlink":  # quarantine leads out of the run, and the next step needs it
        (run_dir / "quarantine").symlink_to(outside, target_is_directory=True)
        step.write_bytes(b"x")
    elif kind == "quarantine-file":
        (run_dir / "quarantine").write_bytes(b"x")
        (step / "COMPLETE.json").mkdir(parents=True)


@pytest.mark.parametrize("kind", ["file", "symlink", "fifo", "marker-folder", "quarantine-symlink",
                                  "quarantine-file"])
def test_an_occupant_of_the_next_step_is_moved_aside_and_the_run_ends_as_if_it_were_not_there(
        tmp_path, reference, three, kind):
    run_dir = tmp_path / "run"
    shutil.copytree(three, run_dir)
    outside = tmp_path / "outside"
    outside.mkdir()
    _plant(run_dir, kind, outside)
    result = run(run_dir, "--max-steps", str(TARGET), "--checkpoint-every", "1", "--keep", "0")
    assert result.code == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert differences(trajectory(load_state(reference)), trajectory(load_state(run_dir))) == []
    assert list(outside.iterdir()) == []  # nothing written, moved or deleted outside the run
    moved = [p for root in run_dir.glob("quarantine*") if root.is_dir() and not root.is_symlink()
             for p in root.glob(f"step-{NEXT:08d}-*")]
    assert len(moved) == 1 and json.loads((moved[0] / "REASON").read_text())["generation"] == f"step-{NEXT:08d}"
    if kind == "symlink":  # the link itself moved, never followed
        assert (moved[0] / "OCCUPANT").is_symlink() and os.readlink(moved[0] / "OCCUPANT") == str(outside)
    if kind.startswith("quarantine-"):  # what held the name is still there, untouched
        held = run_dir / "quarantine"
        assert held.is_symlink() if kind == "quarantine-symlink" else held.read_bytes() == b"x"


@pytest.mark.parametrize("kind", ["symlink", "fifo", "spools"])
def test_what_occupies_the_spool_folder_neither_stops_the_run_nor_is_written_through(tmp_path, reference, three, kind):
    """``.spool``, where a folder run's writer serialises its states, planted as a link out of the run, a FIFO, or a
    folder holding a killed writer's leftover spool beside a link out of the run and a FIFO named like spools: the
    occupant is moved aside (the link never followed), the leftover deleted, the links and FIFOs inside left alone; the
    run ends as an untouched one and leaves no spool behind."""
    run_dir = tmp_path / "run"
    shutil.copytree(three, run_dir)
    outside = tmp_path / "outside"
    outside.mkdir()
    spools = run_dir / ".spool"
    shutil.rmtree(spools)  # the run's own, empty
    if kind == "symlink":
        spools.symlink_to(outside, target_is_directory=True)
    elif kind == "fifo":
        os.mkfifo(spools)
    else:
        spools.mkdir()
        (spools / "trainproof-spool-left").write_bytes(b"x" * 4096)
        (spools / "trainproof-spool-link").symlink_to(outside, target_is_directory=True)
        os.mkfifo(spools / "trainproof-spool-fifo")
    result = run(run_dir, "--max-steps", str(TARGET), "--checkpoint-every", "1", "--keep", "0")
    assert result.code == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert differences(trajectory(load_state(reference)), trajectory(load_state(run_dir))) == []
    assert list(outside.iterdir()) == []
    assert spools.is_dir() and not spools.is_symlink()
    left = sorted(p.name for p in spools.iterdir())
    assert left == ([] if kind != "spools" else ["trainproof-spool-fifo", "trainproof-spool-link"]), left
    if kind != "spools":
        (moved,) = [p for p in (run_dir / "quarantine").iterdir() if p.name.startswith(".spool")]
        assert (moved / "OCCUPANT").is_symlink() if kind == "symlink" else (moved / "OCCUPANT").is_fifo()


def test_generations_of_another_build_above_the_run_are_never_counted_and_are_moved_aside_when_reached(
        tmp_path, reference, three, other_build):
    """Genuine generations of another build at steps 5-8: the resume passes over them (to step 3, this build's);
    with ``--keep 2`` a run to step 4 keeps what it committed (before: retention counted them as the run's newest
    and deleted step 4 right after its commit) and deletes none of them; the run to 8 moves each aside as it
    reaches its step, and ends bitwise equal to an untouched run of this build."""
    run_dir = tmp_path / "run"
    shutil.copytree(three, run_dir)
    ours = _code_version(run_dir / "step-00000003")
    theirs = _code_version(other_build / "step-00000005")
    assert ours != theirs
    for step in range(5, TARGET + 1):
        shutil.copytree(other_build / f"step-{step:08d}", run_dir / f"step-{step:08d}")
    first = run(run_dir, "--max-steps", str(NEXT), "--checkpoint-every", "1", "--keep", "2")
    assert first.code == 0, first.stderr[-3000:]
    assert (run_dir / f"step-{NEXT:08d}" / "COMPLETE.json").exists()
    assert all(_code_version(run_dir / f"step-{s:08d}") == theirs for s in range(5, TARGET + 1))
    second = run(run_dir, "--max-steps", str(TARGET), "--checkpoint-every", "1", "--keep", "2")
    assert second.code == 0 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert kept_differences(load_state(reference, history="kept"), load_state(run_dir, history="kept")) == []
    assert _code_version(run_dir / f"step-{TARGET:08d}") == ours
    moved = sorted((run_dir / "quarantine").iterdir())
    assert [p.name[:13] for p in moved] == [f"step-{s:08d}" for s in range(5, TARGET + 1)]
    assert all(_code_version(p) == theirs and "another build" in (p / "REASON").read_text() for p in moved)


def test_an_empty_object_named_like_the_next_step_does_not_stop_a_run_on_s3(tmp_path, reference, three, s3_env):
    """On S3 one empty object ``run/step-00000004`` (no slash) sat where the run's folder goes: every commit of
    that step was refused. It is moved aside, and the run ends as an untouched one."""
    from trainproof.storage import open_store

    url = f"s3://{s3_env}/runs/occupied"
    dst = open_store(url)
    for path in sorted(p for p in three.rglob("*") if p.is_file()):
        dst.write_file(str(path.relative_to(three)), path.read_bytes())
    dst.write_file(f"step-{NEXT:08d}", b"")
    result = run(url, "--max-steps", str(TARGET), "--checkpoint-every", "1", "--keep", "0")
    assert result.code == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert differences(trajectory(load_state(reference)), trajectory(load_state(url))) == []
    store = open_store(url)
    quarantined = [e.name for e in store.backend.listdir(f"{store.root}/quarantine")]
    assert len(quarantined) == 1 and quarantined[0].startswith(f"step-{NEXT:08d}-")
    assert f"step-{NEXT:08d}" not in [e.name for e in store.backend.listdir(store.root) if not e.is_dir]


def test_a_file_where_the_export_bundle_goes_is_moved_aside_and_the_export_made(tmp_path, three):
    """``exports/step-00000003`` planted as a plain file: ``trainproof export`` used to fail (the move to quarantine
    took the file for a folder); now the file is moved aside whole and the bundle committed and reload-checked."""
    run_dir = tmp_path / "run"
    shutil.copytree(three, run_dir)
    (run_dir / "exports").mkdir()
    (run_dir / "exports" / "step-00000003").write_bytes(b"x")
    done = subprocess.run([sys.executable, "-m", "trainproof", "export", "--store", str(run_dir)], cwd=ROOT,
                          env=train_env(None), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "passed" in done.stdout and (run_dir / "exports" / "step-00000003" / "COMPLETE.json").is_file()
    (moved,) = (run_dir / "exports" / "quarantine").iterdir()
    assert (moved / "OCCUPANT").read_bytes() == b"x"
