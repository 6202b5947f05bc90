"""Compare two decoded training states, section by section, within a tolerance.

The verifier's arithmetic, kept free of processes and stores so it can be tested on its own. A *check*
is one named section of the state (``parameters``, ``optimizer``, ``rng_next_draws`` ...); comparing a
check walks both sides and records:

- structural problems: missing or extra keys, other lengths, shapes, dtypes or types, and non-finite
  floating values on either side (even when both agree: the protocol refuses NaN/inf, never accepts them);
- the largest absolute difference of the floating values, and whether any value lies outside
  ``|other - ref| <= atol + rtol * |ref|`` (``ref`` is the continuous path, as in ``numpy.isclose``);
- integers, strings, booleans and None must be *equal*: a sample id or a step count is never "close".

A check is within tolerance when it has no problem and no value outside the tolerance.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from trainproof.errors import ConfigError, StateError
from trainproof.format.state import History
from trainproof.train.data import permutation_of


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """Absolute and relative tolerance for floating-point values, and the mode it stands for.

    ``exact``: every difference must be 0 (atol = rtol = 0), the default where the paths are bitwise by construction
    (the CPU with the trainer's deterministic settings); ``tolerance``: ``|other - ref| <= atol + rtol * |ref|``
    where they are not (CUDA kernels), or as given on the command line (``given``)."""

    atol: float = 1e-12
    """Absolute tolerance."""
    rtol: float = 0.0
    """Relative tolerance, applied to the reference's magnitude."""
    mode: str = "tolerance"
    """``exact`` (atol = rtol = 0), ``tolerance`` (derived from the device and dtype) or ``given`` (--atol/--rtol)."""
    why: str = ""
    """Why this mode, for the report."""

    def __post_init__(self) -> None:
        if not (self.atol >= 0 and self.rtol >= 0 and math.isfinite(self.atol) and math.isfinite(self.rtol)):
            raise ValueError(f"tolerances must be finite and >= 0 (got atol={self.atol}, rtol={self.rtol})")
        if self.mode not in ("exact", "tolerance", "given"):
            raise ValueError(f"unknown tolerance mode {self.mode!r}")
        if self.mode == "exact" and (self.atol or self.rtol):
            raise ValueError("an exact comparison has atol = rtol = 0")

    @classmethod
    def exact(cls, why: str) -> Tolerance:
        """Every difference 0."""
        return cls(atol=0.0, rtol=0.0, mode="exact", why=why)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "atol": self.atol, "rtol": self.rtol}


@dataclass
class Diff:
    """What a walk over one check found (accumulated over steps by :meth:`merge`)."""

    max_abs: float = 0.0
    exceeded: bool = False
    problems: list[str] = field(default_factory=list)
    detail: str = ""
    """The first place a value lies outside the tolerance, or differs."""
    first_step: int | None = None
    """The first step at which the check failed (when compared over several steps)."""

    @property
    def within(self) -> bool:
        """No structural problem and every value within the tolerance."""
        return not self.problems and not self.exceeded

    def merge(self, other: Diff, step: int | None = None) -> None:
        """Fold ``other`` (one more step's comparison) into this one."""
        if not other.within and self.within:
            self.first_step, self.detail = step, other.detail
        self.max_abs = max(self.max_abs, other.max_abs)
        self.exceeded |= other.exceeded
        self.problems.extend(p for p in other.problems if p not in self.problems)

    def to_json(self, name: str, tol: Tolerance) -> dict[str, Any]:
        """One check's entry in verification.json."""
        return {"name": name, "within_tolerance": self.within, "max_abs_diff": self.max_abs, "mode": tol.mode,
                "atol": tol.atol, "rtol": tol.rtol, "first_step": self.first_step,
                "detail": self.detail, "problems": self.problems[:10]}


