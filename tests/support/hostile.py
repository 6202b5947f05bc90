"""A hostile-bucket fuzzer: random mutations planted as *new* objects into a real committed run (no deletion, no
overwrite of what the run wrote), then a real ``train`` restarted over them, which must end exactly as if nothing
had been planted. Used by tests/test_hostile_fuzz.py (a few rounds) and bench/hostile_fuzz.py (many).

What the planter can do is what a co-tenant without the signing key can: write any object that does not exist yet,
with a ``COMPLETE.json`` whose sizes and sha256s match what it wrote. The mutations are made from *genuine* states
of the same run at later steps (a reference run), each with one thing changed that a correct trainer must notice
(a shape, a type, a key, a recorded draw, the data cursor, the scheduler, a history row, the task state, ...), plus
damaged files and manifests, a listing flood, a planted ``deadline.json``, ``LATEST`` hint and export bundle.
Mutations that keep a state valid but different (other weights of the same shape, a changed byte inside a tensor)
are not made: without a key nothing can tell them from the run's own (SECURITY.md); nor are those that decoding
normalises away (a second copy of rank 0's part in a world of one), which leave the run's own state.

Each round plants a batch at steps above the run's target and, where the restarted run writes, one occupant at the
step it commits next and one at each top-level name it writes (``quarantine``, its deadline export's bundle,
``deadline.json``, ``LATEST``: files, links leading out of the run, FIFOs, folders of the wrong shape, damaged
manifests, genuine generations of another contract or build; on S3 the objects a co-tenant can write); restarts
``train`` once, and checks: exit 0, no traceback, a resume from the run's real newest generation, the final state
bitwise equal to an untouched run's, every genuine generation still there, and nothing written outside the run.
"""

from __future__ import annotations

import copy
import io
import json
import random
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from trainproof.format.state import STATE_FILE, decode, encode
from trainproof.storage import open_store
from trainproof.storage.backend import join
from trainproof.storage.manifest import MARKER, SCHEMA

GENUINE = (2, 4, 6)
"""The run's own generations before a round (trained to 6, a generation every 2 steps)."""
TARGET = 8
"""Where each restarted run trains to; everything is planted above it."""
FIRST_PLANT = TARGET + 1


@dataclass
class Planted:
    """What one round planted: the mutation class of each step, and anything planted beside the generations."""

    steps: dict[int, str] = field(default_factory=dict)
    others: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.steps) + len(self.others)


# -- state mutations: (rng, state) -> mutated state (None: not applicable to this state) ---------------------
def trained(tmp_path_factory, name: str, steps: int, every: int) -> Path:
    """A run in a fresh folder, trained to ``steps`` with a generation every ``every`` steps, none deleted."""
    from tests.test_train_helpers import run

    folder = tmp_path_factory.mktemp(name) / "run"
    result = run(folder, "--max-steps", str(steps), "--checkpoint-every", str(every), "--keep", "0")
    assert result.code == 0, result.stderr
    return folder


def _tensor_key(rng: random.Random, tensors: dict[str, Any]) -> str:
    return rng.choice(sorted(k for k, v in tensors.items() if isinstance(v, torch.Tensor)))


def m_model_reshape(rng, s):
    k = _tensor_key(rng, s["model"])
    t = s["model"][k]
    s["model"][k] = t.reshape(-1).clone() if t.dim() > 1 else torch.cat([t, t[:1]])
    return s


def m_model_retype(rng, s):
    k = _tensor_key(rng, s["model"])
    s["model"][k] = s["model"][k].to(rng.choice([torch.float32, torch.int64, torch.float16]))
    return s


def m_model_missing(rng, s):
    del s["model"][_tensor_key(rng, s["model"])]
    return s


def m_model_extra(rng, s):
    s["model"][f"extra.{rng.randrange(99)}"] = torch.zeros(rng.randrange(1, 5))
    return s


def m_model_truncated(rng, s):
    k = _tensor_key(rng, s["model"])
    s["model"][k] = s["model"][k][:-1].clone()
    return s


def m_model_not_a_tensor(rng, s):
    s["model"][_tensor_key(rng, s["model"])] = rng.choice([1.5, "weights", [1, 2], None])
    return s


