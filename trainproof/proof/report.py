"""``verification.json``, its short table, and the optional plot.

The report is the recovery proof a person (or a CronJob's log) reads: verdicts first, then every check's
largest absolute difference and the tolerance it was held to, the commands that ran, the step recovered,
versions, device, threads, precision, and the export bundle's location and checksums.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import platform
import subprocess
from datetime import datetime, timezone
from typing import Any

import numpy
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import trainproof
from trainproof.proof.compare import Diff, Tolerance
from trainproof.proof.paths import PACKAGE_ROOT, child_env
from trainproof.storage import GenerationStore
from trainproof.tasks import Task

log = logging.getLogger("trainproof.verify")
REPORT_SCHEMA = "trainproof.verification/1"
REPORT_FILE, PLOT_FILE = "verification.json", "verification.png"
INCOMPLETE = "INCOMPLETE"
"""``verdict`` of a verification that could not complete: nothing was compared to the end, nothing passed or failed."""


def code_revision() -> str:
    """The git commit of this trainproof checkout (``+dirty`` with local changes), else ``unknown``."""
    # Only our own checkout: an installed package inside some other repository must not report its commit.
    top = _git("rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top) != os.path.realpath(PACKAGE_ROOT):
        return "unknown"
    head = _git("rev-parse", "HEAD")
    if head is None:
        return "unknown"
    return head + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", PACKAGE_ROOT, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(task: Task, meta: dict[str, Any]) -> dict[str, Any]:
    """Versions, device, threads, precision and determinism settings of the compared runs."""
    versions = meta.get("versions") or {}
    device = str(meta.get("device", "unknown"))
    autocast = meta.get("autocast") or ("float16" if meta.get("amp") else None)  # older states: amp (float16) only
    amp = "" if not autocast else f" + {autocast} autocast" + (" (GradScaler)" if autocast == "float16" else "")
    cuda = device.startswith("cuda")
    return {
        "python": versions.get("python", platform.python_version()), "torch": versions.get("torch", torch.__version__),
        "numpy": versions.get("numpy", numpy.__version__), "trainproof": trainproof.__version__,
        "code_version": meta.get("code_version"), "code_revision": code_revision(), "device": device,
        "threads": task.cpu_threads if device == "cpu" and task.cpu_threads else torch.get_num_threads(),
        "precision": str(task.dtype).removeprefix("torch.") + amp,
        "deterministic_algorithms": "warn_only" if cuda else True,
        "cublas_workspace_config": child_env().get("CUBLAS_WORKSPACE_CONFIG") if cuda else None,
    }


def tolerance_note(tol: Tolerance, device: str, diffs: dict[str, Diff]) -> dict[str, Any]:
    """The comparison's mode (``exact``: every difference 0; ``tolerance``; ``given``), its tolerance, whether
    bitwise equality was expected and observed, and why."""
    bitwise = bool(diffs) and all(d.within and d.max_abs == 0.0 for d in diffs.values())
    why = tol.why
    if not why:
        if device.startswith("cuda"):
            why = ("CUDA with torch.use_deterministic_algorithms(True, warn_only=True) and CUBLAS_WORKSPACE_CONFIG="
                   ":4096:8: kernels without a deterministic implementation only warn, so the comparison may not be "
                   "bitwise; differences are reported and held to the tolerance")
        else:
            why = ("CPU, fixed thread count, deterministic algorithms: bitwise equality is expected; differences are "
                   "reported and held to the tolerance")
    return {"mode": tol.mode, "atol": tol.atol, "rtol": tol.rtol, "bitwise_expected": not device.startswith("cuda"),
            "bitwise_equal_observed": bitwise, "why": why}


def checks_json(diffs: dict[str, dict[str, Diff]], tol: Tolerance) -> dict[str, list[dict[str, Any]]]:
    """Every check of every compared path with its max |diff| and tolerance."""
    return {path: [d.to_json(name, tol) for name, d in checks.items()] for path, checks in diffs.items()}


def build_report(*, kind: str, vid: str, location: str, store: str, verdicts: dict[str, Any], failing: list[str],
                 settings: dict[str, Any], paths: dict[str, Any], diffs: dict[str, dict[str, Diff]], tol: Tolerance,
                 step_recovered: int | None, env: dict[str, Any], export: dict[str, Any] | None,
                 extra: dict[str, Any] | None = None, error: str | None = None) -> dict[str, Any]:
    """The verification.json document."""
    commands = [p["command"] for p in paths.values() if "command" in p]
    if export and export.get("reload_check", {}).get("command"):
        commands.append(export["reload_check"]["command"])
    compared = diffs.get("resume") or diffs.get("replay") or {}
    if error is not None:  # nothing was judged: no verdict is true or false (None), the verdict is INCOMPLETE
        verdicts = {k: None if isinstance(v, bool) else v for k, v in verdicts.items()}
        failing = []
        verdict = INCOMPLETE
    else:
        verdict = "PASSED" if verdicts.get("all_checks_passed") else "FAILED"
    return {
        "schema": REPORT_SCHEMA, "kind": kind, "id": vid, "location": location, "store": store,
        "verdict": verdict, "completed": error is None, "error": error, **verdicts, "failing_checks": failing,
        "step_recovered": step_recovered, "settings": settings,
        "tolerance": tolerance_note(tol, str(env.get("device", "cpu")), compared),
        "checks": checks_json(diffs, tol), "paths": paths, "commands": commands, "environment": env,
        "export": export, **(extra or {}),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def upload(root: GenerationStore, report: dict[str, Any], plot: bytes | None) -> None:
    """Write verification.json (and the plot) under the verification folder."""
    if plot is not None:
        root.write_file(PLOT_FILE, plot)
    root.write_file(REPORT_FILE, (json.dumps(_finite(report), indent=2, default=str) + "\n").encode())


def _finite(value: Any) -> Any:
    # JSON has no inf/NaN (json.dumps would write the invalid token Infinity): spell them as strings.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def print_summary(report: dict[str, Any], console: Console | None = None) -> None:
    """A short table (one row per check, one column per compared path), then the verdicts."""
    console = console or Console(width=120)
    if report.get("verdict") == INCOMPLETE:
        _print_incomplete(report, console)
        return
    checks = report["checks"]
    table = Table(title=f"trainproof verify ({report['kind']}) {report['id']}", caption=_compared(report))
    table.add_column("check")
    for path in checks:
        table.add_column(path, justify="right")
    names = list(dict.fromkeys(c["name"] for entries in checks.values() for c in entries))
    for name in names:
        cells = [_cell(next((c for c in entries if c["name"] == name), None), negative=path == "resume_without_rng")
                 for path, entries in checks.items()]
        table.add_row(name, *cells)
    console.print(table)
    keys = ["all_checks_passed", "positive", "negative_divergence_detected"]
    world = report.get("world_equivalence")
    if world:
        console.print(_world_table(world))
        keys += ["world_equivalence_passed", "world_negative_detected"]
    # Every check's verdicts (trainproof.proof.check: ``<check>_passed``, ``<check>_negative_detected``), as the report
    # has them; the four paths' other two (cut checkpoint, export) are in the table and the export line.
    keys += [k for k in report if k.endswith(("_passed", "_detected")) and k not in keys]
    _print_exercised(report, console)
    if report.get("cuts"):
        console.print(f"cuts resumed at: {report['cuts']['all']} (continuous path: {report['cuts']['steps']} steps)")
    if report.get("audit_span"):
        console.print(f"audit span: {report['audit_span']['summary']}")
    if (report.get("objective_equivalence") or {}).get("skipped") == "--no-objective-check":
        console.print("objective check: skipped (--no-objective-check); this verdict says nothing about the objective")
    _print_not_applicable(report, console)
    for key in keys:
        value = report.get(key)
        console.print(f"{key}: [{'green' if value else 'red'}]{str(value).lower()}[/]")
    tol = report.get("tolerance") or {}
    if tol.get("mode"):
        console.print("comparison: " + ("exact (every difference must be 0)" if tol["mode"] == "exact" else
                                        f"{tol['mode']}: atol {tol.get('atol'):g}, rtol {tol.get('rtol'):g}"))
    if report.get("failing_checks"):
        console.print(f"[red]failing checks: {', '.join(report['failing_checks'])}[/]")
    for item in report.get("not_exercised") or []:
        console.print(f"[yellow]not exercised: {item['what']} ({item['check']}): {item['hint']}[/]", soft_wrap=True)
    for item in report.get("findings") or []:  # neither a pass nor a failure: what the reader should know
        console.print(f"[yellow]finding: {escape(item['what'])}: {escape(item['finding'])}[/]", soft_wrap=True)
    for line in report.get("diagnosis") or []:  # what differs first, then the likely cause
        prefix = "" if ": first difference" in line else "likely cause: "
        console.print(f"[yellow]{prefix}{line}[/]", soft_wrap=True)
    if report.get("export"):
        console.print(f"export: {report['export']['location']}")
    console.print(f"report: {report['location']}/{REPORT_FILE}")


def _print_exercised(report: dict[str, Any], console: Console) -> None:
    """What must not matter, as varied: the worlds (trainproof.proof.world_change) and the data worker counts
    (trainproof.proof.workers) the processes ran with."""
    change = report.get("world_change") or {}
    if change.get("worlds"):
        moved = change.get("resumed_on_another_world")
        how = (f" (world_change: the {moved['from']}-rank cut at step {moved['at_step']} resumed on {moved['to']})"
               if moved else "")
        console.print(f"worlds exercised: {change['worlds']['exercised']}{how}", markup=False, highlight=False)
    workers = report.get("data_workers") or {}
    if workers.get("exercised"):
        console.print(f"data workers exercised: {workers['exercised']}", markup=False, highlight=False)


def _print_not_applicable(report: dict[str, Any], console: Console) -> None:
    """A line for each check that cannot apply to this task (trainproof.proof.check.NotApplicable), and for the
    objective check's declared-objective part when the task gives no per-target losses (trainproof.proof.objective)."""
    blocks = [(key, block) for key, block in report.items() if isinstance(block, dict)]
    declared = (report.get("objective_equivalence") or {}).get("declared_objective")
    if isinstance(declared, dict):
        blocks.append(("objective_equivalence.declared_objective", declared))
    for key, block in blocks:
        if isinstance(block.get("not_applicable"), str):
            console.print(f"{key}: not applicable: {block['not_applicable']}", soft_wrap=True, markup=False,
                          highlight=False)


