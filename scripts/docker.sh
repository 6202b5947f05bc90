#!/usr/bin/env bash
# The trainproof image built and run on a machine with no registry in reach: a private Docker engine, a local
# Debian base, the repository's Dockerfile. Used by tests/test_container.py and .ci/run; works by hand too.
#
#   bash scripts/docker.sh install  # apt-get install docker.io debootstrap docker-compose where missing (root)
#   bash scripts/docker.sh env      # start (or reuse) the engine; print DOCKER=, DOCKER_HOST=, STARTED=0|1 lines
#   bash scripts/docker.sh base     # + the local base image (debootstrap bookworm, docker import), if missing
#   bash scripts/docker.sh lock     # write only the CPU lock (below); print LOCK=its path
#   bash scripts/docker.sh image    # + build the test image from ./Dockerfile; print IMAGE=... and its size
#   bash scripts/docker.sh stop     # stop the engine this script started (images stay in its data root)
#
# The test image is the product Dockerfile with two build arguments, nothing else:
#   BASE_IMAGE=trainproof-base:bookworm    Debian 12 minbase (python3 3.11) instead of nvidia/cuda (Ubuntu 24.04)
#   REQUIREMENTS_LOCK=infra/docker/requirements.cpu.lock.txt
#                                          the image's lock with torch==2.13.0+cpu instead of the CUDA build and
#                                          without its nvidia-*/cuda-*/triton wheels (written here, git-ignored)
#
# Facts of such machines this script handles:
# - Debian's docker.io (20.10, /usr/bin/docker) has BuildKit built in (DOCKER_BUILDKIT=1); a newer client on
#   PATH without the buildx plugin refuses DOCKER_BUILDKIT=1, so the 20.10 client is preferred.
# - No registry is reachable: the base image comes from Debian's packages (debootstrap + docker import), the
#   Dockerfile has no `# syntax=` line (it would make BuildKit pull a frontend image).
# - dockerd runs on its own socket and data root, without a bridge or iptables rules (--bridge=none
#   --iptables=false ...): builds and containers use the host's network (--network host).
# - HTTPS leaving this machine may be re-signed by the machine's own CA: the base keeps a copy of the host's CA
#   bundle outside /etc/ssl (the image's own ca-certificates package rewrites the bundle there) and points
#   PIP_CERT at it.
# - torch 2.13.0+cpu is not on PyPI: the build takes it from TRAINPROOF_TORCH_WHEELS (default /opt/wheels, a
#   folder holding torch-2.13.0+cpu-cp311-*.whl), served on 127.0.0.1:$TRAINPROOF_WHEELS_PORT for the build only.
#   Elsewhere: pip download --no-deps torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu -d DIR
#
# Settings (environment, all optional):
#   TRAINPROOF_DOCKER_ROOT   the engine's data root (default /var/lib/trainproof-docker); images built there stay
#                            for the next run on the same machine (the cache)
#   TRAINPROOF_DOCKER        the docker client (default /usr/bin/docker when present, else docker on PATH)
#   TRAINPROOF_DOCKER_HOST   use this engine instead of starting one (e.g. unix:///var/run/docker.sock)
#   TRAINPROOF_IMAGE         the test image's tag (default trainproof:test-cpu)
#   TRAINPROOF_DOCKERFILE    the Dockerfile to build (default ./Dockerfile; a broken copy shows the test failing)
#   TRAINPROOF_DEBIAN_MIRROR Debian mirror for debootstrap (default: the host's, else http://deb.debian.org/debian)
#   TRAINPROOF_TORCH_WHEELS, TRAINPROOF_WHEELS_PORT (default 38471)
#   TRAINPROOF_BUILD_CACHE   BuildKit cache kept after a build (default 4GB); replaced image versions are pruned
set -euo pipefail

started=0
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root=${TRAINPROOF_DOCKER_ROOT:-/var/lib/trainproof-docker}
sock="$root/docker.sock"
base_tag=trainproof-base:bookworm
image=${TRAINPROOF_IMAGE:-trainproof:test-cpu}
dockerfile=${TRAINPROOF_DOCKERFILE:-$here/Dockerfile}
wheels=${TRAINPROOF_TORCH_WHEELS:-/opt/wheels}
wheels_port=${TRAINPROOF_WHEELS_PORT:-38471}
torch_version=2.13.0
cpu_lock=infra/docker/requirements.cpu.lock.txt