def m_moment_reshape(rng, s):
    pid = rng.choice(sorted(s["optimizer"]["state"]))
    moments = s["optimizer"]["state"][pid]
    k = rng.choice(sorted(k for k, v in moments.items() if isinstance(v, torch.Tensor) and v.dim()))
    moments[k] = torch.zeros(moments[k].numel() + 1, dtype=moments[k].dtype)
    return s


def m_moment_missing(rng, s):
    pid = rng.choice(sorted(s["optimizer"]["state"]))
    moments = s["optimizer"]["state"][pid]
    del moments[rng.choice(sorted(moments))]
    return s


def m_moment_retype(rng, s):
    pid = rng.choice(sorted(s["optimizer"]["state"]))
    moments = s["optimizer"]["state"][pid]
    k = rng.choice(sorted(moments))
    moments[k] = moments[k].to(torch.int32) if isinstance(moments[k], torch.Tensor) else "x"
    return s


def m_moment_extra_param(rng, s):
    s["optimizer"]["state"][rng.randrange(50, 99)] = {"step": torch.tensor(1.0)}
    return s


def m_param_group_field(rng, s):
    group = s["optimizer"]["param_groups"][0]
    k = rng.choice(sorted(k for k in group if k != "params"))
    if rng.random() < 0.5:
        del group[k]
    else:
        group[k] = "not a number"
    return s


def m_param_group_ids(rng, s):
    s["optimizer"]["param_groups"][0]["params"] = rng.choice([[], [0, 0, 1, 2], ["a", "b", "c", "d"], [0]])
    return s


def m_next_draw(rng, s):
    draws = s["ranks"][0]["next_draws"]
    k = rng.choice(sorted(draws))
    draws[k] = draws[k] + rng.choice([1e-9, 0.25, -0.5]) if isinstance(draws[k], float) else 0.123
    return s


def m_rng_state(rng, s):
    state = s["ranks"][0]["rng"]
    k = rng.choice(sorted(state))
    state[k] = rng.choice([None, "junk", 7, [1, 2, 3]])
    return s


def m_cursor(rng, s):
    data = s["ranks"][0]["data"]
    data["cursor"] = max(0, min(data["num_samples"], data["cursor"] + rng.choice([-3, -1, 1, 2])))
    return s


def m_data_epoch(rng, s):
    s["ranks"][0]["data"]["epoch"] += rng.choice([1, 2])
    return s


def m_data_field(rng, s):
    data = s["ranks"][0]["data"]
    k = rng.choice(sorted(data))
    data[k] = rng.choice([None, "x", -1, 10**6])
    return s


def m_scheduler_step(rng, s):
    s["scheduler"]["last_epoch"] += rng.choice([-2, -1, 1, 3])
    return s


def m_scheduler_field(rng, s):
    sched = s["scheduler"]
    k = rng.choice(sorted(k for k in sched if k != "last_epoch"))
    sched[k] = rng.choice(["x", None, [1, 2, 3], {"a": 1}])
    return s


def m_history_row(rng, s):
    hist = s["history"]
    k = rng.choice(sorted(hist))
    col = hist[k]
    if isinstance(col, torch.Tensor) and col.numel():
        col = col.clone()
        col[rng.randrange(col.numel())] += 1
        hist[k] = col
    else:
        hist[k] = torch.zeros(3)
    return s


def m_history_missing(rng, s):
    del s["history"][rng.choice(sorted(s["history"]))]
    return s


def m_progress(rng, s):
    k = rng.choice(["samples_seen", "targets_seen", "epoch", "next_lr"])
    s["progress"][k] = rng.choice(["x", None, -5, [1]])
    return s


def m_task_state(rng, s):
    s["task_state"] = {"planted": rng.randrange(100)}
    return s


def m_meta(rng, s):
    k = rng.choice(["contract", "world", "data_identity", "code_version", "layout"])
    s["meta"][k] = rng.choice(["0" * 64, 3, None, {"x": 1}])
    return s


