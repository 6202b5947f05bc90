#!/usr/bin/env bash
# supervise.sh: keep `trainproof train` going on a rented machine without systemd (and, with --once,
# the ExecStart of infra/spot/trainproof.service).
#
#   infra/spot/supervise.sh [--once] [train options...]        (options also come from TRAINPROOF_* variables)
#
# What each exit code of `trainproof train` (README.md, "Exit codes") leads to:
#   0    target reached                          -> stop, exit 0
#   2    usage, configuration or contract error  -> stop at once, exit 2 (retrying cannot help)
#   75   stopped early after committing          -> run again after SUPERVISE_BACKOFF_SECONDS (it resumes)
#   else a crash (1, 137 after an OOM kill, ...) -> run again after a doubling back-off; give up, with that code,
#                                                   after SUPERVISE_MAX_FAST_FAILURES runs in a row that each
#                                                   lasted less than SUPERVISE_FAST_SECONDS
# SIGTERM/SIGINT are forwarded to trainproof, which finishes its step, commits and exits 75; the supervisor
# then exits with that code and does not restart (the machine is going away, or someone asked to stop).
# A supervisor started with SIGINT ignored (the background job of a script, `nohup ... &`) keeps ignoring SIGINT, as
# POSIX requires of a shell; stop it with SIGTERM (what Kubernetes, systemd and spot notices send).
# The supervisor checks on trainproof every SUPERVISE_POLL_SECONDS (default 1; see await_child below).
#
# --once: no loop; run trainproof once (exec, so signals reach it directly) and exit with its code. For
# systemd, which restarts by itself (Restart=on-failure, RestartForceExitStatus=75).
#
# Deadline: a relative TRAINPROOF_DEADLINE (6d23h31m from infra/profiles/*.env) would be measured from each
# start of `train`, so every restart would move it later. The first start pins it to an absolute UTC time in
# $SUPERVISE_STATE_DIR/deadline and every later start, reboot included, reads it back. Within
# SUPERVISE_DEADLINE_MARGIN_SECONDS of that time training is not started again: exit 0, and the rest of the
# rental is for `trainproof verify` and `trainproof export`. Delete that file to start a new rental.
set -uo pipefail

bin="${TRAINPROOF_BIN:-trainproof}"
base_backoff="${SUPERVISE_BACKOFF_SECONDS:-5}"
max_backoff="${SUPERVISE_MAX_BACKOFF_SECONDS:-300}"
fast_seconds="${SUPERVISE_FAST_SECONDS:-60}"
max_fast="${SUPERVISE_MAX_FAST_FAILURES:-5}"
deadline_margin="${SUPERVISE_DEADLINE_MARGIN_SECONDS:-600}"
poll="${SUPERVISE_POLL_SECONDS:-1}"
state_dir="${SUPERVISE_STATE_DIR:-${STATE_DIRECTORY:-${XDG_STATE_HOME:-$HOME/.local/state}/trainproof}}"

log() { printf '[supervise %s] %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >&2; }

for knob in base_backoff max_backoff fast_seconds max_fast deadline_margin; do
  [[ "${!knob}" =~ ^[0-9]+$ ]] || { log "error: $knob must be a whole number of seconds (got '${!knob}')"; exit 2; }
done
[[ "$poll" =~ ^[0-9]*\.?[0-9]+$ ]] || { log "error: SUPERVISE_POLL_SECONDS must be a number of seconds (got '$poll')"; exit 2; }

once=0
if [ "${1:-}" = "--once" ]; then once=1; shift; fi

command -v "$bin" >/dev/null 2>&1 || { log "error: '$bin' is not on PATH"; exit 2; }

# 90s, 10m, 6h, 7d, 6d23h31m -> whole seconds on stdout; fails for anything else (an ISO time).
duration_seconds() {
  local rest="$1" total=0 n
  [[ "$rest" =~ ^([0-9]+[dhms])+$ ]] || return 1
  while [[ "$rest" =~ ^([0-9]+)([dhms])(.*)$ ]]; do
    n=$((10#${BASH_REMATCH[1]}))
    case "${BASH_REMATCH[2]}" in d) n=$((n * 86400)) ;; h) n=$((n * 3600)) ;; m) n=$((n * 60)) ;; esac
    total=$((total + n))
    rest="${BASH_REMATCH[3]}"
  done
  echo "$total"
}

pin_deadline() {
  local spec="${TRAINPROOF_DEADLINE:-}" file="$state_dir/deadline" secs
  [ -n "$spec" ] || return 0
  if [ -s "$file" ]; then
    TRAINPROOF_DEADLINE="$(head -n 1 "$file")"
    log "deadline $TRAINPROOF_DEADLINE (pinned in $file; delete it to start a new rental)"
  else
    if secs="$(duration_seconds "$spec")"; then
      # "+00:00", not "Z": Python's datetime.fromisoformat() reads "Z" only from 3.11 on.
      TRAINPROOF_DEADLINE="$(date -u -d "@$(($(date +%s) + secs))" +%Y-%m-%dT%H:%M:%S+00:00)"
    fi
    if ! { mkdir -p "$state_dir" && printf '%s\n' "$TRAINPROOF_DEADLINE" >"$file.tmp" && mv -f "$file.tmp" "$file"; }; then
      log "error: cannot write $file"
      exit 2
    fi
    log "deadline $spec -> $TRAINPROOF_DEADLINE (pinned in $file)"
  fi
  export TRAINPROOF_DEADLINE
}