say() { echo "[docker.sh] $*" >&2; }
die() { say "error: $*"; exit 1; }

client() {
  if [ -n "${TRAINPROOF_DOCKER:-}" ]; then echo "$TRAINPROOF_DOCKER"
  elif [ -x /usr/bin/docker ]; then echo /usr/bin/docker
  elif command -v docker >/dev/null; then command -v docker
  else return 1
  fi
}

# Start the private engine unless one answers; export DOCKER_HOST for the calls below.
engine() {
  local docker
  docker=$(client) || die "no docker client: apt-get install docker.io (or set TRAINPROOF_DOCKER)"
  if [ -n "${TRAINPROOF_DOCKER_HOST:-}" ]; then
    export DOCKER_HOST=$TRAINPROOF_DOCKER_HOST
    "$docker" version >/dev/null 2>&1 || die "no engine answers at TRAINPROOF_DOCKER_HOST=$DOCKER_HOST"
    return 0
  fi
  export DOCKER_HOST="unix://$sock"
  if "$docker" version >/dev/null 2>&1; then return 0; fi
  started=1
  command -v dockerd >/dev/null || die "no dockerd: apt-get install docker.io (or set TRAINPROOF_DOCKER_HOST)"
  [ "$(id -u)" = 0 ] || die "starting dockerd needs root (or set TRAINPROOF_DOCKER_HOST to a running engine)"
  mkdir -p "$root"
  say "starting dockerd (data root $root, log $root/dockerd.log)"
  # setsid: the engine outlives this script and is not in the caller's process group (a test's SIGTERM to
  # its group must not stop it); `stop` ends it by the pid recorded here.
  setsid dockerd --host "$DOCKER_HOST" --data-root "$root/data" --exec-root "$root/exec" \
    --pidfile "$root/dockerd.pid" --bridge=none --iptables=false --ip6tables=false --ip-forward=false \
    --ip-masq=false --storage-driver overlay2 --exec-opt native.cgroupdriver=cgroupfs \
    >"$root/dockerd.log" 2>&1 </dev/null &
  for _ in $(seq 120); do
    if "$docker" version >/dev/null 2>&1; then return 0; fi
    kill -0 $! 2>/dev/null || { tail -n 20 "$root/dockerd.log" >&2; die "dockerd exited (log above)"; }
    sleep 0.5
  done
  tail -n 20 "$root/dockerd.log" >&2
  die "dockerd did not answer within 60 s (log above)"
}

