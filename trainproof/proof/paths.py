"""The verifier's plumbing: training paths as fresh processes, generation copies, read-backs from the store.

Every path is a real ``python -m trainproof train`` process: a resume checked inside the process that wrote the
checkpoint would share its memory (a generator, a cached tensor) and prove nothing. Every result is read
back through a fresh ``open_store`` on the path's URL, never from memory or a local copy.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainproof.errors import StateError
from trainproof.format.contract import PLAN_FILE, absolute_url, read_run_plan  # noqa: F401 - re-exported
from trainproof.format.history import assemble
from trainproof.format.layout import sharded
from trainproof.format.shard_files import METADATA_FILE, is_sharded_file
from trainproof.format.state import STATE_FILE, decode, decode_generation
from trainproof.storage import COMPLETE, GenerationStore, redact_url
from trainproof.storage.spool import spool_dir
from trainproof.train.launch import entry_argv

Opener = Callable[[str], GenerationStore]
# Kept for the children: how to reach the store. Every other TRAINPROOF_* variable is a `train` option: an
# inherited TRAINPROOF_MAX_STEPS would fight the path's own options, so the verifier passes everything
# explicitly instead. The signing keys (TRAINPROOF_SIGNING_KEY*) are kept too: a path must sign its own
# generations and accept the run's signed plan.json and generation it is seeded with.
_KEPT_PREFIXES = ("TRAINPROOF_S3_", "TRAINPROOF_ENDPOINT_URL", "TRAINPROOF_REGION", "TRAINPROOF_SIGNING_KEY",
                  "TRAINPROOF_DATA_CACHE")
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
"""The repository (or site-packages) folder holding ``job`` and ``storage``: put on a child's PYTHONPATH."""


class VerificationIncomplete(Exception):
    """The verification could not be completed (exit 2): a path crashed, the store failed, a result is missing.

    ``hint``: what to try, for the report and the summary (the message says what happened)."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


RERUN_HINT = ("its command is in verification.json (paths.{name}.command): run it to see its whole output; fix what "
              "the error names in the task (or the store), then run verify again")


def error_lines(stderr: str, limit: int = 3) -> str:
    """The few lines of a process's stderr that say what went wrong, not its whole traceback: its own
    ``trainproof: error:`` lines when it printed any, else the exception of the last traceback and the frame that
    raised it, else its last lines."""
    lines = [line.rstrip() for line in stderr.strip().splitlines() if line.strip()]
    own = [line for line in lines if line.startswith("trainproof: error:")]
    if own:
        return "\n".join(own[-limit:])
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        tail = lines[starts[-1] + 1:]
        frames = [i for i, line in enumerate(tail) if line.lstrip().startswith('File "')]
        if frames:
            raised = [line for line in tail[frames[-1] + 1:] if not line.startswith(" ")]
            return "\n".join([*(raised[-limit:] or tail[-1:]), f"(raised at {tail[frames[-1]].strip()})"])
    return "\n".join(lines[-limit:])


@dataclass(kw_only=True)
class PathResult:
    """One finished training process."""

    name: str
    url: str
    argv: list[str]
    code: int | None
    """Exit status; None when it was killed for running past the timeout."""
    seconds: float
    stderr_tail: str = ""
    error: str = ""
    """What went wrong, in a few lines (:func:`error_lines`), when it did not exit 0."""
    events: list[dict[str, Any]] = field(default_factory=list)

    def event(self, name: str) -> dict[str, Any] | None:
        """The last JSON event called ``name`` that the process printed, if any."""
        found = [e for e in self.events if e.get("event") == name]
        return found[-1] if found else None

    def to_json(self) -> dict[str, Any]:
        """The path's entry in verification.json (the command as one shell line)."""
        resume = self.event("resume")
        return {"store": redact_url(self.url),
                "command": shlex.join(redact_url(a) if "://" in a else a for a in self.argv),
                "exit_code": self.code,
                "seconds": round(self.seconds, 3), "resumed_from": None if resume is None else resume.get("step"),
                "rng_restored": None if resume is None else resume.get("rng_restored"),
                **({"error": self.error} if self.code != 0 and self.error else {})}


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a path: ours minus ``train`` option variables, with this package importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_") or k.startswith(_KEPT_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    # cuBLAS needs this before its first call for deterministic results (harmless on the CPU).
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env.update(extra or {})
    return env


def job_argv(command: str, *args: str) -> list[str]:
    """``python -m trainproof <command> ...`` with this interpreter."""
    return entry_argv(command, *args)


