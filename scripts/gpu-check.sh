#!/usr/bin/env bash
# The GPU check: one command on a machine with a CUDA GPU, from the repository root:
#   bash scripts/gpu-check.sh              # ~1 B-parameter bench state (12 GB with Adam), under 8 minutes on one GPU
#   bash scripts/gpu-check.sh --dry-run    # the same steps on the CPU at toy sizes (what the test suite runs)
# It runs (1) the CUDA-marked tests (tests marked `cuda`: CUDA generator restore, pinned snapshots, float16 + GradScaler
# and bfloat16 autocast, a CUDA stop/resume, NCCL over 2 ranks where 2 GPUs exist), then (2) the stall/throughput
# bench (bench/bench_async_stall.py: blocked time per asynchronous checkpoint and steps/s against no checkpoint), and
# prints one summary table (also written to $GPU_CHECK_OUT/summary.md). Record that table in bench/RESULTS.md.
# Python: $PYTHON, else .venv/bin/python (bash scripts/dev.sh test creates it), else python3.
# GPU_CHECK_STATE_MIB: the bench's state size (default 11444 MiB: 1.0e9 parameters x 12 bytes, weights + Adam).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) echo "usage: bash scripts/gpu-check.sh [--dry-run]" >&2; exit 2 ;;
esac
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x "$here/.venv/bin/python" ]; then py="$here/.venv/bin/python"; else py=python3; fi
fi
out="${GPU_CHECK_OUT:-$here/bench/out/gpu-check}"
mkdir -p "$out"
started=$(date +%s)

if [ "$dry" = 1 ]; then
  mib=4; every=2; checkpoints=2
else
  if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: torch sees no CUDA device (torch.cuda.is_available() is False); --dry-run runs on the CPU" >&2
    exit 2
  fi
  mib="${GPU_CHECK_STATE_MIB:-11444}"; every=10; checkpoints=2
fi

echo "[gpu-check] 1/2 CUDA-marked tests" >&2
set +e
# Only the modules that mark tests `cuda` are collected (collecting the whole suite costs ~20 s of imports).
mapfile -t modules < <(grep -l "mark.cuda" tests/test_*.py)
"$py" -m pytest -q -m cuda -p no:cacheprovider --junitxml="$out/cuda-tests.xml" "${modules[@]}" \
  >"$out/cuda-tests.log" 2>&1
tests_rc=$?
set -e
tail -n 3 "$out/cuda-tests.log" >&2
# pytest: 0 passed, 1 failures, 5 nothing collected (the marker matched nothing: a failure of this check too)
[ "$tests_rc" -le 1 ] || { echo "gpu-check: pytest exited $tests_rc (see $out/cuda-tests.log)" >&2; exit 1; }

echo "[gpu-check] 2/2 stall/throughput bench at ${mib} MiB of state" >&2
set +e
"$py" bench/bench_async_stall.py --sizes "$mib" --modes async,none --repeats 1 --every "$every" \
  --checkpoints "$checkpoints" --out-dir "$out" >"$out/bench.log" 2>&1
bench_rc=$?
set -e
[ "$bench_rc" = 0 ] || tail -n 20 "$out/bench.log" >&2

"$py" - "$out" "$tests_rc" "$bench_rc" "$started" "$dry" <<'EOF'
import json, os, sys, time, xml.etree.ElementTree as ET

out, tests_rc, bench_rc, started, dry = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
import torch

device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device (CPU dry run)"
suite = ET.parse(os.path.join(out, "cuda-tests.xml")).getroot()
suite = suite if suite.tag == "testsuite" else suite[0]
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
rows = [("device", device), ("torch", torch.__version__),
        ("CUDA-marked tests", f"{passed} passed, {counts['failures'] + counts['errors']} failed, "
                              f"{counts['skipped']} skipped")]
bench = os.path.join(out, "async_stall.json")
if bench_rc == 0 and os.path.exists(bench):
    runs = json.load(open(bench))["runs"]
    by = {r["mode"]: r for r in runs}
    a, n = by.get("async"), by.get("none")
    if a:
        blocked = sorted(a["blocked_s"])[len(a["blocked_s"]) // 2] if a["blocked_s"] else float("nan")
        rows.append(("bench state", f"{a['mib']:g} MiB ({a['mib'] * 2**20 / 12 / 1e9:.2f} B parameters with Adam)"))
        rows.append(("blocked per checkpoint (median)", f"{blocked:.3f} s (copy to host {a['copy_s']:.3f} s: "
                                                        f"stall {blocked / a['copy_s']:.2f}x)"))
        if n:
            rows.append(("throughput with checkpoints", f"{a['steps_per_s'] / n['steps_per_s']:.3f}x of none "
                                                        f"({a['steps_per_s']:.2f} vs {n['steps_per_s']:.2f} step/s)"))
else:
    rows.append(("bench", f"failed (exit {bench_rc}): see {out}/bench.log"))
rows.append(("wall time", f"{time.time() - started:.0f} s"))
ok = tests_rc == 0 and bench_rc == 0
rows.append(("result", "PASS" if ok else "FAIL"))
table = "| gpu-check | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"
open(os.path.join(out, "summary.md"), "w").write(table)
print(table)
sys.exit(0 if ok else 1)
EOF
