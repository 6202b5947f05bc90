"""Wall time of ``trainproof verify`` against a bare run of the same fresh processes.

The verifier's cost is its training processes; everything else (seeding the resumed paths' stores through
write -> verify -> mark usable, reading every generation back and comparing, the report) is overhead. This
script measures that overhead side by side:

1. ``python -m trainproof verify --store <root>/v --id bench --no-export [ARGS]`` (timed as a whole process);
2. the same ``train`` command lines, read from its ``verification.json`` (the four protocol paths, the extra
   cuts' paths and the objective check's runs), run directly into fresh folders with the verifier's own process
   runner (``trainproof.proof.paths.run_processes``: same environment, pipes, sessions), in its two phases and with its
   concurrency: phase 1 the continuous and cut paths, any ``cut_at_<c>`` processes and the
   objective runs at once; then each resumed path's folder gets a plain file copy of plan.json and the
   generation it resumes from; phase 2 the resumed paths at once.

Reported: both wall times, their ratio (goal <= 2), the phases, and the CPU seconds of all child processes
of each side (``getrusage(RUSAGE_CHILDREN)``), which a loaded shared machine disturbs less than wall time.
Medians over ``--repeats`` runs; odd runs measure the bare side first, even runs the verifier first (the bare
side always needs the verifier's report for its command lines, so a "bare first" run reuses the previous one's).
Writes ``bench/out/verify_overhead.json``. Not run by CI.

    python bench/bench_verify_overhead.py                       # regression, the default verification
    python bench/bench_verify_overhead.py --repeats 3 -- --task tinylm --config cfg.json
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainproof.proof.paths import run_processes  # noqa: E402  (the verifier's own process runner: same spawning)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_verify(root: Path, extra: list[str]) -> tuple[float, dict]:
    """The verifier as a user runs it; (wall seconds, verification.json)."""
    store = root / "v"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "trainproof", "verify", "--store", str(store), "--id", "bench",
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


def _run(cmds: dict[str, dict]) -> None:
    """Run command lines concurrently with the verifier's own runner (same environment, pipes and sessions)."""
    for r in run_processes([(n, c["store"], c["argv"]) for n, c in cmds.items()], timeout=3600):
        if r.code != 0:
            raise SystemExit(f"bare {r.name} exited {r.code}: {r.stderr_tail}")


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
    _run(first)
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
    _run(resumed)
    t3 = time.monotonic()
    return t3 - t0, {"phase1": t1 - t0, "copies": t2 - t1, "phase2": t3 - t2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("verify_args", nargs="*", help="extra verify options, after --")
    args = parser.parse_args()
    rows = []
    report = None
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="tp-bench-verify-") as tmp:
            sides = {}
            order = ("bare", "verify") if i % 2 and report is not None else ("verify", "bare")
            for side in order:
                c0 = _cpu()
                if side == "verify":
                    wall_v, report = run_verify(Path(tmp), args.verify_args)
                    sides["verify_cpu_s"] = _cpu() - c0
                else:
                    wall_b, phases = run_bare(Path(tmp), report)
                    sides["bare_cpu_s"] = _cpu() - c0
        rows.append({"verify_s": wall_v, "bare_s": wall_b, "ratio": wall_v / wall_b, **phases, **sides,
                     "cpu_ratio": sides["verify_cpu_s"] / sides["bare_cpu_s"], "order": order,
                     "processes": len(_commands(report))})
        print(f"run {i + 1} ({' then '.join(order)}): verify {wall_v:.1f} s, bare {wall_b:.1f} s "
              f"({phases['phase1']:.1f} + {phases['phase2']:.1f}), ratio {wall_v / wall_b:.2f}; CPU "
              f"{sides['verify_cpu_s']:.1f} s vs {sides['bare_cpu_s']:.1f} s, ratio {rows[-1]['cpu_ratio']:.2f}; "
              f"{rows[-1]['processes']} processes", flush=True)
    summary = {k: statistics.median(r[k] for r in rows)
               for k in ("verify_s", "bare_s", "ratio", "verify_cpu_s", "bare_cpu_s", "cpu_ratio")}
    print(f"median: verify {summary['verify_s']:.1f} s, bare {summary['bare_s']:.1f} s, ratio {summary['ratio']:.2f}; "
          f"CPU {summary['verify_cpu_s']:.1f} s vs {summary['bare_cpu_s']:.1f} s, ratio {summary['cpu_ratio']:.2f}")
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "verify_overhead.json").write_text(json.dumps({"args": args.verify_args, "runs": rows,
                                                          "median": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
