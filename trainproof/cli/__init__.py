"""The command-line face of trainproof: Typer commands that parse options, call, and map errors to exit codes.

Owns: option parsing (``TRAINPROOF_*`` variables included), one-line error messages, exit codes.
May import every other part of ``trainproof`` (it is the top of the dependency order); nothing
imports it except ``trainproof.__main__`` and the console script. Command bodies stay thin: the work is in
``trainproof.train`` (training), ``trainproof.proof`` (verify, audit, export checks) and ``trainproof.lifecycle``
(signals, spot notices, deadlines, planning).

One module per command group, each adding its commands to :data:`trainproof.cli.app.app`:
``train`` (train), ``store`` (ls, gc), ``verify`` (verify, export, reload-check), ``plan`` (plan),
``data`` (data pack, data verify), ``digest`` (digest), ``report`` (report).
"""

from __future__ import annotations

import importlib

from trainproof.cli.app import app

COMMAND_MODULES = tuple(f"trainproof.cli.{name}"
                        for name in ("store", "train", "verify", "plan", "data", "digest", "report"))


def _register() -> None:
    """Import every command module, so that each adds its commands to ``app`` (``--help`` lists them all)."""
    for name in COMMAND_MODULES:
        importlib.import_module(name)


def main() -> None:
    """Console-script entry point."""
    _register()
    app()
