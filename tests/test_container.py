"""The image, built from the repository's Dockerfile and run the way a user runs it: `docker run` on a mounted
folder, `docker kill -s TERM` as the preemption, a read-only root, S3 over loopback, compose.

The image is the product Dockerfile built with two arguments only (scripts/docker.sh): a Debian 12 base made on
this machine instead of nvidia/cuda, and the lock with torch 2.13.0+cpu instead of the CUDA build. It is built
once per session (the engine keeps its layers, so a later session rebuilds only what changed). Skipped, with the
reason, where no engine can be had; ``TRAINPROOF_TEST_CONTAINER=require`` (.ci/run) fails there instead.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from trainproof.storage.signing import key_id
from tests.support.timing import budget
from tests.support import container
from tests.support.s3server import dummy_aws_env
from tests.test_train_helpers import differences, load_state, trajectory

UID = 10001  # the Dockerfile's USER
TARGET = 600  # steps of the runs compared bit for bit; the signal comes at step STOP_AT
STOP_AT = 10
EVERY = 50
# The containers' root filesystem is read-only where it says so: temporary files and caches go to a tmpfs at /tmp
# (the variables of infra/compose.yaml and the Kubernetes manifests).
TMP_ENV = {"TMPDIR": "/tmp", "XDG_CACHE_HOME": "/tmp/cache", "MPLCONFIGDIR": "/tmp/cache/matplotlib"}
LOCKED_DOWN = ["--read-only", "--tmpfs", "/tmp:rw,size=1g", "--cap-drop", "ALL",
               "--security-opt", "no-new-privileges"]


# --- Without an engine: the script and the test image's lock ------------------------------------------------------


def test_the_script_passes_shellcheck():
    from tests.test_infra import tool

    out = subprocess.run([tool("shellcheck"), "--severity=style", str(container.SCRIPT), str(container.ROOT / ".ci/run")],
                         capture_output=True, text=True, timeout=budget(60))
    assert out.returncode == 0, out.stdout + out.stderr


def _pins(text: str) -> dict[str, str]:
    return dict(ln.split("==") for ln in text.splitlines() if ln and not ln.startswith(("#", "-")))


def test_the_cpu_lock_differs_from_the_image_lock_only_in_torch():
    """The test image's only difference besides its base: torch's CPU build, without the CUDA wheels."""
    out = subprocess.run(["bash", str(container.SCRIPT), "lock"], capture_output=True, text=True, timeout=budget(60))
    assert out.returncode == 0, out.stderr
    cpu = _pins((container.ROOT / out.stdout.strip().split("=", 1)[1]).read_text())
    cuda = _pins((container.ROOT / "infra/docker/requirements.lock.txt").read_text())
    cuda_only = {k for k in cuda if k.startswith(("nvidia-", "cuda-")) or k == "triton"}
    assert cuda_only and cpu["torch"] == cuda["torch"] + "+cpu"
    assert {k: v for k, v in cpu.items() if k != "torch"} == {k: v for k, v in cuda.items()
                                                              if k != "torch" and k not in cuda_only}


# --- The image ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    if container.mode() == "0":
        pytest.skip(f"{container.MODE_ENV}=0")
    try:
        found = container.engine()
    except container.Unavailable as exc:
        if container.mode() == "require":
            pytest.fail(f"{container.MODE_ENV}=require but {exc}", pytrace=False)
        pytest.skip(f"no container engine: {exc}")
    yield found
    found.stop()


@pytest.fixture(scope="module")
def image(engine):
    return container.build_image()


class Runner:
    """`docker run` of the test image, every run named, timed and reported with its exit code."""

    def __init__(self, engine: container.Engine, image: container.Image, runs: Path):
        self.engine, self.image, self.runs = engine, image, runs

    def args(self, *trainproof: str, opts: tuple[str, ...] = (), env: dict[str, str] | None = None) -> list[str]:
        envs = [a for k, v in {"TRAINPROOF_LOG_FORMAT": "json", **(env or {})}.items() for a in ("-e", f"{k}={v}")]
        return [*opts, *envs, "-v", f"{self.runs}:/runs", self.image.tag, *trainproof]

    def run(self, *trainproof: str, opts: tuple[str, ...] = (), env: dict[str, str] | None = None,
            timeout: float = 600) -> tuple[int, list[dict], str]:
        name = f"tp-test-{uuid.uuid4().hex[:10]}"
        began = time.monotonic()
        try:
            out = self.engine.cli("run", "--name", name, *self.args(*trainproof, opts=opts, env=env), timeout=timeout)
        finally:
            self.engine.cli("rm", "-f", name)
        container.report(f"docker run {' '.join(trainproof[:3])} ... -> exit {out.returncode} "
                         f"({time.monotonic() - began:.0f} s)")
        return out.returncode, events(out.stdout), out.stderr


def events(stdout: str) -> list[dict]:
    """The JSON log lines of a run (a multi-line JSON document, as `ls --json` prints, is not one)."""
    found = []
    for ln in stdout.splitlines():
        if ln.startswith("{") and ln.rstrip().endswith("}"):
            found.append(json.loads(ln))
    return found


def of(found: list[dict], name: str) -> list[dict]:
    return [e for e in found if e.get("event") == name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The mounted folder, owned by the image's user (as `chown 10001` by a user on the host)."""
    path = tmp_path_factory.mktemp("runs")
    os.chown(path, UID, UID)
    return path