def m_section_missing(rng, s):
    sections = ["model", "optimizer", "scheduler", "scaler", "history", "history_chain", "progress", "ranks", "meta"]
    if s.get("task_state"):  # an empty one reads as absent (states written before it existed): no mutation
        sections.append("task_state")
    del s[rng.choice(sections)]
    return s


def m_schema(rng, s):
    s["schema"] = rng.choice(["trainproof.state/999", None, 1])
    return s


def m_ranks(rng, s):
    s["ranks"] = rng.choice([[], [{"rank": 0}], "x", [s["ranks"][0]["data"]]])
    return s


def m_not_weights_only(rng, s):
    import numpy as np

    s["progress"]["planted"] = np.zeros(2)  # refused by the weights-only load
    return s


STATE_MUTATIONS: dict[str, Callable] = {name[2:]: fn for name, fn in globals().items() if name.startswith("m_")}


# -- file and manifest mutations: (rng, genuine state bytes) -> files, or raw COMPLETE.json bytes -------------
def f_truncated(rng, raw):
    return {STATE_FILE: raw[: rng.randrange(1, len(raw) - 1)]}


def f_random_bytes(rng, raw):
    return {STATE_FILE: rng.randbytes(rng.randrange(1, 4096))}


def f_state_file_missing(rng, raw):
    return {"notes.txt": b"no state here"}


def f_extra_files_and_damaged_state(rng, raw):
    return {STATE_FILE: raw[:-10], "rank-00001.pt": raw, "extra.bin": rng.randbytes(64)}


def f_compressed_archive(rng, raw):
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            dst.writestr(item.filename, _stored_member(raw, item))
    return {STATE_FILE: out.getvalue()}


