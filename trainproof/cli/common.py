"""Pieces every command shares: store options, one-line handled errors, the stderr console."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
from typing import Annotated, Any, Callable, Optional, get_args, get_type_hints

import typer

from trainproof.storage import StoreConfigError, StoreError, StoreOptions, open_store
from trainproof.storage.limits import safe

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_PREEMPTED = 0, 1, 2, 75

StoreArg = Annotated[str, typer.Option("--store", envvar="TRAINPROOF_STORE", show_envvar=True,
                                       help="Run location: s3://bucket/prefix/run, file:///path, a folder, or memory://name.")]
EndpointArg = Annotated[Optional[str], typer.Option("--endpoint-url", envvar="TRAINPROOF_ENDPOINT_URL",
                                                    help="S3 endpoint (MinIO, Ceph). Default: AWS_ENDPOINT_URL.")]
RegionArg = Annotated[Optional[str], typer.Option("--region", envvar="TRAINPROOF_REGION",
                                                  help="S3 region. Default: AWS_REGION / AWS_DEFAULT_REGION.")]
PathStyleArg = Annotated[Optional[bool], typer.Option("--path-style/--virtual-host-style",
                                                      help="S3 addressing. Default: path "
                                                           "style when an endpoint is set.")]


def options_from(*classes: Any) -> Callable[[Callable], Callable]:
    """Give a command one option per field of ``classes`` declared with help (``trainproof.train.config.setting``),
    after its first parameter: ``--FLAG``, the variable ``TRAINPROOF_FLAG``, the field's default and help. The
    command takes them, by field name, as ``**settings`` (:func:`pick` sorts them out)."""

    def add(fn: Callable) -> Callable:
        own = inspect.signature(fn, eval_str=True)
        params = [p.replace(kind=p.KEYWORD_ONLY) for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
        derived = [_option(f, get_type_hints(cls)[f.name]) for cls in classes for f in dataclasses.fields(cls)
                   if f.metadata.get("help")]
        fn.__signature__ = own.replace(parameters=[params[0], *derived, *params[1:]])  # type: ignore[attr-defined]
        return fn

    return add


def _option(f: dataclasses.Field, annotation: Any) -> inspect.Parameter:
    flag = f.metadata["flag"] or f.name
    name = flag.replace("_", "-")
    if str in get_args(annotation) and type(None) not in get_args(annotation):
        annotation = str  # a number or a word (``--checkpoint-every 50|auto``): the field's __post_init__ parses it
    option = typer.Option(f"--{name}/--no-{name}" if annotation is bool else f"--{name}",
                          envvar=f"TRAINPROOF_{flag.upper()}", show_envvar=True, help=f.metadata["help"])
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                             annotation=Annotated[annotation, option])


def pick(cls: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """The values of ``cls``'s fields, taken out of ``settings``."""
    return {f.name: settings.pop(f.name) for f in dataclasses.fields(cls) if f.name in settings}


class UsageError(Exception):
    """A usage, configuration or contract error: exit 2, retrying cannot help."""


def fail(message: str, code: int) -> typer.Exit:
    """Print one line to stderr and return the Exit to raise."""
    # One write for the whole line: ranks share stderr, and print() writes the text and the newline separately,
    # which lets another process's line land in between.
    sys.stderr.write(f"trainproof: error: {safe(' '.join(str(message).splitlines()), MAX_LINE)}\n")
    sys.stderr.flush()
    return typer.Exit(code)


def handled(fn: Callable) -> Callable:
    """Turn expected failures into one stderr line and the documented exit code (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (StoreConfigError, UsageError) as exc:
            raise fail(str(exc), EXIT_USAGE) from None
        except (StoreError, OSError) as exc:
            raise fail(str(exc) or type(exc).__name__, EXIT_FAILURE) from None  # the message, not the class

    return wrapper


MAX_LINE = 4000
"""Longest log or error line: a message built from stored text is cut there (``trainproof.storage.limits.safe``)."""


class SafeFormatter(logging.Formatter):
    """Every log line is one line of printable text, whatever storage put in its arguments: control characters
    (terminal escape codes, newlines) are escaped (``trainproof.storage.limits.safe``); a traceback's lines each
    likewise."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = safe(record.getMessage(), MAX_LINE)
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line += "\n" + "\n".join(safe(t, MAX_LINE) for t in record.exc_text.splitlines())
        return line


def setup_logging(verbose: bool = False) -> None:
    """Warnings (skipped generations, retries) go to stderr, one line each."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(SafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for noisy in ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def store_cli_args(endpoint_url: str | None, region: str | None, path_style: bool | None) -> list[str]:
    """The S3 options as given on the command line, to pass on to the processes a command starts."""
    args = [*(["--endpoint-url", endpoint_url] if endpoint_url else []), *(["--region", region] if region else [])]
    return args + ([] if path_style is None else ["--path-style" if path_style else "--virtual-host-style"])


def open_run(store: str, endpoint_url: str | None = None, region: str | None = None, path_style: bool | None = None):
    """Open the store named on the command line (StoreConfigError → exit 2 through ``handled``)."""
    return open_store(store, StoreOptions.from_env(endpoint_url=endpoint_url, region=region, path_style=path_style))
