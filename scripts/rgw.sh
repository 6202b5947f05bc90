#!/usr/bin/env bash
# A throw-away S3 server on loopback for tests and benchmarks: Ceph's RADOS Gateway on a one-node cluster.
#
#   bash scripts/rgw.sh start    # install the Debian packages if missing (root), start mon + OSD + radosgw,
#                                # create an S3 user, wait for a signed request; print KEY=value lines
#   bash scripts/rgw.sh stop     # stop the daemons this script started, delete the state folder
#   bash scripts/rgw.sh status   # exit 0 when the recorded daemons are alive
#
# One monitor, one BlueStore OSD on a sparse file (memory stays bounded), pool size 1, no cephx, everything on
# 127.0.0.1. Debian 12 (bookworm) packages `radosgw ceph-mon ceph-osd`; installing needs root and apt (about
# 60 MB, a minute). Nothing here is for production: authentication between the daemons is off.
#
# Settings (environment, all optional):
#   RGW_DIR       state folder (default /tmp/trainproof-rgw); wiped at every start
#   RGW_PORT      S3 port on 127.0.0.1 (default: a free one)
#   RGW_MON_PORT  monitor port on 127.0.0.1 (default: a free one)
#   RGW_BYTES     size of the OSD's sparse block file (default 32 GiB; only what is written takes disk)
#   RGW_ACCESS_KEY, RGW_SECRET_KEY   the S3 user's keys (default trainproof-test / trainproof-test-secret)
#   RGW_TIMEOUT   seconds to wait for each daemon (default 180)
#   RGW_NO_INSTALL=1   never call apt-get (fail instead when the packages are missing)
#   RGW_OWNER_PID      stop the daemons and delete the state folder once this process has exited (a test session
#                      killed before its clean-up leaves nothing running)
#
# Facts this script is built on (Ceph 16.2, Debian 12): with auth off radosgw waits minutes for its monitor
# session unless the messenger modes are crc; a short paxos propose interval makes radosgw's pool creation take
# seconds instead of ~12 s; the BlueStore block file must stay at its default place inside the OSD folder.
set -euo pipefail

dir=${RGW_DIR:-/tmp/trainproof-rgw}
timeout_s=${RGW_TIMEOUT:-180}
access=${RGW_ACCESS_KEY:-trainproof-test}
secret=${RGW_SECRET_KEY:-trainproof-test-secret}
bytes=${RGW_BYTES:-34359738368}
started=$(date +%s)