def _stored_member(raw: bytes, item) -> bytes:
    """A stored (uncompressed) member's bytes, read past its local header: the state's archive carries no crc32s
    (``trainproof.format.state.save_archive``), which ``ZipFile.read`` would check."""
    name_len = int.from_bytes(raw[item.header_offset + 26:item.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[item.header_offset + 28:item.header_offset + 30], "little")
    begin = item.header_offset + 30 + name_len + extra_len
    return raw[begin:begin + item.compress_size]


FILE_MUTATIONS: dict[str, Callable] = {name[2:]: fn for name, fn in globals().items() if name.startswith("f_")}


def _manifest(step: int, **over) -> dict:
    doc = {"schema": SCHEMA, "step": step, "contract": "c" * 64, "world": 1, "attempt": "a" * 32,
           "code_version": "t", "files": {STATE_FILE: {"bytes": 10, "sha256": "0" * 64}}}
    doc.update(over)
    return doc


RAW_MANIFESTS: dict[str, Callable] = {
    "manifest-huge": lambda rng, step: b'{"pad": "' + b"x" * (2 * 2**20) + b'"}',
    "manifest-deep": lambda rng, step: b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    "manifest-list": lambda rng, step: b"[1, 2, 3]",
    "manifest-junk": lambda rng, step: rng.randbytes(rng.randrange(1, 300)),
    "manifest-wrong-step": lambda rng, step: json.dumps(_manifest(step + 1)).encode(),
    "manifest-escape-codes": lambda rng, step: json.dumps(_manifest(step, contract="\x1b[2J\x1b]0;x\x07\nfake",
                                                                   code_version="\x1b[31m")).encode(),
    "manifest-huge-int": lambda rng, step: json.dumps(_manifest(step)).encode().replace(b'"world": 1',
                                                                                           b'"world": ' + b"9" * 5000),
    "manifest-path-object": lambda rng, step: json.dumps(_manifest(step, files={STATE_FILE: {
        "bytes": 10, "sha256": "0" * 64, "object": "../step-00000006/training_state.pt"}})).encode(),
}


NEXT_STEP_COMMON = {"partial", "marker-folder", "other-contract", "other-build", "manifest-huge", "manifest-deep",
                    "manifest-list", "manifest-junk", "manifest-wrong-step", "manifest-path-object"}
"""Occupants of the step the restarted run commits next, on any store. Not among them: a complete generation of the
run's own contract and build, which without a key is the run's own (another writer won the step: exit 1, and the
restart's resume decides whether it loads; SECURITY.md)."""
NEXT_STEP_LOCAL = NEXT_STEP_COMMON | {"file", "symlink", "fifo"}
NEXT_STEP_S3 = NEXT_STEP_COMMON | {"object"}
NAMES_LOCAL = {"quarantine": ["file", "symlink", "fifo"], f"exports/step-{TARGET:08d}": ["file", "fifo", "symlink"],
               "deadline.json": ["json", "folder", "fifo", "symlink"], "LATEST": ["folder", "fifo", "symlink"],
               "attempts": ["file", "fifo", "symlink", "records"], ".spool": ["file", "fifo", "symlink", "spools"]}
"""Top-level names the restarted run writes (it commits, quarantines, exports at its deadline, records the
deadline, moves the hint, leaves its attempt record and plans ``--checkpoint-every auto`` from the others, spools its
states in ``.spool``), each with what a co-tenant can put there on a folder."""
NAMES_S3 = {"quarantine": ["object"], f"exports/step-{TARGET:08d}": ["object"], "deadline.json": ["json", "folder"],
            "LATEST": ["folder"], "attempts": ["object", "records"]}


def _attempt_records(rng: random.Random) -> dict[str, bytes]:
    """Attempt records a co-tenant plants: many "killed" attempts of a second each (an interval at its floor), junk,
    a record too large, one nested too deep, one whose times go backwards."""
    killed = {f"2001010{i % 10}T000000-{i:08x}.json": json.dumps({
        "schema": "trainproof.attempt/1", "started_at": f"2001-01-01T00:00:{i % 60:02d}+00:00",
        "updated_at": f"2001-01-01T00:00:{i % 60:02d}.900+00:00", "resumed_from": 0, "last_step": 5,
        "commits": 1, "blocked_s": 1e-6}).encode() for i in range(rng.randrange(1, 60))}
    return {**killed, "junk.json": rng.randbytes(300), "huge.json": b" " * 70_000 + b"{}",
            "deep.json": b"[" * 50_000, "backwards.json": json.dumps({
                "schema": "trainproof.attempt/1", "started_at": "2030-01-01T00:00:00+00:00",
                "updated_at": "2001-01-01T00:00:00+00:00"}).encode()}


# -- planting -------------------------------------------------------------------------------------------------
class Planter:
    """Plants a round's mutations into the run at ``url``; donors are the reference run's genuine states."""

    def __init__(self, url: str, reference: Path, rng: random.Random, local: bool) -> None:
        self.url, self.reference, self.rng, self.local = url, reference, rng, local
        self.store = open_store(url)
        self._ref = open_store(str(reference))

    def donor(self, step: int) -> tuple[dict, bytes, dict]:
        loaded = self._ref.load(step)
        raw = bytes(loaded.files[STATE_FILE])
        return decode(raw), raw, loaded.info.manifest

    def commit(self, step: int, files: dict[str, bytes], manifest: dict) -> None:
        self.store.commit(step, files, contract=manifest["contract"], world=1, code_version=manifest["code_version"],
                          digests={"state": STATE_FILE} if STATE_FILE in files else None)

    def raw(self, step: int, marker: bytes) -> None:
        folder = join(self.store.root, f"step-{step:08d}")
        self.store.backend.write(join(folder, STATE_FILE), b"0123456789")
        self.store.backend.write(join(folder, MARKER), marker)

    def round(self, count: int) -> Planted:
        """``count`` generations at steps FIRST_PLANT.. (one mutation each), plus run-level plants."""
        planted = Planted()
        kinds = ([("state", k) for k in STATE_MUTATIONS] + [("file", k) for k in FILE_MUTATIONS]
                 + [("raw", k) for k in RAW_MANIFESTS] + ([("symlink", "symlink")] if self.local else [])
                 + [("empty", "incomplete-folder")])
        for step in range(FIRST_PLANT, FIRST_PLANT + count):
            kind, name = self.rng.choice(kinds)
            planted.steps[step] = self._plant(step, kind, name)
        self._run_level(planted)
        self._where_the_run_writes(planted)
        return planted

    # -- at the names the restarted run writes: the step it commits next, quarantine, its export, deadline.json --
    def _where_the_run_writes(self, planted: Planted) -> None:
        """One occupant at the step the restarted run commits next (TARGET) and one at each top-level name it
        writes, each of a kind drawn from what a co-tenant can put there on this store (a folder has files, links and
        FIFOs; S3 has objects only). Links lead to ``outside`` (beside the run), which must stay empty."""
        kinds = sorted(NEXT_STEP_LOCAL if self.local else NEXT_STEP_S3)
        kind = self.rng.choice(kinds)
        planted.steps[TARGET] = f"next:{kind}"
        planted.others.append(f"next:{kind}")
        self._occupy_step(TARGET, kind)
        for name, options in (NAMES_LOCAL if self.local else NAMES_S3).items():
            how = self.rng.choice(options)
            if name == "deadline.json" and how == "json":
                continue  # _run_level planted a record there already
            self._occupy(name, how)
            planted.others.append(f"{name}:{how}")

    def outside(self) -> Path:
        """The folder beside a local run that planted links lead to: nothing may be written there."""
        folder = Path(self.store.root).parent / "outside"
        folder.mkdir(exist_ok=True)
        return folder

    def _occupy_step(self, step: int, kind: str) -> None:
        name = f"step-{step:08d}"
        if kind in ("file", "symlink", "fifo", "object", "marker-folder"):
            self._occupy(name, kind)
        elif kind == "partial":  # a file named like the run's own, no COMPLETE.json
            self.store.backend.write(join(self.store.root, name, STATE_FILE), b"partial")
        elif kind in RAW_MANIFESTS:
            self.raw(step, RAW_MANIFESTS[kind](self.rng, step))
        else:  # a complete generation of this step, from the run's own later state, of another contract or build
            state, raw, manifest = self.donor(step)
            if kind == "other-contract":
                self.commit(step, {STATE_FILE: raw}, {**manifest, "contract": "f" * 64})
                return
            other = "trainproof 9.9+other"  # recorded as another build's, in the state and its manifest alike
            state["meta"]["code_version"] = other
            self.commit(step, {STATE_FILE: encode(state)}, {**manifest, "code_version": other})

    def _occupy(self, name: str, how: str) -> None:
        import os

        root, backend = self.store.root, self.store.backend
        path = join(root, name)
        if self.local and os.path.lexists(path) and not os.path.isdir(path):
            os.unlink(path)  # a plant of _run_level's (the LATEST hint is only a hint): replaced by this one
        elif self.local and how in ("file", "fifo", "symlink") and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)  # the run's own attempt records (only ever reported): a co-tenant replaced them
        if how == "object" or how == "file":
            backend.write(path, b"x")
        elif how == "records":
            for record, body in _attempt_records(self.rng).items():
                backend.write(join(path, record), body)
        elif how == "spools":  # named like the writer's leftover spools: a file, a link out of the run, a FIFO
            os.makedirs(path, exist_ok=True)
            backend.write(join(path, "trainproof-spool-planted"), b"x")
            os.symlink(self.outside(), join(path, "trainproof-spool-link"), target_is_directory=True)
            os.mkfifo(join(path, "trainproof-spool-fifo"))
        elif how == "folder":  # an object below the name: on S3 the name then lists as a folder
            backend.write(join(path, "x"), b"x")
        elif how == "marker-folder":  # a folder where a file goes inside it
            backend.write(join(path, MARKER, "x"), b"x")
        elif how == "symlink":
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.symlink(self.outside(), path, target_is_directory=True)
        elif how == "fifo":
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.mkfifo(path)
        else:
            raise ValueError(how)

    def _plant(self, step: int, kind: str, name: str) -> str:
        from tests.test_train_helpers import differences

        state, raw, manifest = self.donor(step)
        if kind == "state":
            for _ in range(8):  # a mutation that happens to change nothing is drawn again
                mutated = STATE_MUTATIONS[name](self.rng, copy.deepcopy(state))
                if mutated is not None:
                    try:
                        data = encode(mutated)
                    except Exception:  # a state torch.save refuses to write: nothing to plant
                        continue
                    if differences(mutated, state):  # a mutation that changed nothing would be genuine
                        self.commit(step, {STATE_FILE: data}, manifest)
                        return f"state:{name}"
            kind, name = "file", "truncated"
        if kind == "file":
            self.commit(step, FILE_MUTATIONS[name](self.rng, raw), manifest)
            return f"file:{name}"
        if kind == "raw":
            self.raw(step, RAW_MANIFESTS[name](self.rng, step))
            return f"raw:{name}"
        if kind == "symlink":
            target = Path(self.store.root) / "step-00000006"
            (Path(self.store.root) / f"step-{step:08d}").symlink_to(target)
            return "symlink"
        self.store.backend.write(join(self.store.root, f"step-{step:08d}", "training_state.pt.part"), b"partial")
        return "incomplete-folder"

    def _run_level(self, planted: Planted) -> None:
        rng, root, backend = self.rng, self.store.root, self.store.backend
        flood = rng.randrange(200, 2000)
        for i in range(flood if self.local else min(flood, 40)):  # S3: one PUT each
            backend.write(join(root, f"step-0000000-j{uuid.uuid4().hex[:10]}", "x"), b"")
        planted.others.append("listing-flood")
        backend.write(join(root, "LATEST"), rng.choice([
            f"step-{FIRST_PLANT + 3:08d}\n".encode(), b"\x1b[2J../../etc/passwd\n", b"x" * 200_000]))
        planted.others.append("latest-hint")
        long_ago = "2001-01-01T00:00:00+00:00"
        backend.write(join(root, "deadline.json"), rng.choice([
            json.dumps({"schema": "trainproof.deadline/1", "spec": "1h", "first_start": long_ago,
                        "at": "2001-01-01T01:00:00+00:00"}).encode(),
            b'{"at": [[[[' * 5000, b"[1, 2]"]))
        planted.others.append("deadline")
        bundle = join(root, "exports", f"step-{FIRST_PLANT:08d}")
        backend.write(join(bundle, "config.json"), b"[1, 2, 3]")
        backend.write(join(bundle, MARKER), json.dumps(_manifest(FIRST_PLANT, files={"config.json": {
            "bytes": 9, "sha256": "0" * 64}})).encode())
        planted.others.append("bundle")


