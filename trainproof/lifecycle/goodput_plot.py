"""``trainproof report --png FILE``: the run's attempts on a timeline, and its wall time in buckets (needs matplotlib).

Top: one bar per attempt from its start to its end (or, without an end, its last record), coloured by how it ended,
its start-up and restore drawn lighter; a tick at each commit; a marker where it was stopped or killed; hatched, the
span of steps the next attempt trained again. The record holds the steps of its commits, not their times: a commit
(and the start of the redone span) is placed by its step within the attempt's training time (steps are assumed to
take equally long, checkpoint stalls spread over them). Bottom: the buckets of trainproof.lifecycle.goodput, stacked,
as shares of the wall time.
"""

from __future__ import annotations

import io
import logging
from typing import Any

from trainproof.lifecycle.goodput import BUCKETS, Attempt, Report

log = logging.getLogger("trainproof.lifecycle")

END_STYLE = {"done": ("tab:green", "done"), "stopped": ("tab:orange", "stopped (signal, notice, deadline)"),
             None: ("tab:red", "killed (no end recorded)")}
LAST_UNENDED = ("tab:gray", "no end recorded yet (running, or killed)")
BUCKET_COLORS = dict(zip(BUCKETS, ("tab:green", "tab:purple", "tab:blue", "tab:orange", "gold", "tab:red",
                                   "tab:gray", "tab:cyan", "lightgray"), strict=True))


class MatplotlibMissing(RuntimeError):
    """matplotlib is not installed."""


def goodput_png(report: Report, summary: dict[str, Any], title: str) -> bytes:
    """The PNG (see the module); ``summary``: the report's figures (trainproof.lifecycle.goodput.summary).
    Raises MatplotlibMissing without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display in a container or a test
        import matplotlib.pyplot as plt
    except ImportError:
        raise MatplotlibMissing("--png needs matplotlib (pip install matplotlib; the image and the test extra have "
                                "it)") from None
    attempts = report.attempts
    rows = min(max(len(attempts), 2), 40)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 2.6 + 0.3 * rows), gridspec_kw={"height_ratios": [rows, 1]})
    scale, unit = _unit(summary.get("wall_s") or 0.0)
    if attempts:
        _timeline(top, attempts, report.redone(), attempts[0].started, scale)
    top.set_xlabel(f"{unit} since the run's first start")
    top.set_title(title)
    _buckets(bottom, summary)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None}, bbox_inches="tight")  # the legends too
    plt.close(fig)
    return buf.getvalue()


def _unit(wall_s: float) -> tuple[float, str]:
    return (1.0, "seconds") if wall_s < 600 else (60.0, "minutes") if wall_s < 36_000 else (3600.0, "hours")


def at_step(a: Attempt, step: int) -> float:
    """When ``a`` reached ``step`` (seconds since the epoch), placed by step within its training time."""
    begin = min(a.started + a.startup_s + a.restore_s, a.stop)
    if not a.steps:
        return begin
    share = min(max((step - a.resumed_from) / a.steps, 0.0), 1.0)
    return min(begin + share * (a.train_s + a.blocked_s), a.stop)


def _timeline(ax: Any, attempts: list[Attempt], redone: list[int], t0: float, scale: float) -> None:
    shown: dict[str, Any] = {}
    for y, (a, again) in enumerate(zip(attempts, redone)):
        last = y == len(attempts) - 1
        _bar(ax, y, a, again, t0, scale, shown, last)
        _marks(ax, y, a, t0, scale, shown, last)
    ax.set_yticks(range(len(attempts)), [f"#{i + 1} from {a.resumed_from if a.restored else '?'}"
                                         for i, a in enumerate(attempts)])
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(handles=list(shown.values()), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _bar(ax: Any, y: int, a: Attempt, again: int, t0: float, scale: float, shown: dict[str, Any], last: bool) -> None:
    """The attempt from start to end, its start-up and restore lighter, its redone steps hatched."""
    from matplotlib.patches import Patch

    color, label = LAST_UNENDED if last and a.end is None else END_STYLE[a.end]
    left = (a.started - t0) / scale
    ax.barh(y, (a.stop - a.started) / scale, left=left, height=0.6, color=color, alpha=0.85)
    ax.plot([left], [y], linestyle="none", marker="o", markersize=5, color=color)  # seen even when it lasted no time
    shown.setdefault(label, Patch(color=color, label=label))
    ax.barh(y, (at_step(a, a.resumed_from) - a.started) / scale, left=left, height=0.6, color="white", alpha=0.5)
    shown.setdefault("startup", Patch(facecolor="white", edgecolor="gray", label="lighter: start-up and restore"))
    if again:
        start = at_step(a, (a.last_step or a.resumed_from) - again)
        ax.barh(y, (a.stop - start) / scale, left=(start - t0) / scale, height=0.6, fill=False, hatch="///",
                edgecolor="black", linewidth=0)
        shown.setdefault("redone", Patch(fill=False, hatch="///", label="steps trained again"))


def _marks(ax: Any, y: int, a: Attempt, t0: float, scale: float, shown: dict[str, Any], last: bool) -> None:
    """A tick at each commit; a marker where the attempt was stopped or (not the last one) killed."""
    from matplotlib.lines import Line2D

    ticks = [(at_step(a, s) - t0) / scale for s in a.commit_steps]
    if ticks:
        ax.plot(ticks, [y] * len(ticks), linestyle="none", marker="|", markersize=16, color="black")
        shown.setdefault("commit", Line2D([], [], linestyle="none", marker="|", markersize=12, color="black",
                                          label="commit"))
    if a.end == "stopped" or (a.end is None and not last):
        marker, label = ("v", "stopped here") if a.end == "stopped" else ("X", "killed here")
        ax.plot([(a.stop - t0) / scale], [y - 0.42], linestyle="none", marker=marker, markersize=9, color="black")
        shown.setdefault(label, Line2D([], [], linestyle="none", marker=marker, color="black", label=label))


def _buckets(ax: Any, summary: dict[str, Any]) -> None:
    left = 0.0
    for name in BUCKETS:
        share = (summary.get("buckets", {}).get(name) or {}).get("share") or 0.0
        ax.barh(0, share, left=left, height=0.6, color=BUCKET_COLORS[name],
                label=f"{name.replace('_', ' ')} {share:.1%}")
        left += share
    goodput = summary.get("goodput")
    ax.set_xlim(0, 1)
    ax.set_yticks([])
    ax.set_title("share of the wall time" + (f" (goodput {goodput:.1%})" if goodput is not None else ""), fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.4), fontsize=8, frameon=False, ncol=4)