install() {
  local missing=()
  [ -x /usr/bin/docker ] && command -v dockerd >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] || missing+=(debootstrap)
  command -v docker-compose >/dev/null || missing+=(docker-compose)
  [ ${#missing[@]} = 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "${missing[*]} missing; installing needs root (apt-get)"
  command -v apt-get >/dev/null || die "${missing[*]} missing and there is no apt-get"
  say "installing ${missing[*]} (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null || die "apt-get update failed"
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
}

mirror() {
  if [ -n "${TRAINPROOF_DEBIAN_MIRROR:-}" ]; then echo "$TRAINPROOF_DEBIAN_MIRROR"; return; fi
  local m
  m=$(grep -h '^URIs:' /etc/apt/sources.list.d/debian.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -n1)
  echo "${m:-http://deb.debian.org/debian}"
}

base() {
  local docker tmp
  docker=$(client)
  if "$docker" image inspect "$base_tag" >/dev/null 2>&1; then return 0; fi
  command -v debootstrap >/dev/null || die "no debootstrap: apt-get install debootstrap"
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/trainproof-base.XXXXXX")
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" RETURN
  say "debootstrap --variant=minbase bookworm from $(mirror) (a few minutes)"
  debootstrap --variant=minbase bookworm "$tmp/rootfs" "$(mirror)" >"$tmp/debootstrap.log" 2>&1 \
    || { tail -n 20 "$tmp/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
  rm -rf "$tmp/rootfs/var/cache/apt/archives/"*.deb "$tmp/rootfs/var/lib/apt/lists/"*
  local changes=(--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
                 --change 'CMD ["/bin/bash"]')
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    mkdir -p "$tmp/rootfs/usr/local/share/trainproof-host-ca"
    cp /etc/ssl/certs/ca-certificates.crt "$tmp/rootfs/usr/local/share/trainproof-host-ca/ca-certificates.crt"
    changes+=(--change 'ENV PIP_CERT=/usr/local/share/trainproof-host-ca/ca-certificates.crt')
  fi
  tar -C "$tmp/rootfs" -c . | "$docker" import "${changes[@]}" - "$base_tag" >/dev/null
  say "base image $base_tag made"
}

write_cpu_lock() {
  local src="$here/infra/docker/requirements.lock.txt" out="$here/$cpu_lock"
  {
    echo "# GENERATED by scripts/docker.sh from requirements.lock.txt for the CPU test image; do not edit."
    echo "# torch $torch_version+cpu (from a local wheel server) instead of the CUDA build, without its CUDA wheels."
    echo "--find-links http://127.0.0.1:$wheels_port/"
    grep -v '^#' "$src" | grep -v -E '^(nvidia-|cuda-|triton==)' | sed -E "s/^torch==$torch_version\$/torch==$torch_version+cpu/"
  } >"$out.tmp"
  grep -q "^torch==$torch_version+cpu\$" "$out.tmp" || die "requirements.lock.txt does not pin torch==$torch_version"
  mv "$out.tmp" "$out"
}

build() {
  local docker wheel served start end
  docker=$(client)
  write_cpu_lock
  wheel=$(find "$wheels" -maxdepth 1 -name "torch-$torch_version+cpu-cp311-*.whl" 2>/dev/null | head -n1)
  [ -n "$wheel" ] || die "no torch-$torch_version+cpu-cp311-*.whl in $wheels (set TRAINPROOF_TORCH_WHEELS; see the script's header)"
  served=$(mktemp -d "${TMPDIR:-/tmp}/trainproof-wheels.XXXXXX")
  ln -s "$wheel" "$served/"
  python3 -m http.server --bind 127.0.0.1 --directory "$served" "$wheels_port" >"$served.log" 2>&1 &
  local server=$!
  # shellcheck disable=SC2064
  trap "kill $server 2>/dev/null || true; rm -rf '$served' '$served.log'" RETURN
  sleep 1
  kill -0 "$server" 2>/dev/null || { cat "$served.log" >&2; die "cannot serve the torch wheel on 127.0.0.1:$wheels_port"; }
  say "building $image from $dockerfile (BASE_IMAGE=$base_tag, REQUIREMENTS_LOCK=$cpu_lock)"
  start=$(date +%s)
  DOCKER_BUILDKIT=1 "$docker" build --network host --progress plain \
    --build-arg BASE_IMAGE="$base_tag" --build-arg REQUIREMENTS_LOCK="$cpu_lock" \
    -t "$image" -f "$dockerfile" "$here" >&2
  end=$(date +%s)
  # The engine is this script's own: replaced image versions go, and the layer cache stays bounded.
  "$docker" image prune -f >/dev/null
  "$docker" builder prune -f --keep-storage "${TRAINPROOF_BUILD_CACHE:-4GB}" >/dev/null
  echo "IMAGE=$image"
  echo "BUILD_SECONDS=$((end - start))"
  echo "IMAGE_BYTES=$("$docker" image inspect -f '{{.Size}}' "$image")"
}

stop() {
  local pid
  pid=$(cat "$root/dockerd.pid" 2>/dev/null) || { say "no engine recorded in $root"; return 0; }
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ] || { say "dockerd $pid is not running"; return 0; }
  kill -TERM "$pid"
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  die "dockerd $pid did not stop within 30 s"
}

case "${1:-}" in
  env) engine; echo "DOCKER=$(client)"; echo "DOCKER_HOST=$DOCKER_HOST"; echo "STARTED=$started" ;;
  base) engine; base; echo "DOCKER=$(client)"; echo "DOCKER_HOST=$DOCKER_HOST"; echo "BASE_IMAGE=$base_tag" ;;
  image) engine; base; build; echo "DOCKER=$(client)"; echo "DOCKER_HOST=$DOCKER_HOST" ;;
  install) install ;;
  lock) write_cpu_lock; echo "LOCK=$cpu_lock" ;;
  stop) stop ;;
  *) echo "usage: bash scripts/docker.sh install | env | base | lock | image | stop" >&2; exit 2 ;;
esac
