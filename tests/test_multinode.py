"""Two nodes without a cluster: two trainproof launchers on loopback (``--nnodes 2 --node-rank 0/1``, one
rendezvous on 127.0.0.1, one rank each, gloo on the CPU), sharded with FSDP2 as the Indexed Job example in
``infra/k8s/multinode`` would run them. One node is SIGTERMed (as Kubernetes stops one pod): every rank stops at one
committed step, both launchers exit 75, and the restart of both nodes ends bit for bit equal to an uninterrupted
2-rank run.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

from tests.support.timing import budget
from tests.test_dist_helpers import DIST_ARGS, load_world_state, read_until, start_world
from tests.test_train_helpers import ROOT, differences, finish, trajectory, train_env

TARGET = 24
CONFIG = {"rows": 21}
STEP_DELAY = {"TPHOOK_STEP_DELAY": "0.02"}  # test-only: lets the signal land mid-run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(store, rank: int, port: int, *args: str, env=None) -> subprocess.Popen:
    from tests.test_train_helpers import entry_module

    cmd = [sys.executable, "-m", entry_module(env), "train", "--store", str(store), "--nproc-per-node", "1",
           "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
           *DIST_ARGS, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=train_env(env), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_two_nodes_on_loopback_stop_together_and_resume_bitwise(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps(CONFIG))
    common = ("--config", str(tmp_path / "cfg.json"), "--fsdp", "--max-steps", str(TARGET))
    reference = start_world(tmp_path / "ref", *common)  # one launcher, two ranks: the same world

    store, port = tmp_path / "nodes", _free_port()
    nodes = [_node(store, r, port, *common, "--checkpoint-every", "5", env=STEP_DELAY) for r in (0, 1)]
    lines: list[str] = []
    start = read_until(nodes[0], lambda e: e.get("event") == "start", lines)
    read_until(nodes[0], lambda e: e.get("event") == "step" and e["step"] >= start["step"] + 6, lines)
    nodes[1].send_signal(signal.SIGTERM)  # node 1's launcher forwards it to its rank; the ranks agree to stop
    results = [finish(n, timeout=budget(180)) for n in nodes]
    assert [r.code for r in results] == [75, 75], [r.stderr[-2000:] for r in results]
    stopped = next(e for e in results[0].events if e.get("event") == "stopped")
    cut = load_world_state(store)
    assert cut["progress"]["step"] == stopped["step"] < TARGET
    assert len(cut["ranks"]) == 2 and cut["ranks"][1]["step"] == stopped["step"]  # both ranks, one moment

    port = _free_port()
    restart = [_node(store, r, port, *common) for r in (0, 1)]
    done = [finish(n, timeout=budget(180)) for n in restart]
    assert [r.code for r in done] == [0, 0], [r.stderr[-2000:] for r in done]
    assert next(e for e in done[0].events if e.get("event") == "resume")["step"] == stopped["step"]
    ref = finish(reference, timeout=budget(180))
    assert ref.code == 0, ref.stderr[-2000:]
    assert differences(trajectory(load_world_state(tmp_path / "ref")), trajectory(load_world_state(store))) == []
    # The model and optimizer live in the shards: the same bytes, file by file, as the uninterrupted run's.
    assert _shard_digests(tmp_path / "ref") == _shard_digests(store) != {}


def _shard_digests(store) -> dict[str, str]:
    from trainproof.format.shard_files import is_sharded_file
    from trainproof.storage import open_store

    newest = [g for g in open_store(str(store)).scan() if g.status == "complete"][-1]
    return {name: meta["sha256"] for name, meta in newest.manifest["files"].items() if is_sharded_file(name)}


def _barrier_node(node_rank: int, port: int, wait_s: float):
    from trainproof.train.launch import LaunchConfig

    return LaunchConfig(nproc_per_node=1, nnodes=2, node_rank=node_rank, master_port=port, exit_barrier_s=wait_s)


def test_node_zero_keeps_the_store_up_until_the_other_node_reports(capsys):
    """The ranks of node 1 use node 0's store until they have exited: node 0's launcher waits for node 1's."""
    import threading
    import time

    from trainproof.train import launch

    port = _free_port()
    host = launch._host_store(_barrier_node(0, port, 30))
    reported_at: list[float] = []

    def node_one() -> None:
        time.sleep(0.5)
        reported_at.append(time.monotonic())
        launch._exit_barrier(_barrier_node(1, port, 30), None, port, 75)

    thread = threading.Thread(target=node_one)
    thread.start()
    launch._exit_barrier(_barrier_node(0, port, 30), host, port, 75)
    returned_at = time.monotonic()
    thread.join()
    assert reported_at and returned_at >= reported_at[0]  # node 0 returned only after node 1's report
    assert host.get("trainproof/exited/1") == b"75"
    assert "exit_barrier_incomplete" not in capsys.readouterr().out


def test_node_zero_stops_waiting_for_a_node_that_never_reports(capsys):
    from trainproof.train import launch

    port = _free_port()
    host = launch._host_store(_barrier_node(0, port, 0.5))
    launch._exit_barrier(_barrier_node(0, port, 0.5), host, port, 0)
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["event"] for e in events] == ["exit_barrier_incomplete"]
    assert 0.4 <= events[0]["after_s"] < budget(10)
