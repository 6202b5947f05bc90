"""Where one process's sharded save and load spend their time (no process group, no ranks).

``.venv/bin/python bench/profile_sharded_io.py [--mib 120]`` saves a flat state of float32 tensors of ``--mib`` MiB
with ``trainproof.train.sharded.save_sharded`` into a temporary run folder and loads it back with ``load_sharded``, next
to
``dcp.save``/``dcp.load`` of the same state into a folder beside it, then prints cProfile's top functions of one
more load (sha256, buffer allocation, copies). A diagnostic for ``bench/RESULTS.md``, not a benchmark: the ratios
come from ``bench/bench_sharded.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=120, help="state size in MiB (tensors of 20 MiB each)")
    args = ap.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp

    from trainproof.storage import open_store
    from trainproof.train.sharded import load_sharded, save_sharded

    warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save/load in a single process"
    folder = Path(tempfile.mkdtemp(prefix="tp-prof-"))
    try:
        store = open_store(str(folder / "run"))
        state = {"model": {f"w{i}": torch.randn(1024, 5120) for i in range(max(1, args.mib // 20))}}
        target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
        t = time.perf_counter()
        save_sharded(store, 1, state, contract="profile", world=1, code_version="profile")
        ours_save = time.perf_counter() - t
        t = time.perf_counter()
        load_sharded(store, 1, target, world=1)
        ours_load = time.perf_counter() - t
        t = time.perf_counter()
        dcp.save(state, checkpoint_id=str(folder / "dcp"))
        dcp_save = time.perf_counter() - t
        t = time.perf_counter()
        dcp.load(target, checkpoint_id=str(folder / "dcp"))
        dcp_load = time.perf_counter() - t
        print(f"save: ours {ours_save:.3f} s, DCP {dcp_save:.3f} s; load: ours {ours_load:.3f} s, DCP {dcp_load:.3f} s")
        profile = cProfile.Profile()
        profile.enable()
        load_sharded(store, 1, target, world=1)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
