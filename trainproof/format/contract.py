"""Run identity: ``plan.json`` and the contract hash that binds every checkpoint to its run.

The contract (docs/protocol.md) is sha256 over:

- the sha256 of the plan's configuration (the task spec and the task's own settings),
- the state schema version,
- the data identity (sha256 of the exact data / data manifest),
- the world size,
- the objective name (``global_token_mean_v1`` for tinylm, ``mse_mean_v1`` for regression),
- the seed,
- ``fsdp: true`` when the run trains sharded (``train --fsdp``; absent otherwise, so a replicated run's
  contract is what it always was): its generations hold shards, not one state, so a run cannot switch;
- ``precision`` when the task sets one (``bf16``, ``fp16``, ``fp32``; absent for ``auto``, the device's default,
  so the contract of a run that never chose is what it always was),
- ``init_sha256``: the sha256 of each pretrained weights file the model starts from (trainproof.tasks ``Pretrained``;
  absent when it starts from the seeded initialisation). Not its location: the same bytes elsewhere are the
  same start, and a resume never reads the file again,
- ``data_pipeline`` when the task builds its batches ahead (``Task.build_batch``, trainproof.train.pipeline): how the
  per-sample generators are derived, which changes results. Absent for a task built with ``make_batch`` (its
  contract is unchanged); the worker count and the prefetch depth never enter it, since they change nothing.
  plan.json also records the whole layout (trainproof.format.layout, outside the hash).

``plan.json`` is written once, create-only, on the first start. Every later start recomputes the fields
from its own options and compares them with the stored plan: a different task config, data, seed or
objective is a different experiment, so resuming would silently mix two runs. That is refused (exit 2)
with the name of the field that differs.

The world size is the exception to "compare with plan.json": plan.json holds the world the run *started*
with (it is in the contract hash, which keeps naming the run), but a run may continue on another world with
``--allow-world-change``. So the trainer compares the world with the newest generation's instead (see
trainproof.train.loop), and records every change in the state (``meta.world_changes``) and in summary.json.
plan.json also records the epoch plan of the first start (informational, outside the hash).

With a signing key (``TRAINPROOF_SIGNING_KEY``, see trainproof/storage/signing.py) plan.json also carries a random
``run_id`` and a ``signature`` (both outside the contract hash), and reading it checks that signature: an
unsigned or wrongly signed plan.json is a ContractError (exit 2), since the run's identity is in doubt.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlparse

from trainproof.errors import ConfigError, ContractError
from trainproof.format.layout import Layout, sharded
from trainproof.format.state import STATE_SCHEMA
from trainproof.storage import redact_url

PLAN_SCHEMA = "trainproof.plan/1"
PLAN_FILE = "plan.json"
# Compared in this order on restart; the first difference is reported (with the others listed).
CONTRACT_FIELDS = ("task", "task_config", "data_identity", "seed", "world", "objective", "state_schema", "fsdp",
                   "precision", "init_sha256", "data_pipeline")


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON bytes (sorted keys, no whitespace): the input of every hash here."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sha256_hex(data: bytes) -> str:
    """sha256 hex digest."""
    return hashlib.sha256(data).hexdigest()


def build_plan(
    *, task: str, task_config: dict[str, Any], data_identity: str, seed: int, world: int, objective: str,
    code_version: str, epoch_plan: dict[str, Any] | None = None, layout: Layout | None = None,
    precision: str = "auto", init: list[str] | None = None, data_pipeline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's plan: its identity fields, the derived contract hash, and when/what wrote it.

    ``layout`` (trainproof.format.layout; default: replicated over ``world``) is recorded as ``layout`` and, when
    sharded, as the ``fsdp: true`` field the contract hash has always covered. ``precision`` (the task's, when not
    ``auto``) and ``init`` (the sha256 of the pretrained weights files, when any) enter the hash too."""
    plan: dict[str, Any] = {
        "schema": PLAN_SCHEMA,
        "task": task,
        "task_config": task_config,
        "data_identity": data_identity,
        "seed": seed,
        "world": world,
        "objective": objective,
        "state_schema": STATE_SCHEMA,
    }
    plan.update((layout or Layout(world=world)).record())
    if precision != "auto":
        plan["precision"] = precision
    if init:
        plan["init_sha256"] = list(init)
    if data_pipeline is not None:
        plan["data_pipeline"] = data_pipeline
    plan["config_sha256"] = sha256_hex(canonical_json({"task": task, "task_config": task_config}))
    plan["contract"] = contract_of(plan)
    plan["code_version"] = code_version
    if epoch_plan is not None:
        plan["epoch_plan"] = epoch_plan
    plan["created_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return plan


def contract_of(plan: dict[str, Any]) -> str:
    """The contract hash of a plan (recomputed, never trusted from the file)."""
    fields = {
        "config_sha256": plan["config_sha256"],
        "state_schema": plan["state_schema"],
        "data_identity": plan["data_identity"],
        "world": plan["world"],
        "objective": plan["objective"],
        "seed": plan["seed"],
    }
    if sharded(plan):
        fields["fsdp"] = True
    for optional in ("precision", "init_sha256"):  # absent unless chosen: older runs keep their contract
        if plan.get(optional) not in (None, "auto", []):
            fields[optional] = plan[optional]
    if plan.get("data_pipeline") is not None:
        fields["data_pipeline"] = plan["data_pipeline"]
    return sha256_hex(canonical_json(fields))


def differences(stored: dict[str, Any], new: dict[str, Any], *, ignore: tuple[str, ...] = ()) -> list[str]:
    """Human-readable differences between two plans' contract fields, most specific first."""
    out = []
    for field in (f for f in CONTRACT_FIELDS if f not in ignore):
        a, b = stored.get(field), new.get(field)
        if field == "fsdp":  # the layout: absent means replicated (DDP); plans before ``layout`` have only ``fsdp``
            a, b = sharded(stored), sharded(new)
        if field == "precision":  # absent means auto
            a, b = a or "auto", b or "auto"
        if field == "init_sha256":  # absent means the seeded initialisation
            a, b = _init_text(a), _init_text(b)
            if a != b:
                out.append(f"init_sha256: the pretrained weights (stored {a}, now {b})")
            continue
        if a == b:
            continue
        if field == "task_config" and stored.get("task") != new.get("task"):
            continue  # another task has other settings altogether: naming the task says it all
        if field == "task_config" and isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    out.append(f"task_config.{key} (stored {a.get(key, '<absent>')!r}, now {b.get(key, '<absent>')!r})")
        else:
            out.append(f"{field} (stored {_short(a)}, now {_short(b)})")
    return out


def ensure_plan(store: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """Write ``plan.json`` create-only, or check this run against the one already there.

    Returns the plan in force (the stored one: its contract names the run even when the world size has
    changed since). Raises ContractError naming the differing field(s); the world is not compared here.
    """
    keys = _keys(store)
    if keys is not None:
        # A random run id makes this plan's digest, the anchor of the run's signed chain, unique to this run even
        # when another run with the same settings starts in the same second (trainproof.storage.signing).
        plan = keys.sign({**plan, "run_id": uuid.uuid4().hex})
    try:
        store.write_file(PLAN_FILE, canonical_json(plan) + b"\n", create_only=True)
        return plan
    except FileExistsError:
        pass  # a previous start (or a concurrent one that won the create) wrote it: compare
    stored = read_plan(store)
    check_plan(stored, plan, where=store.url)
    return stored


def check_plan(stored: dict[str, Any], plan: dict[str, Any], *, where: str) -> None:
    """Refuse ``plan`` unless it is the same experiment as ``stored`` (every contract field but the world)."""
    diffs = differences(stored, plan, ignore=("world",))
    if not diffs and contract_of({**plan, "world": stored.get("world")}) != stored.get("contract"):
        diffs = [f"contract (stored {_short(stored.get('contract'))}, now {_short(plan['contract'])})"]
    if diffs:
        raise ContractError(
            f"this run does not match {PLAN_FILE} in {where}: {diffs[0]}"
            + (f" (and {len(diffs) - 1} more: {'; '.join(diffs[1:4])}{'; ...' if len(diffs) > 4 else ''})"
               if len(diffs) > 1 else "")
            + ". Use a new --store for a new experiment, or the original settings to resume this one"
        )


def read_plan(store: Any) -> dict[str, Any]:
    """Read and parse ``plan.json``; a malformed plan is a contract error (a person must look at it)."""
    try:
        plan = store.read_json(PLAN_FILE)  # size-capped, defensive (trainproof.storage.limits)
    except ValueError as exc:
        raise ContractError(f"{PLAN_FILE} in {redact_url(store.url)} is not a readable plan ({exc})") from None
    if not isinstance(plan, dict) or plan.get("schema") != PLAN_SCHEMA:
        raise ContractError(f"{PLAN_FILE} in {redact_url(store.url)} is not a {PLAN_SCHEMA} plan")
    keys = _keys(store)
    problem = keys.problem(plan) if keys is not None else None
    if problem is not None:  # not skipped like a generation: the run's identity itself is in doubt
        raise ContractError(f"{PLAN_FILE} in {redact_url(store.url)} is not accepted with the configured signing "
                            f"key: {problem}. A person must look: restore the run's own {PLAN_FILE}, add its key to "
                            "TRAINPROOF_SIGNING_KEYS_ACCEPTED, or use a new --store")
    types = {"task": str, "task_config": dict, "seed": int, "world": int, "contract": str}
    wrong = [k for k, t in types.items() if k in plan and not isinstance(plan[k], t)]
    if wrong:
        raise ContractError(f"{PLAN_FILE} in {redact_url(store.url)} has malformed field(s) {wrong}")
    return plan


def _keys(store: Any) -> Any:
    """The store's signing keys (``trainproof.storage.signing.Keyring``), None when signing is off."""
    return getattr(getattr(store, "options", None), "signing", None)


def _init_text(value: Any) -> str:
    """The pretrained weights' sha256 as a short, printable text (the list comes from plan.json: untrusted)."""
    if not value:
        return "none: the seeded initialisation"
    if not isinstance(value, list):
        return _short(value)
    return "sha256 " + ", ".join(str(v)[:12] + "..." for v in value[:4]) + (" ..." if len(value) > 4 else "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:20] + "...'"


def read_run_plan(store: Any) -> dict[str, Any]:
    """The run's plan.json; ConfigError (exit 2) when the store holds no run."""
    try:
        return read_plan(store)
    except FileNotFoundError:
        raise ConfigError(f"{store.url} holds no run (no {PLAN_FILE})") from None


def absolute_url(store: Any) -> str:
    """The store's URL, absolute for a local folder (child processes may not share our working directory)."""
    return store.root if urlparse(store.url).scheme in ("", "file") else store.url.rstrip("/")