say() { echo "[rgw] $*" >&2; }
fail() {
  say "error: $*"
  if [ -d "$dir/log" ]; then tail -n 20 "$dir"/log/*.log >&2 2>/dev/null || true; fi
  stop_daemons
  exit 1
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ours() { case "$(cat "/proc/$1/comm" 2>/dev/null)" in ceph-mon | ceph-osd | radosgw) return 0 ;; *) return 1 ;; esac; }

stop_daemons() {
  [ -f "$dir/pids" ] || return 0
  local name pid
  # radosgw first, the monitor last; only pids that are still our daemons (a pid may have been reused)
  while read -r name pid; do ours "$pid" && kill -TERM "$pid" 2>/dev/null || true; done < <(tac "$dir/pids")
  for _ in $(seq 40); do
    local alive=0
    while read -r name pid; do ours "$pid" && alive=1; done <"$dir/pids"
    [ "$alive" = 0 ] && break
    sleep 0.25
  done
  while read -r name pid; do ours "$pid" && kill -KILL "$pid" 2>/dev/null || true; done <"$dir/pids"
  rm -f "$dir/pids"
}

install_packages() {
  if command -v radosgw >/dev/null && command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null; then
    return 0
  fi
  [ "${RGW_NO_INSTALL:-0}" != 1 ] || fail "radosgw, ceph-mon or ceph-osd is missing (RGW_NO_INSTALL=1)"
  [ "$(id -u)" = 0 ] || fail "radosgw, ceph-mon or ceph-osd is missing; installing them needs root (apt-get)"
  command -v apt-get >/dev/null || fail "radosgw, ceph-mon or ceph-osd is missing and there is no apt-get"
  say "installing radosgw ceph-mon ceph-osd (Debian packages, about 60 MB)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null || fail "apt-get update failed"
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends radosgw ceph-mon ceph-osd >/dev/null \
    || fail "apt-get install radosgw ceph-mon ceph-osd failed"
}

write_conf() {
  cat >"$dir/ceph.conf" <<EOF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$mon_port]
public network = 127.0.0.0/8
ms bind msgr1 = false
ms bind msgr2 = true
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
ms client mode = crc
keyring = $dir/keyring
run dir = $dir/run
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
log to stderr = false
err to stderr = false
crash dir = $dir/crash
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon max pg per osd = 1000
mon warn on pool no redundancy = false
mon data avail warn = 2
mon data avail crit = 1
paxos propose interval = 0.05
paxos min wait = 0.01
debug ms = 0
debug mon = 0
debug osd = 0
debug rgw = 0

[mon.a]
mon data = $dir/mon

[osd]
osd data = $dir/osd
osd objectstore = bluestore
bluestore block create = true
bluestore block size = $bytes
bluestore fsck on mount = false
osd memory target = 1073741824
osd op num shards = 2
osd op num threads per shard = 2
osd max object size = 134217728

[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$rgw_port
rgw data = $dir/rgw
rgw thread pool size = 64
rgw enable usage log = false
rgw dynamic resharding = false
rgw gc obj min wait = 30
rgw gc processor period = 30
EOF
}

daemon() {  # daemon NAME COMMAND...: run in the foreground mode (-f), detached from this shell
  local name=$1
  shift
  setsid "$@" </dev/null >>"$dir/log/$name.out" 2>&1 &
  echo "$name $!" >>"$dir/pids"
}

until_ok() {  # until_ok WHAT COMMAND...: retry until it succeeds, failing when a daemon died or time ran out
  local what=$1 deadline=$(($(date +%s) + timeout_s))
  shift
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "timed out after ${timeout_s}s waiting for $what"
    local name pid
    while read -r name pid; do kill -0 "$pid" 2>/dev/null || fail "$name exited while waiting for $what"; done <"$dir/pids"
    sleep 0.25
  done
  say "$what ($(($(date +%s) - started)) s)"
}

ceph_cli() { timeout 60 ceph --conf "$dir/ceph.conf" --connect-timeout 30 "$@"; }

signed_request() {
  # RGW wants x-amz-content-sha256 (here: of the empty body), which curl's --aws-sigv4 does not send itself.
  curl -fsS -o /dev/null --aws-sigv4 "aws:amz:us-east-1:s3" --user "$access:$secret" \
    -H "x-amz-content-sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855" \
    "http://127.0.0.1:$rgw_port/"
}

start() {
  install_packages
  stop_daemons
  rgw_port=${RGW_PORT:-$(free_port)}
  mon_port=${RGW_MON_PORT:-$(free_port)}
  for port in "$rgw_port" "$mon_port"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then fail "127.0.0.1:$port is already in use"; fi
  done
  rm -rf "$dir"
  mkdir -p "$dir"/{mon,osd,rgw,run,log,crash}
  : >"$dir/pids"
  fsid=$(cat /proc/sys/kernel/random/uuid)
  write_conf
  export CEPH_CONF="$dir/ceph.conf"

  # The monitor (its --mkfs wants a keyring even with authentication off).
  ceph-authtool --create-keyring "$dir/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  ceph-authtool "$dir/keyring" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' >/dev/null
  monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_port]" "$dir/monmap" >/dev/null
  ceph-mon --mkfs -i a --monmap "$dir/monmap" --keyring "$dir/keyring" >"$dir/log/mon-mkfs.log" 2>&1 \
    || fail "ceph-mon --mkfs failed"
  daemon mon ceph-mon -f -i a
  until_ok "monitor up" ceph_cli mon stat

  # One OSD on a sparse BlueStore file.
  local uuid id
  uuid=$(cat /proc/sys/kernel/random/uuid)
  id=$(ceph_cli osd new "$uuid") || fail "ceph osd new failed"
  [ "$id" = 0 ] || fail "expected OSD id 0, got '$id'"
  ceph-osd -i 0 --mkfs --osd-uuid "$uuid" >"$dir/log/osd-mkfs.log" 2>&1 || fail "ceph-osd --mkfs failed"
  daemon osd ceph-osd -f -i 0
  osd_up() { ceph_cli osd dump | grep -q '^osd\.0 up'; }
  until_ok "OSD up" osd_up
  ceph_cli osd set noscrub >/dev/null 2>&1 || true
  ceph_cli osd set nodeep-scrub >/dev/null 2>&1 || true

  # The gateway (it creates its pools on the first start), then the S3 user.
  daemon rgw radosgw -f -n client.rgw.a
  until_ok "radosgw answers on 127.0.0.1:$rgw_port" curl -fsS -o /dev/null "http://127.0.0.1:$rgw_port/"
  timeout 120 radosgw-admin user create --uid=trainproof --display-name=trainproof --access-key="$access" \
    --secret="$secret" >"$dir/user.json" 2>>"$dir/log/radosgw-admin.log" || fail "radosgw-admin user create failed"
  until_ok "a signed S3 request is answered" signed_request

  cat >"$dir/env" <<EOF
RGW_ENDPOINT=http://127.0.0.1:$rgw_port
RGW_ACCESS_KEY=$access
RGW_SECRET_KEY=$secret
RGW_REGION=us-east-1
RGW_DIR=$dir
EOF
  [ -z "${RGW_OWNER_PID:-}" ] || watch_owner "$RGW_OWNER_PID"
  say "ready in $(($(date +%s) - started)) s"
  cat "$dir/env"
}

watch_owner() {  # a detached watcher: once process $1 is gone (or the daemons were stopped), stop and clean up
  local owner=$1 me
  me=$(readlink -f "${BASH_SOURCE[0]}")
  kill -0 "$owner" 2>/dev/null || fail "RGW_OWNER_PID=$owner is not a running process"
  # shellcheck disable=SC2016  # the watcher's own $1/$2/$RGW_DIR, expanded when it runs
  RGW_DIR=$dir setsid bash -c 'while kill -0 "$1" 2>/dev/null && [ -f "$RGW_DIR/pids" ]; do sleep 2; done
    [ ! -f "$RGW_DIR/pids" ] || bash "$2" stop' rgw-watch "$owner" "$me" </dev/null >/dev/null 2>&1 &
}

case "${1:-}" in
  start) start ;;
  stop) stop_daemons; rm -rf "$dir"; say "stopped" ;;
  status)
    [ -f "$dir/pids" ] || exit 1
    while read -r _ pid; do ours "$pid" || exit 1; done <"$dir/pids"
    cat "$dir/env"
    ;;
  *) echo "usage: bash scripts/rgw.sh start|stop|status" >&2; exit 2 ;;
esac
