"""Evidence: does FSDP2 (``fully_shard``) + torch.distributed.checkpoint run on the CPU with gloo in this torch?

``.venv/bin/python bench/fsdp_evidence.py [--folder DIR]`` starts 2 processes (torch.multiprocessing, gloo,
CPU), wraps a small MLP with ``fully_shard``, runs forward/backward/Adam step, takes the sharded state with
``get_state_dict``, ``dcp.save``s it to a local folder, then reloads it into a fresh 2-process world and a
1-process world and compares every tensor exactly; then saves from 1 process and loads into 2. Each check prints one
line ``ok <what>`` or
``FAIL <what>: <ExceptionType>: <message>``; docs/fsdp.md records what this printed.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def _check(rank: int, what: str, fn):
    try:
        out = fn()
        if rank == 0:
            print(f"ok {what}", flush=True)
        return out
    except Exception as exc:  # noqa: BLE001 - evidence: print the exact error and stop this world
        print(f"FAIL {what} (rank {rank}): {type(exc).__name__}: {str(exc).strip().splitlines()[0][:400]}",
              flush=True)
        if os.environ.get("EVIDENCE_TRACEBACK"):
            traceback.print_exc()
        raise SystemExit(1)


def _full(sd: dict) -> dict:
    """Every DTensor of a (nested) state dict as its full tensor (collective), plain tensors as they are."""
    from torch.distributed.tensor import DTensor
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _full(v)
        elif isinstance(v, DTensor):
            out[k] = v.full_tensor()
        else:
            out[k] = v
    return out


def _flat(sd: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _worker(rank: int, world: int, port: int, folder: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _run(rank, world, folder, mode)
    finally:
        dist.destroy_process_group()


def _run(rank: int, world: int, folder: str, mode: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = _check(rank, f"[world {world}] init_device_mesh('cpu', ({world},))",
                  lambda: init_device_mesh("cpu", (world,)))
    model = _model()

    def shard():
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    _check(rank, f"[world {world}] fully_shard on CPU", shard)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step():
        torch.manual_seed(1)
        x = torch.randn(6, 8)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    if mode == "save":
        _check(rank, f"[world {world}] forward/backward/Adam step (gloo reduce-scatter/all-gather)", step)
        local = model[0].weight.to_local()
        if rank == 0:
            print(f"   rank 0 holds {tuple(local.shape)} of {tuple(model[0].weight.shape)} (layer 0 weight)",
                  flush=True)
        msd, osd = _check(rank, f"[world {world}] get_state_dict "
                                "(sharded DTensors)", lambda: get_state_dict(model, opt))
        _check(rank, f"[world {world}] dcp.save to a local folder",
               lambda: dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder))
        full = _flat(_full({"model": msd, "optim": osd}))
        if rank == 0:
            torch.save(full, os.path.join(folder, "..", "reference.pt"))
        return
    # load: a fresh model (different init), then the checkpoint; compare with the reference exactly
    torch.manual_seed(123)
    for p in model.parameters():
        torch.nn.init.normal_(p.to_local() if hasattr(p, "to_local") else p)
    _check(rank, f"[world {world}] forward/backward/Adam step before loading (creates optimizer state)", step)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    _check(rank, f"[world {world}] dcp.load into the sharded state", lambda: dcp.load(state, checkpoint_id=folder))
    _check(rank, f"[world {world}] set_state_dict", lambda: set_state_dict(
        model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]))
    msd, osd = get_state_dict(model, opt)
    got = _flat(_full({"model": msd, "optim": osd}))
    ref = torch.load(os.path.join(folder, "..", "reference.pt"), weights_only=True)

    def equal():
        bad = [k for k in ref if not (isinstance(ref[k], torch.Tensor) and torch.equal(ref[k], got[k])
                                      or not isinstance(ref[k], torch.Tensor) and ref[k] == got[k])]
        if bad or set(ref) != set(got):
            raise AssertionError(f"differs: {bad[:5]} keys {sorted(set(ref) ^ set(got))[:5]}")
        return len(ref)

    n = _check(rank, f"[world {world}] loaded model+optimizer equal the saved ones exactly (torch.equal)", equal)
    if rank == 0:
        print(f"   {n} entries compared", flush=True)
    _check(rank, f"[world {world}] a training step after loading", step)


def _world(world: int, folder: str, mode: str) -> bool:
    ctx = mp.start_processes(_worker, args=(world, _port(), folder, mode), nprocs=world, join=False,
                             start_method="spawn")
    try:
        while not ctx.join(timeout=120):
            pass
        return True
    except mp.ProcessRaisedException as exc:
        print(f"FAIL world {world} {mode}: {str(exc).strip().splitlines()[-1][:400]}", flush=True)
    except mp.ProcessExitedException as exc:
        print(f"FAIL world {world} {mode}: {exc}", flush=True)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default=None, help="where to save (default: a temporary folder)")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, gloo available: {dist.is_gloo_available()}, "
          f"cuda available: {torch.cuda.is_available()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = args.folder or tmp
        folder = os.path.join(base, "ckpt")
        ok = _world(2, folder, "save")
        ok = ok and _world(2, folder, "load")
        ok = ok and _world(1, folder, "load")
        folder1 = os.path.join(base, "ckpt1", "ckpt")  # and the other way: saved by 1 process, loaded by 2
        ok = ok and _world(1, folder1, "save") and _world(2, folder1, "load")
        print("result:", "FSDP2 + DCP run on CPU/gloo" if ok else "see FAIL lines", flush=True)
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