def _print_incomplete(report: dict[str, Any], console: Console) -> None:
    """No table and no verdict lines: what stopped it (the failing path's last error lines) and what to try."""
    console.print(f"trainproof verify ({report['kind']}) {report['id']}: [bold red]INCOMPLETE[/] (the verification "
                  "could not complete: nothing was judged, no check passed or failed)")
    for line in str(report.get("error") or "").splitlines():
        console.print(f"  {line}", soft_wrap=True, markup=False, highlight=False)
    if report.get("what_to_try"):
        console.print(f"what to try: {report['what_to_try']}", soft_wrap=True, markup=False, highlight=False)
    console.print(f"report: {report['location']}/{REPORT_FILE}")


def _compared(report: dict[str, Any]) -> str | None:
    """An audit's table says which generations it compared (from -> to), a protocol's which steps."""
    settings = report.get("settings") or {}
    if report.get("kind") == "audit":
        gens = report.get("audited_generations") or {}
        a = (gens.get("from") or {}).get("generation") or f"step {settings.get('from')}"
        b = (gens.get("to") or {}).get("generation") or f"step {settings.get('to')}"
        return f"replayed {settings.get('run')}: {a} -> {b}, compared with the run's own {b}"
    if "steps" in settings and "cut" in settings:
        return f"{settings['steps']} steps, cut at {settings['cut']}; each path compared with continuous"
    return None


