"""Two real processes commit the same step at the same moment: exactly one wins, the other gets a clear
conflict error, and the winner's generation verifies with the winner's bytes.

On S3 three times: with small files (single create-only PUTs), with files of several multipart parts, whose
completion Ceph RGW does not make create-only (the store claims their keys first: ``trainproof.storage.s3``), and
with those parts uploaded while the file is still being written (a ``LiveSpool``, as the trainer commits on S3)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.timing import budget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RACER = r"""
import os, sys, time
from trainproof.storage import open_store, CommitConflictError
url, step, who, go, repeat = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
live = sys.argv[6:] == ["live"]
store = open_store(url)
store.scan()  # warm the client up before the start line
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.0005)
state = who.encode() * repeat
if live:  # uploaded while a thread writes it, as the trainer's S3 commits are
    from trainproof.storage.spool import LiveSpool
    view = memoryview(state)

    def fill(out):  # 1 MiB every 30 ms: the parts go up while the file grows
        for i in range(0, len(view), 2**20):
            out.write(view[i:i + 2**20])
            time.sleep(0.03)

    state = LiveSpool.serialise(fill, expected=len(view))
try:
    store.commit(step, {"training_state.pt": state, "meta.json": who.encode()},
                 contract="c", world=1, code_version="race")
    print("won", flush=True)
except CommitConflictError as exc:
    print("conflict:", exc, flush=True)
finally:
    if live:
        state.unlink()
"""


def race(url: str, step: int, go: str, env=None, repeat: int = 200_000, live: bool = False) -> dict[str, str]:
    procs = {}
    for who in ("alice", "bobby"):  # names of one length: files of one size, told apart only by their bytes
        argv = [sys.executable, "-c", RACER, url, str(step), who, go, str(repeat)] + (["live"] if live else [])
        procs[who] = subprocess.Popen(argv, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for p in procs.values():
        assert p.stdout.readline().strip() == "ready"
    open(go, "w").close()
    results = {}
    for who, p in procs.items():
        out, err = p.communicate(timeout=budget(120))
        assert p.returncode == 0, err[-2000:]
        results[who] = out.strip()
    return results


@pytest.mark.parametrize("backend", ["local", "s3", "s3-multipart", "s3-live"])
def test_exactly_one_of_two_concurrent_writers_commits(backend, tmp_path, request):
    repeat = 200_000  # 1 MB: one PUT
    if backend.startswith("s3"):
        url, env = f"s3://{request.getfixturevalue('s3_env')}/race/run", dict(os.environ)
        if backend != "s3":  # 12.5 MB in 5 MiB parts: three parts, completed by CompleteMultipartUpload; s3-live:
            # uploaded part by part while a thread still writes the spool (trainproof.storage.spool.LiveSpool)
            env["TRAINPROOF_PART_SIZE_MB"], repeat = "5", 2_500_000
            env["TRAINPROOF_SPOOL_DIR"] = str(tmp_path)
    else:
        url, env = str(tmp_path / "run"), None
    from trainproof.storage import open_store

    winners_of = {}
    for step in range(1, 6):
        results = race(url, step, str(tmp_path / f"go-{step}"), env, repeat, live=backend == "s3-live")
        winners = [w for w, r in results.items() if r == "won"]
        losers = [w for w, r in results.items() if r.startswith("conflict:")]
        assert len(winners) == 1 and len(losers) == 1, results
        assert f"step-{step:08d}" in results[losers[0]]
        winners_of[step] = winners[0]
    store = open_store(url)  # after every race: no loser's upload replaced a committed object, even late
    for step, winner in winners_of.items():
        loaded = store.load(step)
        assert loaded.files["meta.json"] == winner.encode()
        assert loaded.files["training_state.pt"] == winner.encode() * repeat
