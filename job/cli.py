"""The ``trainproof`` command line (Typer). Command bodies live in ``job/cmd_*.py`` and stay thin."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="trainproof",
    help="Preemption-proof PyTorch training with verifiable exact resume.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # locals can hold credentials
    add_completion=False,
)


def _register() -> None:
    # Each module adds its commands to `app`; imported here so `trainproof --help` lists them all.
    from job import cmd_store  # noqa: F401  (ls, gc)

    import importlib
    import importlib.util

    for name in ("job.cmd_train", "job.cmd_verify", "job.cmd_plan"):  # train, verify/export/audit, plan
        if importlib.util.find_spec(name) is not None:  # pragma: no branch
            importlib.import_module(name)


def main() -> None:
    """Console-script entry point."""
    _register()
    app()