def _world_table(world: dict[str, Any]) -> Table:
    """World-size equivalence: max |diff| of W ranks and of the per-rank-mean control against one rank."""
    tol = world["tolerance"]["atol"]
    table = Table(title=f"world-size equivalence: {world['world']} ranks vs 1 rank, same global batch "
                        f"(float64, atol {tol:g}; {world['configuration']['task']}, deterministic config)")
    table.add_column("check")
    table.add_column(f"{world['world']} ranks", justify="right")
    table.add_column("per-rank mean (negative)", justify="right")
    ok, neg = world.get("max_abs_diff") or {}, world["negative_control"].get("max_abs_diff") or {}
    for name in dict.fromkeys([*ok, *neg]):
        a, b = ok.get(name), neg.get(name)
        cell_a = "-" if a is None else f"{a:.3g} " + ("[green]ok[/]" if a <= tol else "[red]FAIL[/]")
        cell_b = "-" if b is None else f"{b:.3g} " + ("[yellow]diverged[/]" if b > tol else "same")
        table.add_row(name, cell_a, cell_b)
    return table


def _cell(check: dict[str, Any] | None, *, negative: bool) -> str:
    if check is None:
        return "-"
    text = f"{check['max_abs_diff']:.3g}"
    if check.get("exercised") is False and check["within_tolerance"]:
        return f"{text} [dim]n/a[/]"  # compared, but the path never went through it (trainproof.proof.exercised)
    if check["problems"]:
        return f"[red]{text} broken[/]"
    if check["within_tolerance"]:
        return f"{text} [green]ok[/]" if not negative else f"{text} same"
    return f"[yellow]{text} diverged[/]" if negative else f"[red]{text} FAIL[/]"


# The continuous path wide and pale underneath, so a resumed path drawn on top of it stays visible.
_STYLE = {
    "continuous": {"color": "black", "linewidth": 5, "alpha": 0.25},
    "cut": {"color": "tab:blue", "marker": "s", "linestyle": "--"},
    "resume": {"color": "tab:green", "marker": "o"},
    "resume_without_rng": {"color": "tab:red", "marker": "x"},
}


def plot_png(losses: dict[str, list[float]], distances: dict[str, dict[int, float]], title: str) -> bytes | None:
    """Loss curves of every path and parameter distance to the continuous path; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: no %s (install matplotlib; the image and the test extra have it)",
                 PLOT_FILE)
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for path, values in sorted(losses.items(), key=lambda kv: list(_STYLE).index(kv[0])):
        top.plot(range(1, len(values) + 1), values, label=path, **_STYLE[path])
    top.set_ylabel("training loss")
    top.legend()
    for path, by_step in distances.items():
        steps = sorted(by_step)
        if steps:
            bottom.plot(steps, [by_step[s] for s in steps], label=path, **_STYLE[path])
    bottom.set_yscale("symlog", linthresh=1e-12)  # 0 (bitwise equal) stays on the axis
    bottom.set_ylabel("L2 distance of parameters\nto the continuous path")
    bottom.set_xlabel("optimizer step")
    bottom.legend()
    fig.suptitle(title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
