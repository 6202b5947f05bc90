"""The one Typer application every command module adds its command to (nothing else lives here)."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="trainproof",
    help="Preemption-proof PyTorch training with verifiable exact resume.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # locals can hold credentials
    add_completion=False,
    rich_markup_mode=None,  # click's plain help: option names whole at any width (rich's table cut 36 at 80)
)
