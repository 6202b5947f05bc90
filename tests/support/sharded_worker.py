"""One rank of a sharded-checkpoint test world (``tests/test_sharded.py``, ``bench/bench_sharded.py``).

``python -m tests.support.sharded_worker MODE STORE STEP OUT`` with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set:
builds an MLP wrapped with FSDP2 (``fully_shard``) on a CPU mesh over gloo, with Adam, and

- ``save``: trains ``TP_SHARDED_STEPS`` steps and saves model + optimizer as sharded generation STEP;
- ``load``: builds the same model with another initialisation, takes one step (so the optimizer has state to
  load into), loads generation STEP (``--allow-world-change`` semantics when ``TP_SHARDED_RESHARD=1``).

Either way it writes ``OUT/<mode>-rank<r>.pt`` (this rank's local shards) and, on rank 0, ``OUT/<mode>-full.pt``
(every tensor gathered whole: a test-only comparison; the product never materialises the full state), and
``OUT/<mode>-rank<r>.json`` (the files this rank read, or the error it raised).

Test-only fault: ``TP_SHARDED_BLOCK_RANK=r`` makes rank r print ``BLOCKING`` and sleep before writing its
shard (a subclass of the writer, here only), so a test can SIGKILL it mid-save.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def build(hidden: int, layers: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = [torch.nn.Linear(8, hidden), torch.nn.Tanh()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    mods.append(torch.nn.Linear(hidden, 3))
    return torch.nn.Sequential(*mods)


def shard(model: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(16, 8, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def flat(sd: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def local_and_full(state: dict) -> tuple[dict, dict]:
    from torch.distributed.tensor import DTensor

    local, full = {}, {}
    for k, v in flat(state).items():
        if isinstance(v, DTensor):
            local[k] = v.to_local().clone()
            full[k] = v.full_tensor()  # collective: every rank runs it
        else:
            local[k] = full[k] = v.clone() if isinstance(v, torch.Tensor) else v
    return local, full


def main(mode: str, url: str, step: int, out: str) -> int:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from trainproof.train import sharded
    from trainproof.storage import open_store

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    hidden, layers = int(os.environ.get("TP_SHARDED_HIDDEN", "24")), int(os.environ.get("TP_SHARDED_LAYERS", "3"))
    model = shard(build(hidden, layers, seed=0 if mode == "save" else 7), world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    store = open_store(url)
    report: dict = {"rank": rank, "world": world}
    if mode == "save":
        for i in range(int(os.environ.get("TP_SHARDED_STEPS", "3"))):
            train_step(model, opt, i)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        block = os.environ.get("TP_SHARDED_BLOCK_RANK")
        if block is not None:
            sharded.GenerationWriter = _blocking_writer(sharded.GenerationWriter, int(block), rank)
        try:
            info = sharded.save_sharded(store, step, state, contract="c" * 64, world=world, code_version="test")
            report["committed"] = info.name if info else None
        except sharded.ShardedSaveError as exc:
            report["error"] = str(exc)
    else:
        train_step(model, opt, 99)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        reader_files: list = []
        reader_bytes = [0]
        orig = sharded.GenerationReader.read_data

        def recording(self, plan, planner):
            fut = orig(self, plan, planner)
            reader_files.extend(self.files_read)
            reader_bytes[0] += self.bytes_read
            return fut

        sharded.GenerationReader.read_data = recording
        try:
            sharded.load_sharded(store, step, state, world=world, allow_world_change=os.environ.get(
                "TP_SHARDED_RESHARD") == "1")
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            report["error"] = f"{type(exc).__name__}: {exc}"
            report["corrupt"] = getattr(exc, "corrupt", None)
        report["files_read"], report["bytes_read"] = reader_files, reader_bytes[0]
    if "error" not in report:
        local, full = local_and_full(state)
        torch.save(local, os.path.join(out, f"{mode}-rank{rank}.pt"))
        if rank == 0:
            torch.save(full, os.path.join(out, f"{mode}-full.pt"))
    with open(os.path.join(out, f"{mode}-rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if "error" not in report:
        dist.destroy_process_group()
    return 1 if "error" in report else 0


def _blocking_writer(base, block: int, rank: int):
    class Blocking(base):
        def write_data(self, plan, planner):
            if rank == block:
                print("BLOCKING", flush=True)
                time.sleep(600)
            return super().write_data(plan, planner)
    return Blocking


if __name__ == "__main__":
    code = main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
    # As a trainproof rank ends (trainproof.cli.train._exit_rank): without the interpreter's finalization, whose destruction
    # of torch.distributed's C++ objects after the peer (the store's host) has gone can abort the process
    # ("terminate called without an active exception", SIGABRT) after all its work is done and reported.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
