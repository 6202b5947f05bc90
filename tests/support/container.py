"""The Docker engine and the test image for tests/test_container.py (scripts/docker.sh does the work).

``TRAINPROOF_TEST_CONTAINER``: ``auto`` (default) builds and runs the image where an engine can be had and skips
with the reason elsewhere; ``require`` (what .ci/run sets) fails instead of skipping; ``0`` skips without trying.
What the container tests did (build time, image size, every run's exit code and duration) is appended to the
file named by ``TRAINPROOF_CONTAINER_REPORT``; the session prints it at its end (tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "scripts" / "docker.sh"
MODE_ENV = "TRAINPROOF_TEST_CONTAINER"
REPORT_ENV = "TRAINPROOF_CONTAINER_REPORT"
TORCH_WHEEL = "torch-2.13.0+cpu-cp311-*.whl"


class Unavailable(Exception):
    """No usable engine (or what the build needs is missing) on this machine: the reason, in one line."""


def mode() -> str:
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "1", "require", "0"):
        raise ValueError(f"{MODE_ENV} must be auto (or 1), require or 0, got {value!r}")
    return "auto" if value == "1" else value


def report(line: str) -> None:
    """One line for the session's summary (and stderr, shown with -s)."""
    print(f"[container] {line}", file=sys.stderr)
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as fh:
            fh.write(line + "\n")


def prepare_session() -> str | None:
    """In the controlling process: a report file that the workers inherit through the environment (None when an
    outer session already set one)."""
    if os.environ.get(REPORT_ENV):
        return None
    fd, path = tempfile.mkstemp(prefix="trainproof-container-", suffix=".txt")
    os.close(fd)
    os.environ[REPORT_ENV] = path
    return path


def session_summary(path: str) -> list[str]:
    try:
        with open(path) as fh:
            return [f"container: {ln.rstrip()}" for ln in fh if ln.strip()]
    except FileNotFoundError:
        return []


def _cannot_run() -> str | None:
    """Why this machine cannot build and run the image (None: it can, as far as can be told without trying)."""
    if sys.platform != "linux":
        return f"the container test builds a Linux image with a local engine; this is {sys.platform}"
    if not os.environ.get("TRAINPROOF_DOCKER_HOST"):
        if not (os.environ.get("TRAINPROOF_DOCKER") or os.path.exists("/usr/bin/docker") or shutil.which("docker")):
            return "no docker client (Debian: apt-get install docker.io)"
        if not shutil.which("dockerd"):
            return "no dockerd to start (Debian: apt-get install docker.io), and no TRAINPROOF_DOCKER_HOST"
        if os.geteuid() != 0:
            return "starting a private dockerd needs root (or set TRAINPROOF_DOCKER_HOST to a running engine)"
    if not (shutil.which("debootstrap") or os.path.exists("/usr/sbin/debootstrap")):
        return "no debootstrap for the local base image (Debian: apt-get install debootstrap)"
    wheels = Path(os.environ.get("TRAINPROOF_TORCH_WHEELS", "/opt/wheels"))
    if not list(wheels.glob(TORCH_WHEEL)):
        return f"no {TORCH_WHEEL} in {wheels} for the CPU image (TRAINPROOF_TORCH_WHEELS; see scripts/docker.sh)"
    return None


def _script(command: str, timeout: float) -> dict[str, str]:
    out = subprocess.run(["bash", str(SCRIPT), command], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/docker.sh {command} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return dict(ln.split("=", 1) for ln in out.stdout.splitlines() if "=" in ln)


@dataclass
class Engine:
    """A Docker engine that answers, and the client to talk to it with."""

    docker: str
    host: str
    started: bool

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "1"}

    def cli(self, *args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
        out = subprocess.run([self.docker, *args], env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"docker {' '.join(args[:3])} ... exited {out.returncode}: {out.stderr.strip()}")
        return out

    def stop(self) -> None:
        if self.started:
            subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=60, check=False)


def engine() -> Engine:
    """Start (or reuse) the engine of scripts/docker.sh; Unavailable with the reason where none can be had."""
    why = _cannot_run()
    if why:
        raise Unavailable(why)
    try:
        found = _script("env", timeout=120)
    except RuntimeError as exc:
        raise Unavailable(str(exc).splitlines()[-1]) from exc
    return Engine(found["DOCKER"], found["DOCKER_HOST"], found.get("STARTED") == "1")


@dataclass
class Image:
    tag: str
    build_seconds: float
    size_bytes: int


def build_image() -> Image:
    """Build the test image from ./Dockerfile (base and lock as scripts/docker.sh says); cached layers make a
    rebuild after a code change about a minute and an unchanged one seconds."""
    began = time.monotonic()
    found = _script("image", timeout=3600)
    image = Image(found["IMAGE"], time.monotonic() - began, int(found["IMAGE_BYTES"]))
    report(f"image {image.tag} built in {image.build_seconds:.0f} s (docker build: {found['BUILD_SECONDS']} s, "
           f"base included), {image.size_bytes / 1e9:.2f} GB")
    return image
