"""``scripts/gpu-check.sh``, the one command for a CUDA machine, where there is none: it parses (``bash -n``), passes
shellcheck, refuses to pretend on a machine without CUDA, and its ``--dry-run`` runs every step on the CPU (the
CUDA-marked tests collected and skipped, the stall/throughput bench at a toy size) and prints the summary table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.timing import budget
from tests.test_infra import tool

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def _env(out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_")}
    return {**env, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(out)}


def test_gpu_check_parses_and_passes_shellcheck():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    out = subprocess.run([tool("shellcheck"), "--severity=style", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_gpu_check_without_cuda_says_so_and_exits_2(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                            timeout=budget(120))
    assert result.returncode == 2 and "no CUDA device" in result.stderr and "--dry-run" in result.stderr


def test_gpu_check_dry_run_runs_every_step_on_the_cpu_and_prints_one_table(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                            text=True, timeout=budget(600))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    table = (tmp_path / "summary.md").read_text()
    assert table in result.stdout and "| result | PASS |" in table
    cuda_tests = [line for line in table.splitlines() if line.startswith("| CUDA-marked tests |")]
    assert cuda_tests and " 0 failed, " in cuda_tests[0] and " 0 skipped" not in cuda_tests[0], table
    assert "| blocked per checkpoint (median) |" in table and "| throughput with checkpoints |" in table
    assert (tmp_path / "async_stall.json").is_file() and (tmp_path / "cuda-tests.xml").is_file()