def copy_run(src: Path, url: str) -> None:
    """The genuine run ``src`` (a folder) at ``url``: a folder (copied) or an S3 prefix (uploaded)."""
    if "://" not in url:
        shutil.copytree(src, url)
        return
    dst = open_store(url)
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        dst.write_file(str(path.relative_to(src)), path.read_bytes())


def check_round(url: str, reference: Path, planted: Planted, result: Any) -> list[str]:
    """What went wrong in a round (empty when the run ended as if nothing had been planted)."""
    from tests.test_train_helpers import differences, load_state, trajectory

    problems = []
    outside = Path(url).parent / "outside" if "://" not in url else None
    if outside is not None and outside.exists() and any(outside.iterdir()):
        problems.append(f"written outside the run, through a planted link: {sorted(p.name for p in outside.iterdir())}")
    if result.code != 0:
        problems.append(f"exit {result.code}: {result.stderr[-2000:]}")
    if "Traceback" in result.stderr:
        problems.append(f"a traceback: {result.stderr[-2000:]}")
    if problems:
        return problems
    resumed = [e for e in result.events if e.get("event") == "resume"]
    if not resumed or resumed[-1]["step"] != GENUINE[-1]:
        problems.append(f"resumed from {resumed[-1]['step'] if resumed else 'nothing'}, not {GENUINE[-1]}")
    store = open_store(url)
    status = {g.step: g.status for g in store.scan()}
    lost = [s for s in (*GENUINE, TARGET) if status.get(s) != "complete"]
    if lost:
        problems.append(f"genuine generations missing or unusable: {lost}")
    if not problems:
        diff = differences(trajectory(load_state(reference, TARGET)), trajectory(load_state(url, TARGET)))
        if diff:
            problems.append(f"final state differs from the untouched run: {diff[:5]}")
    return problems
