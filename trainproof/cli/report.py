"""``trainproof report``: what a rental bought, from the run's own attempt records (trainproof.lifecycle.goodput)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trainproof.cli.app import app
from trainproof.cli.common import (
    EndpointArg,
    PathStyleArg,
    RegionArg,
    StoreArg,
    UsageError,
    handled,
    open_run,
    setup_logging,
)
from trainproof.lifecycle.goodput import read_report


@app.command("report")
@handled
def report_command(
    store: StoreArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")] = False,
    price_per_hour: Annotated[Optional[float], typer.Option(
        "--price-per-hour", min=0.0, help="What an hour of the machine costs: adds each bucket's cost.")] = None,
    on_demand_price: Annotated[Optional[float], typer.Option(
        "--on-demand-price", min=0.0, help="What an hour of the same machine costs on demand (with --price-per-hour): "
        "adds what the run saved, against the productive time at this price.")] = None,
    png: Annotated[Optional[Path], typer.Option(
        "--png", dir_okay=False, help="Also write a timeline of the attempts (commits, stops, kills, redone steps) and "
        "the buckets to this local PNG file (e.g. goodput.png; needs matplotlib).")] = None,
    endpoint_url: EndpointArg = None, region: RegionArg = None, path_style: PathStyleArg = None,
) -> None:
    """Goodput of a run: how much of the wall time since it started became kept training.

    Reads the attempt record each training process left under <run>/attempts/ (start, restore, steps, checkpoint
    stalls, how it ended) and splits the wall time into productive training and badput: start-up, restore,
    checkpoint stall, steps redone after a kill, gaps between attempts, the finish (final commit, export), and
    what no record covers. Works on a run in progress and after a crash (an attempt without an end shows as
    killed, up to its last record). With --price-per-hour each bucket's cost; with --on-demand-price too, what the
    run saved against the productive time on demand. --png FILE also draws the attempts on a timeline. Read-only
    towards the store.
    """
    setup_logging()
    if on_demand_price is not None and price_per_hour is None:
        raise UsageError("--on-demand-price compares with what the run paid: give --price-per-hour too")
    report = read_report(open_run(store, endpoint_url, region, path_style))
    doc = report.to_json(price_per_hour, on_demand_price)
    if png is not None:
        _write_png(png, report, doc, store)
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    console = Console()
    if not report.attempts:
        console.print(f"{escape(store)}: no attempt records yet (each training process leaves one under attempts/)")
    else:
        _print_tables(console, doc)
    for why in report.skipped:
        console.print(f"[yellow]skipped[/] {escape(why)}", highlight=False)


def _write_png(path: Path, report, doc: dict, store: str) -> None:
    from trainproof.lifecycle.goodput_plot import MatplotlibMissing, goodput_png

    try:
        data = goodput_png(report, doc, f"{store}: {len(report.attempts)} attempt(s)")
    except MatplotlibMissing as exc:
        raise UsageError(str(exc)) from None
    path.write_bytes(data)
    sys.stderr.write(f"wrote {path} ({len(data):,} bytes)\n")


def _print_tables(console: Console, doc: dict) -> None:
    attempts = Table(title="attempts (seconds)", title_justify="left")
    for col in ("started", "end", "from", "to", "redone", "commits", "startup", "restore", "train", "stall"):
        attempts.add_column(col, no_wrap=col == "started")
    for a in doc["attempts"]:
        end = a["end"] if not a["reason"] else f"{a['end']} ({a['reason']})"
        attempts.add_row(a["started"][5:19].replace("T", " "), escape(end), str(a["resumed_from"]), str(a["last_step"]),
                         str(a["redone_steps"]), str(a["commits"]), f"{a['startup_s']:.1f}", f"{a['restore_s']:.1f}",
                         f"{a['train_s']:.1f}", f"{a['checkpoint_stall_s']:.1f}")
    console.print(attempts)
    buckets = Table(title=f"wall {doc['wall_s']:.1f} s, goodput {doc['goodput']:.1%}" if doc["goodput"] is not None
                    else "wall 0 s", title_justify="left")
    buckets.add_column("bucket")
    buckets.add_column("seconds", justify="right")
    buckets.add_column("share", justify="right")
    if "cost" in doc:
        buckets.add_column("cost", justify="right")
    for name, b in doc["buckets"].items():
        row = [name.replace("_", " "), f"{b['seconds']:.1f}", f"{b['share']:.1%}" if b["share"] is not None else "-"]
        if "cost" in doc:
            row.append(f"{doc['cost'][name]:.2f}")
        buckets.add_row(*row)
    console.print(buckets)
    console.print(f"{doc['steps_kept']} steps kept, {doc['redone_steps']} redone, "
                  f"{doc['interruptions']} interruption(s)" + (f", {doc['cost']['total']:.2f} in all" if "cost" in doc
                                                               else ""))
    if "on_demand" in doc:
        od = doc["on_demand"]
        share = f" ({od['saved_share']:.1%})" if od["saved_share"] is not None else ""
        console.print(f"on demand at {od['price_per_hour']:g}/h, the productive time alone would cost "
                      f"{od['cost']:.2f}; this run paid {od['paid']:.2f}: saved {od['saved']:.2f}{share}")
