"""Crash consistency: a writer process committing generations is killed with SIGKILL at random moments;
after each kill the store must expose the last committed generation (never a partial one) and every
committed generation's bytes must verify.  Used by tests/test_storage_crash.py (≥ 50 kills per backend)
and bench/crash_consistency.py (≥ 1000).

Run the writer alone:  python -m tests.support.crashloop writer URL
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

CONTRACT = "crashloop"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def payload(step: int, size_scale: int = 1) -> dict[str, bytes]:
    """Deterministic, step-specific content, so a checker can tell whose bytes it reads."""
    size = (50_000 + (step * 104_729) % 400_000) * size_scale
    seed = hashlib.sha256(f"step-{step}".encode()).digest()
    state = (seed * (size // len(seed) + 1))[:size]
    return {"training_state.pt": state, "meta.json": f'{{"step": {step}}}'.encode()}


def writer(url: str, keep: int, size_scale: int) -> None:
    """Resume from the latest usable generation, then commit steps forever (until killed)."""
    import logging

    from trainproof.storage import RetentionPolicy, open_store

    logging.basicConfig(level=logging.ERROR)
    if url.startswith("s3://"):
        _announce_claims()
    store = open_store(url)
    latest = store.load_latest(contract=CONTRACT, world=1)
    step = latest.info.step + 1 if latest else 1
    print("ready", flush=True)
    while True:
        print(f"committing {step}", flush=True)
        files: dict = payload(step, size_scale)
        if store.uploads_while_written:  # as the trainer commits on S3: uploaded while a thread writes the spool
            files["training_state.pt"] = _written_slowly(files["training_state.pt"])
        try:
            store.commit(step, files, contract=CONTRACT, world=1, code_version="crashloop")
        finally:
            if not isinstance(files["training_state.pt"], bytes):
                files["training_state.pt"].unlink()
        print(f"committed {step}", flush=True)
        # Grace 0: abandoned partials below the newest commit go at once, so kills also land inside deletions
        # and partials don't pile up (each one costs discovery a listing).  Safe here: this is the only writer.
        store.apply_retention(RetentionPolicy(keep=keep, grace_seconds=0, i_know_no_writer_is_active=True))
        step += 1


def _written_slowly(data: bytes):
    """``data`` as a ``LiveSpool`` its thread writes 1 MiB every 2 ms (in ``TRAINPROOF_SPOOL_DIR``): kills land while
    parts are uploaded from a file still being written."""
    from trainproof.storage.spool import LiveSpool

    view = memoryview(data)

    def fill(out) -> None:
        for at in range(0, len(view), 2**20):
            out.write(view[at:at + 2**20])
            time.sleep(0.002)

    return LiveSpool.serialise(fill, expected=len(view))


def _announce_claims() -> None:
    """Print ``claimed`` each time the S3 backend has claimed a key with its empty create-only PUT (the store's own
    code runs unchanged; this only observes it), so the runner can aim a kill between a claim and its multipart
    completion instead of hoping a random delay lands there."""
    from trainproof.storage.s3 import S3Backend

    claim = S3Backend._claim

    def observed(self, path: str, create_only: bool) -> bool:
        result = claim(self, path, create_only)
        if create_only and not result:
            print(f"claimed {path}", flush=True)
        return result

    S3Backend._claim = observed


@dataclass
class Report:
    kills: int = 0
    commits_seen: int = 0
    max_step: int = 0
    checks: int = 0
    partials_seen: int = 0
    """Kills that left an incomplete newest generation: proof that kills landed inside a commit."""
    claims_seen: int = 0
    """Kills that left an empty object in the newest incomplete generation: on an S3 server whose multipart
    completions are not create-only (Ceph RGW), a large file's claimed key whose upload the kill cut short."""
    kill_phase: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


