#!/usr/bin/env bash
# The test suite on a busy machine: one busy loop per core runs beside it for the whole run (a CI neighbour, a
# second suite), started here and stopped on exit, however the suite ends. The suite's waits are load-scaled
# (tests/support/timing.py), so it must stay green; only slower.
#   bash scripts/loaded-test.sh [pytest args]     # TRAINPROOF_BUSY_LOOPS: how many (default: one per core)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
loops="${TRAINPROOF_BUSY_LOOPS:-$(nproc)}"
pids=()
# shellcheck disable=SC2329  # run by the EXIT trap
stop() { if [ "${#pids[@]}" -gt 0 ]; then kill "${pids[@]}" 2>/dev/null || true; fi; }
trap stop EXIT
for _ in $(seq "$loops"); do
  bash -c 'while :; do :; done' &
  pids+=("$!")
done
echo "[loaded-test] $loops busy loop(s) running beside the suite" >&2
began=$(date +%s)
status=0
bash "$here/scripts/dev.sh" test "$@" || status=$?
echo "[loaded-test] suite exit $status after $(( $(date +%s) - began )) s with $loops busy loop(s)" >&2
exit "$status"