def run_processes(jobs: list[tuple[str, str, list[str]]], *, timeout: float, parallel: bool = True,
                  envs: dict[str, dict[str, str]] | None = None) -> list[PathResult]:
    """Run ``(name, url, argv)`` jobs (concurrently unless ``parallel`` is False) and collect their results.

    ``envs``: extra environment variables by job name (e.g. a test-only hook for a negative control)."""
    envs = envs or {}
    if not parallel:
        return [_finish(name, url, argv, _start(argv, envs.get(name)), timeout) for name, url, argv in jobs]
    started = [(name, url, argv, _start(argv, envs.get(name))) for name, url, argv in jobs]
    return [_finish(name, url, argv, proc, timeout) for name, url, argv, proc in started]


def _start(argv: list[str], extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, float]:
    # Its own session, so a timeout can kill the whole process group (a task may start workers).
    proc = subprocess.Popen(argv, env=child_env(extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, time.monotonic()


def _finish(name: str, url: str, argv: list[str], started: tuple[subprocess.Popen, float],
            timeout: float) -> PathResult:
    proc, t0 = started
    out, err, code = _communicate(proc, timeout - (time.monotonic() - t0))
    events = [_json_line(line) for line in out.splitlines() if line.startswith("{")]
    return PathResult(name=name, url=url, argv=argv, code=code, seconds=time.monotonic() - t0,
                      stderr_tail="\n".join(err.strip().splitlines()[-8:]),
                      error=error_lines(err) if code != 0 else "", events=[e for e in events if e])


def _communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, str, int | None]:
    try:
        out, err = proc.communicate(timeout=max(timeout, 1.0))
        return out, err, proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # our own child's group, started with start_new_session
        out, err = proc.communicate()
        return out, err + f"\n(killed after {timeout:.0f} s)", None


def _json_line(line: str) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def require_success(results: list[PathResult]) -> None:
    """Raise VerificationIncomplete naming the first path that did not exit 0, with the lines of its stderr that say
    why (:func:`error_lines`; its command is in the report's ``paths``)."""
    for r in results:
        if r.code != 0:
            how = "timed out" if r.code is None else f"exited {r.code}"
            raise VerificationIncomplete(f"path {r.name!r} {how}: {r.error or r.stderr_tail}",
                                         hint=RERUN_HINT.format(name=r.name))


class RunReader:
    """A path's run opened afresh from its URL: which steps are committed, and their decoded states."""

    def __init__(self, name: str, url: str, opener: Opener) -> None:
        self.name, self.url = name, url
        self.store = opener(url)
        self.steps = [g.step for g in self.store.scan() if g.status == COMPLETE]
        self._sections: dict[int, dict[str, Any]] = {}  # each generation's own history rows, read once

    def state(self, step: int, *, since: int = 1, whole: bool = False) -> dict[str, Any]:
        """Generation ``step``, read back and verified (size, sha256), then decoded weights-only, with its history
        reassembled from the path's generations (steps ``since``..``step``) and its chain checked end to end
        (trainproof.format.history; every path keeps all its generations: ``--keep 0``).

        A sharded run's model and optimizer stay in its shards (:func:`with_sections`: the comparison reads them
        a group at a time); ``whole``: read them whole into ``model`` and ``optimizer`` instead."""
        if step not in self.steps:
            raise VerificationIncomplete(f"path {self.name!r} has no complete generation at step {step} "
                                         f"(it has {self.steps or 'none'}) in {self.url}")
        state = decode_generation(self.store.load(step, skip=is_sharded_file).files)  # rank files joined (world > 1)
        # sharded (--fsdp): model and optimizer read from its shards, whole or by the comparison
        state = (with_shards if whole else with_sections)(self.store, step, state)
        self._sections[step] = _history_section(state)
        try:
            return assemble(state, self._section, since=since).state
        except StateError as exc:
            raise VerificationIncomplete(f"path {self.name!r}: the history of step {step} cannot be reassembled "
                                         f"from {self.url}: {exc}") from None

    def _section(self, step: int) -> dict[str, Any] | None:
        if step not in self._sections:
            if step not in self.steps:
                return None
            loaded = self.store.load(step, skip=is_sharded_file)
            self._sections[step] = _history_section(decode(loaded.files[STATE_FILE]))
        return self._sections[step]


def _history_section(state: dict[str, Any]) -> dict[str, Any]:
    """What :func:`trainproof.format.history.assemble` needs of an older generation (not its model or optimizer)."""
    return {"progress": state["progress"], "history": state["history"], "history_chain": state.get("history_chain")}


def seed_run(dst: GenerationStore, plan: bytes, loaded: Any, *, lineage: GenerationStore | None = None) -> None:
    """Start run ``dst`` from a generation of another run: its plan.json, then the generation (``storage.Loaded``)
    committed under its own step.

    The copy goes through write -> verify -> mark usable like any commit, so the run it seeds resumes from
    bytes proven equal to the source's, and ``train`` needs no option to start from a given step.
    ``lineage``: the source run; the older generations holding the history rows before the seeded one are
    copied first (each generation holds only the rows since the previous one), so the seeded run's full history
    can be reassembled from its own store.
    """
    dst.write_file(PLAN_FILE, plan, create_only=True)
    for older in ([] if lineage is None else history_lineage(lineage, loaded)):
        try:
            commit_copy(dst, older)
        finally:
            older.close()
    commit_copy(dst, loaded)


def seed_copy(dst: GenerationStore, source: GenerationStore, step: int) -> None:
    """:func:`seed_run` of ``dst`` from generation ``step`` of ``source`` (large files spooled, deleted once copied)."""
    loaded = load_generation(source, step)
    try:
        seed_run(dst, source.read_file(PLAN_FILE), loaded, lineage=source)
    finally:
        loaded.close()


def history_lineage(src: GenerationStore, loaded: Any) -> list[Any]:
    """The generations of ``src`` below ``loaded`` that hold the rest of its history, oldest first."""
    out: list[Any] = []
    first = decode(loaded.files[STATE_FILE])["history_chain"]["first"]
    try:
        while first > 1:
            older = load_generation(src, first - 1)
            out.append(older)
            below = decode(older.files[STATE_FILE])["history_chain"]["first"]
            if not below < first:  # a generation without rows of its own: the walk would not move
                raise VerificationIncomplete(f"{src.url}: generation step {first - 1} holds no history rows of its own")
            first = below
    except BaseException:
        for older in out:
            older.close()
        raise
    return out[::-1]


def load_generation(src: GenerationStore, step: int) -> Any:
    """Generation ``step`` of ``src``, verified (size, sha256) and its state decoded once (a real load).

    Files of a part or more (a large state, a shard file) are downloaded into spool files (``TRAINPROOF_SPOOL_DIR``),
    not into memory; the caller deletes them with ``close()`` once it has copied them (:func:`seed_run`)."""
    return src.load(step, check=_state_check, spool_dir=spool_dir())


def commit_copy(dst: GenerationStore, loaded: Any) -> dict[str, Any]:
    """Commit an already loaded generation (``storage.Loaded``) into ``dst`` under its own step."""
    manifest = loaded.info.manifest
    dst.commit(loaded.info.step, loaded.files, contract=manifest["contract"], world=manifest["world"],
               code_version=manifest.get("code_version", ""), check=_state_check, extra=manifest.get("extra"),
               digests=({"state": STATE_FILE} if STATE_FILE in loaded.files else {})
               | ({"dcp_metadata": METADATA_FILE} if METADATA_FILE in loaded.files else {}) or None)
    return manifest


def _state_check(name: str, data: bytes) -> None:
    if name == STATE_FILE:
        decode(data)


def new_id() -> str:
    """A verification id: UTC time (sortable) and a random suffix (two verifiers started the same second)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + os.urandom(3).hex()


def with_sections(store: GenerationStore, step: int, state: dict[str, Any]) -> dict[str, Any]:
    """A sharded run's state (``meta.fsdp``) with its shards opened for a comparison that reads them a group of
    entries at a time (``trainproof.proof.compare.SECTIONS``; the metadata is read and verified here, no tensor yet);
    any other state as it is, without importing torch.distributed."""
    if not sharded(state.get("meta")):
        return state
    from trainproof.proof.compare import SECTIONS
    from trainproof.train.fsdp import ShardedSections

    return {**state, SECTIONS: ShardedSections(store, step)}


def with_shards(store: GenerationStore, step: int, state: dict[str, Any]) -> dict[str, Any]:
    """A sharded run's state (``meta.fsdp``) with its model and optimizer read whole from the shards
    (``trainproof.train.fsdp.complete_state``); any other state as it is, without importing torch.distributed."""
    if not sharded(state.get("meta")):
        return state
    from trainproof.train.fsdp import complete_state

    return complete_state(store, step, state)