# True when the pinned deadline is past, or too close for a restart and a save to be worth it.
deadline_reached() {
  local at
  [ -n "${TRAINPROOF_DEADLINE:-}" ] || return 1
  at="$(date -u -d "$TRAINPROOF_DEADLINE" +%s 2>/dev/null)" || return 1  # unparsable: train will say why
  [ $(($(date +%s) + deadline_margin)) -ge "$at" ]
}

pin_deadline
if deadline_reached; then
  log "the deadline $TRAINPROOF_DEADLINE is reached: not training again; finish with trainproof verify / export"
  exit 0
fi
if [ "$once" = 1 ]; then
  exec "$bin" train "$@"
fi

child=""
signals=0
stop_signal=""
# Always passed on as SIGTERM: bash starts background children with SIGINT ignored, and trainproof treats
# both the same way (finish the step, commit, exit 75).
forward() {
  signals=$((signals + 1))
  stop_signal="$1"
  if [ -n "$child" ]; then kill -s TERM "$child" 2>/dev/null || true; fi
}
trap 'forward TERM' TERM
trap 'forward INT' INT

# Waits for $child to end and sets rc to its exit status, through any number of forwarded signals. It polls
# rather than blocking in `wait "$child"`: a signal that arrives just as bash enters a blocking wait stays
# pending until that wait returns (about one stop in 300 in a loop of SIGINTs), so the trap would never
# forward it and trainproof would train on until the machine is taken. A poll's sleep is interrupted by the
# signal at once, or else ends within SUPERVISE_POLL_SECONDS.
await_child() {
  local seen again
  while kill -0 "$child" 2>/dev/null; do
    sleep "$poll" &
    wait "$!" 2>/dev/null
  done
  while :; do
    seen=$signals
    wait "$child"
    rc=$?
    [ "$signals" = "$seen" ] && break  # wait returned because the child ended, not because of a signal
    if ! kill -0 "$child" 2>/dev/null; then
      # It ended around the signal: its status is still recorded unless this wait already reported it.
      wait "$child" 2>/dev/null
      again=$?
      [ "$again" = 127 ] || rc=$again
      break
    fi
  done
  child=""
}

# Runs trainproof in the background and waits for it; sets rc.
run_child() {
  "$bin" train "$@" &
  child=$!
  # A signal that came before $child was known could not be forwarded by the trap: pass it on now.
  if [ -n "$stop_signal" ]; then kill -s TERM "$child" 2>/dev/null || true; fi
  await_child
}

fast=0
backoff="$base_backoff"
while :; do
  if [ -n "$stop_signal" ]; then
    log "stopped by SIG$stop_signal"
    exit "${rc:-75}"
  fi
  started=$SECONDS
  log "starting: $bin train $*"
  run_child "$@"
  if [ -n "$stop_signal" ]; then
    log "stopped by SIG$stop_signal; trainproof exited $rc"
    exit "$rc"
  fi
  case "$rc" in
    0) log "target reached"; exit 0 ;;
    2) log "trainproof exited 2 (usage, configuration or contract error): not restarting"; exit 2 ;;
  esac
  if [ $((SECONDS - started)) -lt "$fast_seconds" ]; then
    fast=$((fast + 1))
  else
    fast=0
    backoff="$base_backoff"
  fi
  if [ "$fast" -ge "$max_fast" ]; then
    log "giving up: $fast runs in a row ended within ${fast_seconds}s (last exit $rc)"
    exit "$rc"
  fi
  if [ "$rc" = 75 ]; then
    pause="$base_backoff"
  else
    pause="$backoff"
    backoff=$((backoff * 2 > max_backoff ? max_backoff : backoff * 2))
  fi
  if deadline_reached; then
    log "the deadline $TRAINPROOF_DEADLINE is reached: not training again; finish with trainproof verify / export"
    exit 0
  fi
  log "trainproof exited $rc; restarting in ${pause}s"
  # The sleep is a child too, so that a stop signal (forwarded to it by the trap) cuts the back-off short.
  sleep "$pause" &
  child=$!
  pause_rc=$rc
  if [ -z "$stop_signal" ]; then await_child 2>/dev/null; else kill "$child" 2>/dev/null; child=""; fi
  rc=$pause_rc
  if [ -n "$stop_signal" ]; then
    log "stopped by SIG$stop_signal while waiting to restart"
    exit "$rc"
  fi
done