def check_store(url: str, last_reported: int, report: Report) -> None:
    """The invariants after a kill."""
    from trainproof.storage import COMPLETE, open_store

    store = open_store(url)
    gens = store.scan(contract=CONTRACT, world=1)
    complete = [g for g in gens if g.status == COMPLETE]
    for g in complete:  # every committed generation's bytes verify, and are the bytes of that step
        loaded = store.load(g.step, contract=CONTRACT, world=1)
        report.checks += 1
        expected = payload(g.step, _scale(loaded.files["training_state.pt"], g.step))
        if loaded.files != expected:
            report.failures.append(f"{g.name}: committed content is not step {g.step}'s")
    latest = store.load_latest(contract=CONTRACT, world=1, quarantine=False)
    newest = complete[-1].step if complete else None
    if (latest.info.step if latest else None) != newest:
        report.failures.append(f"discovery returned {latest and latest.info.name}, newest complete is {newest}")
    if last_reported and (newest is None or newest < last_reported):
        report.failures.append(f"step {last_reported} was reported committed but discovery finds {newest}")
    if gens and gens[-1].status != COMPLETE:
        report.partials_seen += 1
        if any(e.size == 0 and not e.is_dir and not e.name.startswith(".") for e in store.list_dir(gens[-1].name)):
            report.claims_seen += 1
    bad = [g for g in gens if g.status not in (COMPLETE, "incomplete")]
    if bad:
        report.failures.append(f"unexpected statuses after a kill: {[(g.name, g.status, g.reason) for g in bad]}")


def _scale(data: bytes, step: int) -> int:
    return max(1, len(data) // (50_000 + (step * 104_729) % 400_000))


def run(url: str, kills: int, *, seed: int = 0, keep: int = 2, size_scale: int = 1, max_delay: float = 0.25,
        env: dict | None = None, progress=None, after_commits: int = 0, aim_claims: bool = False) -> Report:
    """Start the writer, SIGKILL it after a random delay, check the store, repeat ``kills`` times.
    ``after_commits``: the delay starts when a random one (the first to this) of the writer's commits starts, or at
    once (a chance in ``after_commits + 1``), so that kills land inside commits even on a store whose first write
    costs more than a commit (S3: the create-only probe). ``aim_claims`` (S3): every third kill waits for the writer
    to claim a large file's key and is killed at once, so kills land before a multipart completion on any machine
    (random delays alone missed that window in 12 kills on a fast one)."""
    rng = random.Random(seed)
    report = Report()
    last_reported = 0
    for i in range(kills):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.crashloop", "writer", url, str(keep), str(size_scale)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        ready = proc.stdout.readline()
        if ready.strip() != "ready":
            proc.kill()
            raise RuntimeError(f"writer failed to start: {ready!r} {proc.stderr.read()[-2000:]}")
        seen, starts = [], rng.randint(0, after_commits)
        while starts and (line := proc.stdout.readline()):
            seen.append(line)
            starts -= line.startswith("committing ")
        delay = rng.uniform(0, max_delay)
        if aim_claims and i % 3 == 2:  # every third kill: at once after a claim (the writer announces each one)
            while (line := proc.stdout.readline()) and not line.startswith("claimed "):
                seen.append(line)
            delay = 0.0
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        out, _err = proc.communicate(timeout=60)
        lines = [ln.strip() for ln in [*seen, *out.splitlines()] if ln.startswith("committed ")]
        report.kills += 1
        report.commits_seen += len(lines)
        report.kill_phase["after first commit" if lines else "during first commit"] += 1
        if lines:
            last_reported = int(lines[-1].split()[1])
        check_store(url, last_reported, report)
        report.max_step = max(report.max_step, last_reported)
        if progress:
            progress(i + 1, report)
        if report.failures:
            break
    return report


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "writer":
        writer(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2, int(sys.argv[4]) if len(sys.argv) > 4 else 1)
    else:
        sys.exit("usage: python -m tests.support.crashloop writer URL [KEEP] [SIZE_SCALE]")