@pytest.fixture(scope="module")
def docker_run(engine, image, runs):
    return Runner(engine, image, runs)


@pytest.fixture(scope="module")
def reference(docker_run):
    """An uninterrupted run of TARGET steps in a container."""
    code, found, err = docker_run.run("train", "--store", "/runs/reference", "--task", "tinylm",
                                      "--max-steps", str(TARGET), "--checkpoint-every", str(EVERY), "--keep", "0")
    assert code == 0, err[-3000:]
    assert of(found, "done")[-1]["step"] == TARGET
    return docker_run.runs / "reference"


def wait_for_step(engine: container.Engine, name: str, step: int) -> None:
    """Follow a container's log until it reports optimizer step ``step`` (its signal handlers are installed before
    its first step); fails when it ends first."""
    logs = subprocess.Popen([engine.docker, "logs", "-f", name], env=engine.env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        seen: list[dict] = []
        for line in logs.stdout:
            seen += events(_service_log(line))
            if [e for e in seen if e.get("event") == "step" and e["step"] >= step]:
                return
        pytest.fail(f"{name} ended before step {step}: {seen[-3:]}")
    finally:
        logs.kill()  # not read any further: a run that goes on must not block on a full pipe
        logs.wait(timeout=budget(30))


def _proc(pid: int) -> tuple[list[str], int]:
    """A host process's command line and real uid."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    uid = next(int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
               if ln.startswith("Uid:"))
    return [a.decode() for a in cmdline], uid


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(p) for p in (task / "children").read_text().split()]
    return kids


def test_sigterm_commits_exits_75_and_a_rerun_resumes_bit_for_bit(engine, image, docker_run, reference):
    """The preemption as Docker delivers it: `docker kill -s TERM` signals PID 1 only. tini (PID 1, uid 10001)
    must pass it to trainproof, which commits and exits 75, and tini must exit with that code. The rerun on the
    same mounted folder resumes and ends bit for bit where the uninterrupted run ended."""
    name = f"tp-test-{uuid.uuid4().hex[:10]}"
    args = docker_run.args("train", "--store", "/runs/cut", "--task", "tinylm", "--max-steps", str(TARGET),
                           "--checkpoint-every", str(EVERY), "--keep", "0")
    began = time.monotonic()
    engine.cli("run", "-d", "--name", name, *args, check=True)
    try:
        wait_for_step(engine, name, STOP_AT)

        pid = int(engine.cli("inspect", "-f", "{{.State.Pid}}", name, check=True).stdout)
        argv, uid = _proc(pid)  # checked after the exit code: a regression shows its own symptom first
        kids = [_proc(k) for k in _children(pid)]

        engine.cli("kill", "-s", "TERM", name, check=True)
        sent = time.monotonic()
        code = int(engine.cli("wait", name, timeout=budget(180), check=True).stdout)
        waited = time.monotonic() - sent
        out = engine.cli("logs", name, check=True).stdout
    finally:
        engine.cli("rm", "-f", name)
    container.report(f"docker run train (cut) + docker kill -s TERM -> exit {code} "
                     f"({time.monotonic() - began:.0f} s, {waited:.1f} s after the signal)")
    found = events(out)
    stopped = of(found, "stopped") or of(found, "done")
    assert code == 75, f"exit {code} after SIGTERM (PID 1: {argv[:3]}): {found[-3:]}"
    assert stopped[-1]["exit_code"] == 75 and stopped[-1]["signals"] == ["SIGTERM"], stopped[-1]
    assert os.path.basename(argv[0]) == "tini" and argv[1:3] == ["--", "trainproof"], f"PID 1 is {argv}"
    assert uid == UID, f"PID 1 runs as uid {uid}"
    assert [a for a, _ in kids if any("trainproof" in x for x in a)], f"no trainproof under tini: {kids}"
    assert {u for _, u in kids} == {UID}, kids
    committed = stopped[-1]["committed_step"]
    assert STOP_AT <= committed < TARGET and of(found, "checkpoint")[-1]["step"] == committed
    # Written by the image's user, not root.
    assert {p.stat().st_uid for p in (docker_run.runs / "cut").rglob("*")} == {UID}

    code, found, err = docker_run.run("train", "--store", "/runs/cut", "--task", "tinylm", "--max-steps",
                                      str(TARGET), "--checkpoint-every", str(EVERY), "--keep", "0")
    assert code == 0, err[-3000:]
    assert of(found, "resume")[0]["step"] == committed and of(found, "done")[-1]["step"] == TARGET
    assert differences(trajectory(load_state(docker_run.runs / "cut")), trajectory(load_state(reference))) == []


def test_a_configuration_error_exits_2(docker_run):
    code, _, err = docker_run.run("train", "--store", "/runs/bad", "--task", "no-such-task", "--max-steps", "5")
    assert code == 2, err[-2000:]
    assert "no-such-task" in err


def test_read_only_root_without_capabilities_lists_and_audits(docker_run, reference):
    """`ls` and `verify --audit` (a replay of the last interval, compared bit for bit) with the root filesystem
    read-only, every capability dropped and no privilege escalation: only /tmp and the store are written."""
    code, _, err = docker_run.run("ls", "--store", "/runs/reference", "--json", opts=tuple(LOCKED_DOWN),
                                  env=TMP_ENV)
    assert code == 0, err[-2000:]
    code, _, err = docker_run.run("verify", "--audit", "--store", "/runs/reference", "--task", "tinylm",
                                  opts=tuple(LOCKED_DOWN), env=TMP_ENV)
    assert code == 0, err[-3000:]
    verdicts = list((reference / "verification").rglob("verification.json"))
    verdict = json.loads(verdicts[0].read_text()) if len(verdicts) == 1 else None
    assert verdict and verdict["all_checks_passed"] is True and verdict["audited_generations"], verdicts


def test_s3_on_loopback_train_audit_export(docker_run, s3_env, s3_server):
    """The suite's S3 server on 127.0.0.1, reached with --network host: train, audit and export there."""
    store = f"s3://{s3_env}/container/run"
    aws = {**dummy_aws_env(), "AWS_ENDPOINT_URL": s3_server.endpoint, **TMP_ENV}
    opts = ("--network", "host", *LOCKED_DOWN)
    code, found, err = docker_run.run("train", "--store", store, "--task", "tinylm", "--max-steps", "40",
                                      "--checkpoint-every", "20", opts=opts, env=aws)
    assert code == 0 and of(found, "done")[-1]["committed_step"] == 40, err[-3000:]
    code, _, err = docker_run.run("verify", "--audit", "--store", store, "--task", "tinylm", opts=opts, env=aws)
    assert code == 0, err[-3000:]
    code, _, err = docker_run.run("export", "--store", store, "--task", "tinylm", opts=opts, env=aws)
    assert code == 0, err[-3000:]
    code, _, err = docker_run.run("ls", "--store", store, "--json", opts=opts, env=aws)
    assert code == 0, err[-2000:]


# --- Compose: the documented sequence --------------------------------------------------------------------------------

COMPOSE = container.ROOT / "infra" / "compose.yaml"
STANDIN = "trainproof-minio-standin:test"


def compose_for_this_engine(path: Path) -> dict:
    """infra/compose.yaml as Debian's docker-compose 1.29 on an engine without a bridge runs it: every other line as
    users have it. Compose v1 refuses the top-level `name:` (the project name comes from -p instead); there is no
    bridge network, so every service uses the host's (loopback) network, `minio` names 127.0.0.1 and MinIO's
    published ports go (they mean nothing on the host's network); the build context is made absolute."""
    doc = yaml.safe_load(COMPOSE.read_text())
    doc.pop("name")
    for svc in doc["services"].values():
        svc["network_mode"] = "host"
        svc["extra_hosts"] = ["minio:127.0.0.1"]
        if "build" in svc:
            svc["build"]["context"] = str(container.ROOT)
    doc["services"]["minio"].pop("ports")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return doc


def test_the_compose_copy_differs_only_where_compose_v1_and_host_networking_require(tmp_path):
    ours = compose_for_this_engine(tmp_path / "compose.yaml")
    theirs = yaml.safe_load(COMPOSE.read_text())
    assert set(theirs) - set(ours) == {"name"}
    for name, svc in theirs["services"].items():
        mine = dict(ours["services"][name])
        assert mine.pop("network_mode") == "host" and mine.pop("extra_hosts") == ["minio:127.0.0.1"]
        if "build" in svc:
            mine["build"] = {**mine["build"], "context": svc["build"]["context"]}
        expected = {k: v for k, v in svc.items() if not (name == "minio" and k == "ports")}
        assert mine == expected, name


@pytest.fixture(scope="module")
def standin(engine, image, s3_server):
    """The MinIO stand-in image, relaying 127.0.0.1:9000 to the suite's S3 server (built in seconds)."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 9000)) == 0:
            pytest.fail("127.0.0.1:9000 is taken: the compose file's MinIO port must be free for the compose test",
                        pytrace=False)
    target = s3_server.endpoint.split("://", 1)[1]
    out = engine.cli("build", "-q", "--network", "host", "--build-arg", f"IMAGE={image.tag}", "--build-arg",
                     f"S3_TARGET={target}", "-t", STANDIN, str(Path(__file__).parent / "support" / "compose"),
                     timeout=budget(600))
    assert out.returncode == 0, out.stderr
    return STANDIN


def test_the_documented_compose_sequence(engine, image, standin, s3_env, tmp_path):
    """docs/deploy.md's sequence: up -> kill -s SIGTERM train (exit 75, a commit) -> run --rm cli ls -> up -d train
    (resumes, done) -> run --rm verify -> down -v. `up` without --build: the image is the session's test image
    (TRAINPROOF_IMAGE); --build would build the product's CUDA image, whose base cannot be pulled here."""
    if not shutil.which("docker-compose"):
        pytest.fail("no docker-compose (Debian: apt-get install docker-compose; scripts/docker.sh install)",
                    pytrace=False)
    compose_file = tmp_path / "compose.yaml"
    compose_for_this_engine(compose_file)
    # The documented one-liner's result: a key file beside the compose file, readable by the container's user.
    key = tmp_path / "signing-key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o644)
    project = f"tp-compose-{uuid.uuid4().hex[:8]}"
    env = {**engine.env(), "TRAINPROOF_IMAGE": image.tag, "MINIO_IMAGE": standin, "MC_IMAGE": standin,
           "MINIO_ROOT_USER": dummy_aws_env()["AWS_ACCESS_KEY_ID"],
           "MINIO_ROOT_PASSWORD": dummy_aws_env()["AWS_SECRET_ACCESS_KEY"],
           "TRAINPROOF_BUCKET": f"{s3_env}-compose", "TRAINPROOF_MAX_STEPS": str(TARGET), "TRAINPROOF_CHECKPOINT_EVERY": "50",
           "COMPOSE_INTERACTIVE_NO_CLI": "1"}

    def compose(*args: str, timeout: float = 600, said: bool = True) -> subprocess.CompletedProcess:
        began = time.monotonic()
        out = subprocess.run(["docker-compose", "-p", project, "-f", str(compose_file), *args], env=env,
                             capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if said:  # the sequence's steps, not the polling of logs
            container.report(f"docker-compose {' '.join(args)} -> exit {out.returncode} "
                             f"({time.monotonic() - began:.0f} s)")
        return out

    def train_exit(timeout: float) -> int:
        cid = compose("ps", "-q", "train", said=False).stdout.strip()
        assert cid, "no train container"
        return int(engine.cli("wait", cid, timeout=timeout, check=True).stdout)

    try:
        up = compose("up", "-d")
        assert up.returncode == 0, up.stderr[-3000:]
        wait_for_step(engine, compose("ps", "-q", "train", said=False).stdout.strip(), STOP_AT)
        assert compose("kill", "-s", "SIGTERM", "train").returncode == 0
        code = train_exit(180)
        found = events(_service_log(compose("logs", "--no-color", "train", said=False).stdout))
        container.report(f"compose train after kill -s SIGTERM -> exit {code}")
        assert code == 75 and of(found, "stopped")[-1]["exit_code"] == 75, found[-3:]
        committed = of(found, "stopped")[-1]["committed_step"]

        ls = compose("run", "--rm", "cli", "ls")
        assert ls.returncode == 0 and "complete" in ls.stdout, ls.stdout + ls.stderr[-2000:]

        assert compose("up", "-d", "train").returncode == 0
        code = train_exit(600)
        found = events(_service_log(compose("logs", "--no-color", "train", said=False).stdout))
        container.report(f"compose train after up -d train -> exit {code}")
        assert code == 0, found[-3:]
        assert [e["step"] for e in of(found, "resume")][-1] == committed and of(found, "done")[-1]["step"] == TARGET

        verify = compose("run", "--rm", "verify")
        assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]
        # Signed by default: no "not authenticated" warning, and the newest generation's manifest carries an
        # HMAC signature made with the mounted key (so the audit above checked signatures).
        logs = compose("logs", "--no-color", "train", said=False).stdout
        assert "no signing key" not in logs
        manifest = _newest_manifest(f"{s3_env}-compose", "runs/compose/")
        assert manifest["signature"]["alg"] == "hmac-sha256", manifest.get("signature")
        assert manifest["signature"]["key_id"] == key_id(key.read_bytes())
    finally:
        print(compose("logs", "--no-color", "--tail", "40", said=False).stdout[-8000:])  # shown when the test fails
        compose("down", "-v", timeout=budget(300))


def _newest_manifest(bucket: str, prefix: str) -> dict:
    """The newest generation's COMPLETE.json under ``prefix``, read with boto3 from the suite's S3 server."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", []) if o["Key"].endswith("/COMPLETE.json") and "/step-" in o["Key"]]
    assert keys, f"no committed generation under s3://{bucket}/{prefix}"
    return json.loads(s3.get_object(Bucket=bucket, Key=max(keys))["Body"].read())


def _service_log(text: str) -> str:
    """`docker-compose logs` prefixes each line with `service_1  | `: the lines as the service printed them."""
    return "\n".join(ln.split("| ", 1)[1] if "| " in ln else ln for ln in text.splitlines())