def diff_tree(ref: Any, other: Any, tol: Tolerance, path: str = "", out: Diff | None = None) -> Diff:
    """Walk two nested values (dicts, lists, tensors, numbers, strings) and report how they differ."""
    out = out if out is not None else Diff()
    if isinstance(ref, torch.Tensor) or isinstance(other, torch.Tensor):
        _diff_tensors(ref, other, tol, path, out)
    elif isinstance(ref, dict) and isinstance(other, dict):
        missing = sorted(map(str, set(ref) ^ set(other)))
        if missing:
            out.problems.append(f"{path}: keys {missing[:6]} present on one side only")
        for key in ref:
            if key in other:
                diff_tree(ref[key], other[key], tol, f"{path}.{key}" if path else str(key), out)
    elif isinstance(ref, (list, tuple)) and isinstance(other, (list, tuple)):
        if len(ref) != len(other):
            out.problems.append(f"{path}: length {len(ref)} vs {len(other)}")
        for i, (a, b) in enumerate(zip(ref, other)):
            diff_tree(a, b, tol, f"{path}[{i}]", out)
    elif type(ref) is float or type(other) is float:
        _diff_floats(ref, other, tol, path, out)
    elif type(ref) is not type(other):
        out.problems.append(f"{path}: {type(ref).__name__} vs {type(other).__name__}")
    elif ref != other:
        if type(ref) is int:
            out.max_abs = max(out.max_abs, float(abs(ref - other)))
        _exceed(out, f"{path}: {_short(ref)} vs {_short(other)}")
    return out


def _diff_tensors(ref: Any, other: Any, tol: Tolerance, path: str, out: Diff) -> None:
    if not (isinstance(ref, torch.Tensor) and isinstance(other, torch.Tensor)):
        out.problems.append(f"{path}: tensor on one side only")
        return
    if ref.dtype != other.dtype or ref.shape != other.shape:
        out.problems.append(f"{path}: {ref.dtype}{tuple(ref.shape)} vs {other.dtype}{tuple(other.shape)}")
        return
    if ref.numel() == 0:
        return
    a, b = ref.detach().cpu(), other.detach().cpu()
    if a.is_floating_point() or a.is_complex():
        bad: set[str] = set()
        worst, outside = 0.0, False
        for x, y in _slices(a, b):  # float64 copies of a slice at a time, never of the whole tensor
            bad |= {side for side, t in (("reference", x), ("compared", y)) if not bool(torch.isfinite(t).all())}
            if bad:
                continue
            x, y = x.to(torch.float64), y.to(torch.float64)
            delta = (y - x).abs()
            worst = max(worst, float(delta.max()))
            outside = outside or bool((delta > tol.atol + tol.rtol * x.abs()).any())
        if bad:
            sides = " and ".join(side for side in ("reference", "compared") if side in bad)
            out.problems.append(f"{path}: non-finite values ({sides})")
            return
        out.max_abs = max(out.max_abs, worst)
        if outside:
            _exceed(out, f"{path}: max |diff| {worst:.3g}")
    elif not torch.equal(a, b):  # integers, booleans, bytes (RNG states): exact
        if a.dtype != torch.bool:
            out.max_abs = max(out.max_abs, max(float((y.to(torch.float64) - x.to(torch.float64)).abs().max())
                                               for x, y in _slices(a, b)))
        _exceed(out, f"{path}: {int((a != b).sum())} of {a.numel()} values differ")


SLICE = 1 << 22
"""Elements of a tensor compared at a time: its float64 copies stay at 32 MiB a side, whatever the tensor's size."""


def _slices(a: torch.Tensor, b: torch.Tensor):
    """Matching flat slices of two tensors of one shape (:data:`SLICE` elements each)."""
    x, y = a.reshape(-1), b.reshape(-1)
    for i in range(0, x.numel(), SLICE):
        yield x[i : i + SLICE], y[i : i + SLICE]


def _squared_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """sum((b - a)^2) in float64, a slice at a time."""
    return sum(float(((y.double() - x.double()) ** 2).sum()) for x, y in _slices(a.detach().cpu(), b.detach().cpu()))


def _diff_floats(ref: Any, other: Any, tol: Tolerance, path: str, out: Diff) -> None:
    if not all(type(v) in (float, int) for v in (ref, other)):
        out.problems.append(f"{path}: {type(ref).__name__} vs {type(other).__name__}")
        return
    if not (math.isfinite(ref) and math.isfinite(other)):
        out.problems.append(f"{path}: non-finite value ({ref} / {other})")
        return
    delta = abs(other - ref)
    out.max_abs = max(out.max_abs, delta)
    if delta > tol.atol + tol.rtol * abs(ref):
        _exceed(out, f"{path}: {ref!r} vs {other!r}")


def _exceed(out: Diff, detail: str) -> None:
    if not out.exceeded:
        out.detail = detail
    out.exceeded = True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:36] + "...'"


