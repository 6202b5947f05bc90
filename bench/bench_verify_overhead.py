"""Wall time of ``trainproof verify`` against a bare run of the same fresh processes.

The verifier's cost is its training processes; everything else (seeding the resumed paths' stores through
write -> verify -> mark usable, reading every generation back and comparing, the report) is overhead. This
script measures that overhead side by side:

1. ``python -m job verify --store <root>/v --id bench --no-export [ARGS]`` (timed as a whole process);
2. the same ``train`` command lines, read from its ``verification.json`` (the four protocol paths, the extra
   cuts' paths and the objective check's runs), run directly into fresh folders, in the verifier's two phases
   and with its concurrency: phase 1 the continuous and cut paths, any ``cut_at_<c>`` processes and the
   objective runs at once; then each resumed path's folder gets a plain file copy of plan.json and the
   generation it resumes from; phase 2 the resumed paths at once.

Reported: both wall times, their ratio (goal <= 2) and the phases. Medians over ``--repeats`` alternating runs.
Writes ``bench/out/verify_overhead.json``. Not run by CI.

    python bench/bench_verify_overhead.py                       # regression, the default verification
    python bench/bench_verify_overhead.py --repeats 3 -- --task tinylm --config cfg.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_verify(root: Path, extra: list[str]) -> tuple[float, dict]:
    """The verifier as a user runs it; (wall seconds, verification.json)."""
    store = root / "v"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "job", "verify", "--store", str(store), "--id", "bench",
                           "--no-export", *extra], cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"verify exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return wall, json.loads((store / "verification" / "bench" / "verification.json").read_text())


def _commands(report: dict) -> dict[str, dict]:
    """Every training process of the verification: name -> {store, argv}."""
    paths = {**report["paths"], **report["cuts"]["paths"]}
    paths.update({f"objective/{k}": v for k, v in (report.get("objective_equivalence") or {}).get("paths", {}).items()})
    return {name: {"store": p["store"], "argv": shlex.split(p["command"])} for name, p in paths.items()}


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait(procs: dict[str, subprocess.Popen]) -> None:
    for name, proc in procs.items():
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"bare {name} exited {proc.returncode}: {err[-1500:]}")


def run_bare(root: Path, report: dict) -> tuple[float, dict[str, float]]:
    """The same command lines, directly, into ``root/bare``; (wall seconds, phase seconds)."""
    old = report["location"]
    new = str(root / "bare")
    cmds = {n: {"store": c["store"].replace(old, new), "argv": [a.replace(old, new) for a in c["argv"]]}
            for n, c in _commands(report).items()}
    resumed = {n: c for n, c in cmds.items() if n.startswith("resume")}
    first = {n: c for n, c in cmds.items() if n not in resumed}
    cut, cuts = report["settings"]["cut"], report["cuts"]
    t0 = time.monotonic()
    _wait({n: _start(c["argv"]) for n, c in first.items()})
    t1 = time.monotonic()
    for name, c in resumed.items():  # a plain copy of plan.json and the generation the path resumes from
        at = cut if name in ("resume", "resume_without_rng") else int(name.rsplit("_", 1)[1])
        if name in ("resume", "resume_without_rng"):
            source = first["cut"]["store"]
        elif cuts["resumed_from"][str(at)] == "continuous path's generation":
            source = first["continuous"]["store"]
        else:
            source = first[f"cut_at_{at}"]["store"]
        dest = Path(c["store"])
        dest.mkdir(parents=True)
        shutil.copy2(Path(source) / "plan.json", dest / "plan.json")
        shutil.copytree(Path(source) / f"step-{at:08d}", dest / f"step-{at:08d}")
    t2 = time.monotonic()
    _wait({n: _start(c["argv"]) for n, c in resumed.items()})
    t3 = time.monotonic()
    return t3 - t0, {"phase1": t1 - t0, "copies": t2 - t1, "phase2": t3 - t2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("verify_args", nargs="*", help="extra verify options, after --")
    args = parser.parse_args()
    rows = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="tp-bench-verify-") as tmp:
            wall_v, report = run_verify(Path(tmp), args.verify_args)
            wall_b, phases = run_bare(Path(tmp), report)
        rows.append({"verify_s": wall_v, "bare_s": wall_b, "ratio": wall_v / wall_b, **phases,
                     "processes": len(_commands(report))})
        print(f"run {i + 1}: verify {wall_v:.1f} s, bare {wall_b:.1f} s ({phases['phase1']:.1f} + "
              f"{phases['phase2']:.1f}), ratio {wall_v / wall_b:.2f}, {rows[-1]['processes']} processes", flush=True)
    summary = {k: statistics.median(r[k] for r in rows) for k in ("verify_s", "bare_s", "ratio")}
    print(f"median: verify {summary['verify_s']:.1f} s, bare {summary['bare_s']:.1f} s, ratio {summary['ratio']:.2f}")
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "verify_overhead.json").write_text(json.dumps({"args": args.verify_args, "runs": rows,
                                                          "median": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
