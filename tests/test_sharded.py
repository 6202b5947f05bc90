"""Sharded generations (trainproof/train/sharded.py): FSDP2 model + Adam state saved through DCP into the generation store
by 2 real processes on gloo (CPU), loaded back bit for bit, resharded 2 → 1 and 1 → 2, a rank killed mid-save,
tampered bytes refused. The ranks are ``tests/support/sharded_worker.py``; a few checks run in this process
(world 1, no process group)."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from trainproof.errors import ConfigError
from trainproof.train import sharded
from trainproof.storage import open_store
from trainproof.storage.pieces import Pieces
from tests.support.timing import budget

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = "c" * 64


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(mode: str, store: Path, step: int, out: Path, world: int, **env: str) -> list[subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    port = str(_port())
    procs = []
    for rank in range(world):
        e = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
             "PYTHONWARNINGS": "ignore", **env}
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.support.sharded_worker", mode, str(store),
                                       str(step), str(out)], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str]]:
    done = []
    for p in procs:
        out, err = p.communicate(timeout=budget(timeout))
        done.append((p.returncode, out + err))
    return done


def run(mode: str, store: Path, step: int, out: Path, world: int, **env: str) -> list[dict]:
    results = finish(start(mode, store, step, out, world, **env))
    assert [code for code, _ in results] == [0] * world, [text[-3000:] for _, text in results]
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(world)]


def tensors(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def assert_equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    tensor_keys = [k for k in a if isinstance(a[k], torch.Tensor)]
    assert len(tensor_keys) >= 12  # 4 Linear layers: weights, biases, Adam's exp_avg/exp_avg_sq/step
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.fixture(scope="module")
def saved2(tmp_path_factory):
    """Generation 1 saved by 2 FSDP2 ranks after 3 Adam steps."""
    d = tmp_path_factory.mktemp("saved2")
    reports = run("save", d / "run", 1, d / "out", 2)
    assert reports[0]["committed"] == "step-00000001" and reports[1]["committed"] is None
    return d


def test_two_ranks_commit_one_manifest_listing_every_shard_and_the_metadata(saved2):
    store = open_store(str(saved2 / "run"))
    info = store.generation(1)
    assert info.status == "complete" and info.manifest["world"] == 2
    files = set(info.manifest["files"])
    assert {"dcp.metadata", "shard-00000.distcp", "shard-00001.distcp"} <= files
    assert files - {"dcp.metadata", "shard-00000.distcp", "shard-00001.distcp"} <= {"values-00000.distcp",
                                                                                   "values-00001.distcp"}
    assert info.manifest["extra"]["sharded"]["shards"] == ["shard-00000.distcp", "shard-00001.distcp"]
    assert info.manifest["dcp_metadata_sha256"] == info.manifest["files"]["dcp.metadata"]["sha256"]
    assert store.verify(1) is None
    # no rank held the whole state: each shard file is about half of the sharded bytes
    sizes = [info.manifest["files"][f"shard-0000{r}.distcp"]["bytes"] for r in (0, 1)]
    assert min(sizes) > 0.3 * sum(sizes)


def test_fresh_two_rank_world_loads_every_local_shard_bitwise(saved2):
    reports = run("load", saved2 / "run", 1, saved2 / "load2", 2)
    for r in (0, 1):
        assert_equal(tensors(saved2 / "out" / f"save-rank{r}.pt"), tensors(saved2 / "load2" / f"load-rank{r}.pt"))
        read = reports[r]["files_read"]
        assert f"shard-0000{r}.distcp" in read and f"shard-0000{1 - r}.distcp" not in read, read  # only its own
    assert_equal(tensors(saved2 / "out" / "save-full.pt"), tensors(saved2 / "load2" / "load-full.pt"))


def test_reshard_two_ranks_into_one(saved2):
    reports = run("load", saved2 / "run", 1, saved2 / "load1", 1, TP_SHARDED_RESHARD="1")
    assert {"shard-00000.distcp", "shard-00001.distcp"} <= set(reports[0]["files_read"])
    assert_equal(tensors(saved2 / "out" / "save-full.pt"), tensors(saved2 / "load1" / "load-full.pt"))


# whole-files: slow (TRAINPROOF_SLOW=1). Every other sharded test reads whole files (toy files are under the 32 MiB
# part size), the 2 -> 1 reshard among them; this one's point is the ranged read of the parts.
@pytest.mark.parametrize("parts", [pytest.param(False, marks=pytest.mark.slow), True], ids=["whole-files", "parts"])
def test_reshard_one_rank_into_two(tmp_path, parts):
    """With parts (4 KiB here, 32 MiB by default), each of the two ranks reads only the parts that hold its half
    of each tensor; without, each reads the whole file."""
    env = {"TP_SHARDED_HIDDEN": "128", **({"TRAINPROOF_DIGEST_PART_MIB": str(4096 / 2**20)} if parts else {})}
    run("save", tmp_path / "run", 1, tmp_path / "out", 1, **env)
    reports = run("load", tmp_path / "run", 1, tmp_path / "load2", 2, TP_SHARDED_RESHARD="1", **env)
    assert_equal(tensors(tmp_path / "out" / "save-full.pt"), tensors(tmp_path / "load2" / "load-full.pt"))
    shard = open_store(str(tmp_path / "run")).generation(1).manifest["files"]["shard-00000.distcp"]
    assert ("parts" in shard) == parts
    for report in reports:
        read = report["bytes_read"] / shard["bytes"]
        assert (0.4 < read < 0.75) if parts else read >= 1.0, (read, report)


def test_another_world_size_is_refused_without_allow_world_change(saved2):
    with pytest.raises(ConfigError, match="saved by 2 ranks and this run has 1; pass --allow-world-change"):
        sharded.load_sharded(open_store(str(saved2 / "run")), 1, {}, world=1)


def test_rank_killed_mid_save_leaves_no_complete_json_and_the_previous_generation_stands(saved2, tmp_path):
    shutil.copytree(saved2 / "run", tmp_path / "run")
    procs = start("save", tmp_path / "run", 2, tmp_path / "out", 2, TP_SHARDED_BLOCK_RANK="1")
    deadline = time.monotonic() + 90
    line = ""
    while "BLOCKING" not in line and time.monotonic() < deadline:
        line = procs[1].stdout.readline()
        assert line or procs[1].poll() is None, procs[1].stderr.read()[-2000:]
    os.kill(procs[1].pid, signal.SIGKILL)
    (code0, text0), (code1, _) = finish(procs, timeout=budget(90))
    # Rank 0 reports the failed save and exits 1; sometimes gloo then aborts it at interpreter exit instead
    # ("terminate called without an active exception": its transport thread to the killed peer is still joinable
    # when the process group is destroyed). Either way rank 0 saw the failure first (its report, below).
    assert code1 == -signal.SIGKILL and code0 in (1, -signal.SIGABRT), text0[-2000:]
    report = json.loads((tmp_path / "out" / "save-rank0.json").read_text())
    assert "step 2 was not committed" in report["error"]
    store = open_store(str(tmp_path / "run"))
    assert not (tmp_path / "run" / "step-00000002" / "COMPLETE.json").exists()
    assert [(g.step, g.status) for g in store.scan()] == [(1, "complete"), (2, "incomplete")] or \
        [(g.step, g.status) for g in store.scan()] == [(1, "complete")]
    assert [g.step for g in store.scan() if g.status == "complete"][-1] == 1


def test_a_tampered_shard_is_refused_on_every_rank(saved2, tmp_path):
    shutil.copytree(saved2 / "run", tmp_path / "run")
    victim = tmp_path / "run" / "step-00000001" / "shard-00001.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, one bit: only the sha256 can tell
    victim.chmod(0o644)
    victim.write_bytes(bytes(data))
    results = finish(start("load", tmp_path / "run", 1, tmp_path / "load", 2))
    assert [code for code, _ in results] == [1, 1], [t[-2000:] for _, t in results]
    for r in (0, 1):
        report = json.loads((tmp_path / "load" / f"load-rank{r}.json").read_text())
        assert report["error"].startswith("ShardedLoadError") and report["corrupt"] is True, report
        assert "shard-00001.distcp sha256 differs from COMPLETE.json" in report["error"], report


# -- in this process (world 1, no process group) -----------------------------------------------------------
def _small_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(6, 4, generator=g), "t": torch.randn(5, 5, generator=g).t(), "n": 4,
            "d": {"step": torch.tensor(7.0), "ids": torch.arange(9), "half": torch.randn(3, generator=g).half(),
                  "empty": torch.empty(0, 3)}}


def _zeros_like(state: dict) -> dict:
    return {k: _zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor)
            else type(v)() for k, v in state.items()}


def test_one_process_round_trip_of_plain_tensors_and_values(tmp_path):
    store = open_store(str(tmp_path / "run"))
    state = _small_state()
    info = sharded.save_sharded(store, 3, state, contract=CONTRACT, world=1, code_version="t")
    assert info.name == "step-00000003" and store.verify(3) is None
    got = _zeros_like(state)
    sharded.load_sharded(store, 3, got, world=1, contract=CONTRACT)
    assert got["n"] == 4 and all(torch.equal(got["d"][k], state["d"][k]) for k in state["d"])
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["t"], state["t"])


def test_a_buffered_save_writes_host_tensors_from_their_own_memory(tmp_path):
    """``--sync-checkpoint``'s path: the file is handed to the store as its tensors' own buffers
    (``trainproof.storage.pieces``), not copied into one Python buffer first (which is what tracemalloc would see)."""
    store = open_store(str(tmp_path / "run"))
    state = {"w": torch.arange(24 * 2**20, dtype=torch.float32), "n": 2}  # 96 MiB
    size = state["w"].numel() * 4
    handed = []
    write_part = store.write_part
    store.write_part = lambda step, files, **kw: handed.extend(files.values()) or write_part(step, files, **kw)
    tracemalloc.start()
    try:
        sharded.save_sharded(store, 1, state, contract=CONTRACT, world=1, code_version="t")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The read-back holds a few of its 8 MiB ranges at a time (one being read, one compared, its copy): ~24 MiB.
    assert peak < 40 * 2**20, f"the save allocated {peak / 2**20:.1f} MiB for {size / 2**20:.0f} MiB of tensors"
    # ...and no torch copy either (tracemalloc does not see those): the store got the tensor's own memory.
    views = [v for data in handed if isinstance(data, Pieces) for v in data.views]
    assert any(np.frombuffer(v, np.uint8).ctypes.data == state["w"].data_ptr() and v.nbytes == size for v in views)
    got = {"w": torch.zeros_like(state["w"]), "n": 0}
    sharded.load_sharded(store, 1, got, world=1, contract=CONTRACT)
    assert torch.equal(got["w"], state["w"]) and got["n"] == 2


def test_views_whose_memory_is_not_their_value_are_saved_as_their_value(tmp_path):
    """A transposed, a conjugate and a negative view: each chunk's bytes are its values, not its storage's."""
    store = open_store(str(tmp_path / "run"))
    z = torch.randn(4, 3, dtype=torch.complex64, generator=torch.Generator().manual_seed(2))
    state = {"conj": z.conj(), "neg": torch._neg_view(z), "t": z.real.t()}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    sharded.save_sharded(store, 1, state, contract=CONTRACT, world=1, code_version="t")
    got = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    sharded.load_sharded(store, 1, got, world=1, contract=CONTRACT)
    assert all(torch.equal(got[k], state[k].resolve_conj().resolve_neg()) for k in state)


def test_write_sharded_leaves_the_commit_to_the_caller(tmp_path):
    """What a checkpoint does (its training state joins the same COMPLETE.json): every file written and verified,
    nothing usable until ``commit_parts``; then it loads back exactly (transposed, half, empty, scalar tensors)."""
    store = open_store(str(tmp_path / "run"))
    entries, section = sharded.write_sharded(store, 2, _small_state())
    assert {"shard-00000.distcp", sharded.METADATA_FILE} <= set(entries) and section["shards"] == ["shard-00000.distcp"]
    assert store.load_latest(contract=CONTRACT) is None
    assert not (tmp_path / "run" / "step-00000002" / "COMPLETE.json").exists()
    store.commit_parts(2, entries, contract=CONTRACT, world=1, code_version="t", extra={"sharded": section},
                       digests={"dcp_metadata": sharded.METADATA_FILE})
    got = _zeros_like(_small_state())
    sharded.load_sharded(store, 2, got, world=1, contract=CONTRACT)
    assert torch.equal(got["t"], _small_state()["t"]) and torch.equal(got["d"]["half"], _small_state()["d"]["half"])
    assert got["d"]["empty"].shape == (0, 3) and torch.equal(got["d"]["step"], torch.tensor(7.0)) and got["n"] == 4


def test_tampered_metadata_is_refused_before_it_is_unpickled(tmp_path, monkeypatch):
    store = open_store(str(tmp_path / "run"))
    sharded.save_sharded(store, 1, _small_state(), contract=CONTRACT, world=1, code_version="t")
    meta = tmp_path / "run" / "step-00000001" / "dcp.metadata"
    raw = bytearray(meta.read_bytes())
    raw[-2] ^= 0x01
    meta.chmod(0o644)
    meta.write_bytes(bytes(raw))
    monkeypatch.setattr(sharded, "_unpickle", lambda _b: pytest.fail("unpickled unverified bytes"))
    with pytest.raises(sharded.ShardedLoadError, match="dcp.metadata sha256 differs") as err:
        sharded.load_sharded(store, 1, _zeros_like(_small_state()), world=1)
    assert err.value.corrupt


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_committed_metadata_naming_anything_but_dcp_classes_is_refused(tmp_path):
    """A manifest that vouches for hostile metadata (a writer of the bucket without the signing key can commit
    one): the allowlisted unpickler refuses it instead of running it."""
    store = open_store(str(tmp_path / "run"))
    evil = pickle.dumps(_Evil())
    store.commit(1, {"dcp.metadata": evil, "shard-00000.distcp": b""}, contract=CONTRACT, world=1,
                 code_version="t", extra={"sharded": {"format": sharded.FORMAT}})
    with pytest.raises(sharded.ShardedLoadError, match="may not name posix.system|may not name os.system"):
        sharded.load_sharded(store, 1, {}, world=1)


def test_a_byte_value_that_is_not_plain_is_refused(tmp_path):
    store = open_store(str(tmp_path / "run"))
    state = {"w": torch.ones(3), "obj": _Evil()}
    sharded.save_sharded(store, 1, state, contract=CONTRACT, world=1, code_version="t")
    with pytest.raises(sharded.ShardedLoadError, match="'obj' is not a plain value"):
        sharded.load_sharded(store, 1, {"w": torch.zeros(3), "obj": None}, world=1)


def test_an_incomplete_or_plain_generation_is_not_loaded_as_sharded(tmp_path):
    store = open_store(str(tmp_path / "run"))
    store.commit(1, {"training_state.pt": b"x"}, contract=CONTRACT, world=1, code_version="t")
    with pytest.raises(sharded.ShardedLoadError, match="is not a sharded generation"):
        sharded.load_sharded(store, 1, {}, world=1)
    with pytest.raises(sharded.ShardedLoadError, match="is not usable"):
        sharded.load_sharded(store, 2, {}, world=1)


def test_the_metadata_unpickler_reads_what_dcp_writes():
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(torch.bfloat16), torch.Size([4, 2]),
                                               [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2]))])},
                  storage_data={MetadataIndex("w", [0, 0]): ("shard-00000.distcp", 0, 16)}, planner_data={"w": ("w",)})
    back = sharded._unpickle(pickle.dumps(md))
    assert back.state_dict_metadata == md.state_dict_metadata and back.storage_data == md.storage_data
    with pytest.raises(pickle.UnpicklingError):
        sharded._unpickle(pickle.dumps(io.BytesIO(b"x")))