# -- what each check looks at ---------------------------------------------------------------------------
# Trainer settings (max_steps, ..., the step the process resumed from) differ between invocations by design;
# library versions, the device and the code identity are reported in verification.json rather than compared (an
# audit that replays across a code change reports it in ``audit_span``; the protocol's paths share one code).
_META_NOT_COMPARED = ("trainer", "versions", "device", "code_version", "code_changes")


def _schedule(value: Any) -> Any:
    """A scheduler's state, its infinities as the strings ``inf``/``-inf``: a scheduler holds them by design
    (ReduceLROnPlateau's ``mode_worse``, and its ``best`` before the first step), so they are compared as exact values
    rather than refused as a diverged run's; a NaN is still refused."""
    if isinstance(value, dict):
        return {k: _schedule(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_schedule(v) for v in value]
    if type(value) is float and math.isinf(value):
        return repr(value)
    return value


def _history(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return state["history"]


def _model_part(params: bool) -> Callable[[dict[str, Any], frozenset[str]], Any]:
    return lambda s, names: {k: v for k, v in s["model"].items() if (k in names) == params}


EXTRACTORS: dict[str, Callable[[dict[str, Any], frozenset[str]], Any]] = {
    "sample_ids": lambda s, _: {k: _history(s)[k] for k in ("sample_ids", "sample_offsets")},
    "learning_rates": lambda s, _: _history(s)["lr"],
    "losses": lambda s, _: _history(s)["loss"],
    "progress": lambda s, _: {"progress": {k: v for k, v in s["progress"].items() if k != "next_lr"},
                              **{k: _history(s)[k] for k in ("step", "epoch", "targets")}},
    "data_position": lambda s, _: [r.get("data") for r in s["ranks"]],
    "parameters": _model_part(True),
    "buffers": _model_part(False),
    "optimizer": lambda s, _: s["optimizer"],
    "scheduler": lambda s, _: _schedule(s["scheduler"]),
    "grad_scaler": lambda s, _: s["scaler"],
    "next_lr": lambda s, _: s["progress"].get("next_lr"),
    "rng_next_draws": lambda s, _: [r.get("next_draws") for r in s["ranks"]],
    "rng_states": lambda s, _: [r.get("rng") for r in s["ranks"]],
    "task_state": lambda s, _: s.get("task_state", {}),
    "configuration": lambda s, _: {k: v for k, v in s["meta"].items() if k not in _META_NOT_COMPARED},
}
"""Check name -> the part of a state it compares (``names``: the model's parameter names)."""

HISTORY_CHECKS = ("sample_ids", "learning_rates", "losses", "progress")


SECTIONS = "sharded_sections"
"""The key of a state whose model and optimizer stay in a sharded generation (``trainproof.train.fsdp.ShardedSections``:
``entries``, ``read(names)``, ``groups(names, budget)``, ``whole()``). The comparison reads them a group of
entries at a time from both sides, so the verifier's memory is a group (``TRAINPROOF_COMPARE_GROUP_MIB``), not two
or more whole states."""
STREAMED = ("parameters", "buffers", "optimizer")
"""The checks that a state with :data:`SECTIONS` answers from its shards."""
GROUP_ENV = "TRAINPROOF_COMPARE_GROUP_MIB"
"""Environment variable: MiB of tensors read from each side at a time when comparing sharded states (default 256)."""


def group_bytes() -> int:
    """The comparison's group size in bytes (``TRAINPROOF_COMPARE_GROUP_MIB``, default 256 MiB)."""
    raw = os.environ.get(GROUP_ENV) or "256"
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{GROUP_ENV}={raw!r} is not a positive number of MiB")
    return max(1, int(value * 2**20))


def compare_states(ref: dict[str, Any], other: dict[str, Any], tol: Tolerance,
                   param_names: frozenset[str]) -> dict[str, Diff]:
    """Every check of :data:`EXTRACTORS` between two states (whole, or with sharded :data:`SECTIONS`)."""
    return compare_all(ref, {"other": other}, tol, param_names)["other"][0]


def compare_all(ref: dict[str, Any], others: dict[str, dict[str, Any]], tol: Tolerance,
                param_names: frozenset[str]) -> dict[str, tuple[dict[str, Diff], float | None]]:
    """:func:`compare_states` and :func:`parameter_distance` of ``ref`` against each of ``others``.

    When every state keeps its model and optimizer in a sharded generation (:data:`SECTIONS`), those are compared
    a group of entries at a time, each group of ``ref`` read once for all of ``others``; a state with sections
    compared with one without is read whole first."""
    if not others:
        return {}
    streamed = SECTIONS in ref and all(SECTIONS in o for o in others.values())
    if not streamed:
        ref, others = _whole(ref), {n: _whole(o) for n, o in others.items()}
        return {n: (_diffs(ref, o, tol, param_names, EXTRACTORS), parameter_distance(ref, o, param_names))
                for n, o in others.items()}
    rest = {name: extract for name, extract in EXTRACTORS.items() if name not in STREAMED}
    sections = compare_sections(ref[SECTIONS], {n: o[SECTIONS] for n, o in others.items()}, tol, param_names)
    return {n: (_diffs(ref, o, tol, param_names, rest) | sections[n][0], sections[n][1]) for n, o in others.items()}


def _diffs(ref: dict[str, Any], other: dict[str, Any], tol: Tolerance, param_names: frozenset[str],
           checks: dict[str, Callable]) -> dict[str, Diff]:
    return {name: _safe_diff(name, extract, ref, other, tol, param_names) for name, extract in checks.items()}


def _whole(state: dict[str, Any]) -> dict[str, Any]:
    if SECTIONS not in state:
        return state
    model, optimizer = state[SECTIONS].whole()
    return {**{k: v for k, v in state.items() if k != SECTIONS}, "model": model, "optimizer": optimizer}


def compare_sections(ref: Any, others: dict[str, Any], tol: Tolerance, param_names: frozenset[str],
                     budget: int | None = None) -> dict[str, tuple[dict[str, Diff], float | None]]:
    """The ``parameters``, ``buffers`` and ``optimizer`` checks and the parameter distance between sharded
    sections (:data:`SECTIONS`), entry by entry: ``ref``'s entries are read a group of about ``budget`` bytes at a
    time (default :func:`group_bytes`), each group once, and the same entries of each of ``others`` one side at a
    time; an entry on one side only is a structural problem, as a key missing from a whole state is."""
    budget = group_bytes() if budget is None else budget
    check = {f: _section_check(e.path, param_names) for f, e in ref.entries.items()}
    out: dict[str, dict[str, Diff]] = {n: {c: Diff() for c in STREAMED} for n in others}
    squares = {n: 0.0 for n in others}
    aligned = {n: True for n in others}
    for n, o in others.items():
        theirs = {f: _section_check(e.path, param_names) for f, e in o.entries.items()}
        for c in STREAMED:
            mine = {f for f in check if check[f] == c}
            only = sorted(_shown(c, (ref if f in ref.entries else o).entries[f].path)
                          for f in mine ^ {f for f in theirs if theirs[f] == c})
            if only:
                out[n][c].problems.append(f"{c}: entries {only[:6]} present on one side only")
                aligned[n] = aligned[n] and c != "parameters"
    for group in ref.groups(list(ref.entries), budget):
        mine = ref.read(group)
        for n, o in others.items():
            keys = [f for f in group if f in o.entries]
            theirs = o.read(keys)
            for f in keys:
                a, b = mine[f], theirs[f]
                diff_tree(a, b, tol, _shown(check[f], ref.entries[f].path), out[n][check[f]])
                if check[f] == "parameters":
                    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
                        squares[n] += _squared_distance(a, b)
                    else:
                        aligned[n] = False
            del theirs
        del mine
    return {n: (out[n], math.sqrt(squares[n]) if aligned[n] and math.isfinite(squares[n]) else None) for n in others}


def _section_check(path: tuple, param_names: frozenset[str]) -> str:
    """Which check compares a sharded entry (by its path: ``("model", fqn)`` or ``("optim", ...)``)."""
    if path[0] == "model":
        return "parameters" if len(path) > 1 and path[1] in param_names else "buffers"
    return "optimizer"


def _shown(check: str, path: tuple) -> str:
    """An entry's place as :func:`diff_tree` names it in a whole state (``optimizer.state.w.exp_avg``)."""
    return check + "".join(f"[{p}]" if type(p) is int else f".{p}" for p in path[1:])


def _safe_diff(name: str, extract: Callable, ref: dict, other: dict, tol: Tolerance, names: frozenset[str]) -> Diff:
    try:
        a, b = extract(ref, names), extract(other, names)
    except (KeyError, TypeError, IndexError, AttributeError) as exc:  # a section missing: structural
        return Diff(problems=[f"{name}: section missing or malformed ({type(exc).__name__}: {exc})"])
    return diff_tree(a, b, tol, name)


def history_prefix(state: dict[str, Any], steps: int) -> dict[str, torch.Tensor]:
    """The first ``steps`` rows of a state's history, in the state's columnar layout."""
    hist = History.from_state_dict(state["history"])
    if len(hist) < steps:
        raise ValueError(f"the history holds {len(hist)} steps, fewer than {steps}")
    columns = {k: v[:steps].clone() for k, v in state["history"].items() if k not in ("sample_ids", "sample_offsets")}
    offsets = state["history"]["sample_offsets"][: steps + 1].clone()
    ids = state["history"]["sample_ids"][: int(offsets[-1])].clone()
    return {**columns, "sample_offsets": offsets, "sample_ids": ids}


def expected_at_cut(reference: dict[str, Any], cut: int) -> dict[str, Any]:
    """What a checkpoint taken after ``cut`` steps must hold, derived from the reference's full history.

    Returns a partial state with the sections the history determines: history, progress (step, epoch,
    samples and targets seen, next learning rate) and the data position's consumed prefix.
    """
    hist = history_prefix(reference, cut)
    lrs = reference["history"]["lr"]
    epoch = int(hist["epoch"][-1]) if cut else 0
    in_epoch = [i for i in range(cut) if int(hist["epoch"][i]) == epoch]
    offsets = hist["sample_offsets"]
    consumed = (torch.cat([hist["sample_ids"][int(offsets[i]) : int(offsets[i + 1])] for i in in_epoch])
                if in_epoch else torch.zeros(0, dtype=torch.int64))
    return {
        "history": hist,
        "progress": {"step": cut, "epoch": epoch, "samples_seen": int(offsets[-1]),
                     "targets_seen": int(hist["targets"].sum()),
                     **({"next_lr": float(lrs[cut])} if len(lrs) > cut else {})},
        "consumed_in_epoch": consumed,
    }


def compare_cut(cut_state: dict[str, Any], reference: dict[str, Any], cut: int, tol: Tolerance) -> dict[str, Diff]:
    """The cut checkpoint against the reference's history prefix (sample ids, rates, losses, progress,
    the next learning rate, and the part of the epoch permutation already consumed)."""
    try:
        expected = expected_at_cut(reference, cut)
    except (ValueError, KeyError) as exc:
        return {"history_prefix": Diff(problems=[f"cannot derive the state at step {cut}: {exc}"])}
    got_progress = {k: cut_state["progress"].get(k) for k in expected["progress"]}
    none: frozenset[str] = frozenset()
    diffs = {name: diff_tree(EXTRACTORS[name](expected, none), EXTRACTORS[name](cut_state, none), tol, name)
             for name in ("sample_ids", "learning_rates", "losses")}
    diffs["progress"] = diff_tree({k: v for k, v in expected["progress"].items() if k != "next_lr"},
                                  {k: v for k, v in got_progress.items() if k != "next_lr"}, tol, "progress")
    if "next_lr" in expected["progress"]:
        diffs["next_lr"] = diff_tree(expected["progress"]["next_lr"], got_progress["next_lr"], tol, "next_lr")
    diffs["data_position"] = _consumed_prefix(cut_state, expected["consumed_in_epoch"], tol)
    return diffs


def _consumed_prefix(cut_state: dict[str, Any], consumed: torch.Tensor, tol: Tolerance) -> Diff:
    data = cut_state["ranks"][0].get("data") or {}
    try:  # the permutation is not stored: it is redrawn from the position's generator pair (and checked)
        perm = permutation_of(data, data.get("num_samples"))
    except StateError as exc:
        return Diff(problems=[f"data_position: {exc}"])
    cursor = data["cursor"]
    if perm is None:
        perm = torch.zeros(0, dtype=torch.int64)
    return diff_tree(consumed, perm[:cursor], tol, "data_position.consumed")


def parameter_distance(ref: dict[str, Any], other: dict[str, Any], names: frozenset[str]) -> float | None:
    """L2 distance between the two states' parameters (float64), or None when they do not line up."""
    ref, other = _whole(ref), _whole(other)  # a state with sharded SECTIONS: read whole (compare_all streams them)
    a, b = _model_part(True)(ref, names), _model_part(True)(other, names)
    if set(a) != set(b) or any(a[k].shape != b[k].shape for k in a):
        return None
    total = sum(_squared_distance(a[k], b[k]) for k in a)
    return math.sqrt(total) if math.isfinite(total) else None
