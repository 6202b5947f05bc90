#!/usr/bin/env bash
# One entry point for a fresh machine with only Python >= 3.10 and pip:
#   bash scripts/dev.sh train --store ./runs/demo ...   # creates .venv on first use, then runs `trainproof`
#   bash scripts/dev.sh test [pytest args]               # creates .venv (with test extras), then runs pytest
#                                                        # in parallel (TRAINPROOF_TEST_WORKERS, default: one per core)
# TRAINPROOF_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu: the CPU-only torch (see README, "Install").
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TRAINPROOF_VENV:-$here/.venv}"
py="${PYTHON:-python3}"
stamp="$venv/.trainproof-installed"

setup() {
  if [ ! -x "$venv/bin/python" ]; then
    echo "[dev.sh] creating virtualenv $venv" >&2
    "$py" -m venv "$venv"
  fi
  # Re-install when pyproject.toml changed since the last install.
  if [ ! -f "$stamp" ] || [ "$here/pyproject.toml" -nt "$stamp" ]; then
    echo "[dev.sh] installing trainproof and its dependencies into $venv" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    # torch first, pinned. From the public index on Linux x86_64 this is the CUDA build (~20 nvidia-* wheels,
    # several GB) even on a machine without a GPU; TRAINPROOF_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
    # takes the CPU-only wheel from PyTorch's own index instead, where this machine can reach it.
    index=()
    if [ -n "${TRAINPROOF_TORCH_INDEX_URL:-}" ]; then
      index=(--index-url "$TRAINPROOF_TORCH_INDEX_URL")
      echo "[dev.sh] torch from $TRAINPROOF_TORCH_INDEX_URL" >&2
    fi
    "$venv/bin/python" -m pip install -q ${index[@]+"${index[@]}"} "torch==${TRAINPROOF_TORCH_VERSION:-2.13.0}" >&2
    "$venv/bin/python" -m pip install -q -e "${here}[test]" >&2
    touch "$stamp"
  fi
}

cmd="${1:-}"
[ -n "$cmd" ] || { echo "usage: bash scripts/dev.sh test [pytest args] | <trainproof command> [args]" >&2; exit 2; }
shift
setup
case "$cmd" in
  # Tests run in parallel (pytest-xdist), one worker per core unless TRAINPROOF_TEST_WORKERS says otherwise
  # (0: in this process); a module's tests stay on one worker, so its module-scoped reference runs happen once.
  test) cd "$here" && exec "$venv/bin/python" -m pytest -q -n "${TRAINPROOF_TEST_WORKERS:-auto}" --dist loadscope "$@" ;;
  *)    exec "$venv/bin/trainproof" "$cmd" "$@" ;;
esac
