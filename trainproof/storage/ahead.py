"""Fetching the newest complete generation ahead of the load that will ask for it.

A restarted trainer spends its first seconds importing torch, building its model and agreeing on its plan, and only
then asks the store for the newest usable generation. Its download (GBs) then runs alone, while the GPUs wait.
:class:`FetchAhead` starts that download when the store is opened, on a thread of its own, beside the set-up.

The load that asks uses what was fetched only when it reached the same generation with the same manifest, and wants
the same files into the same spool folder. Every fetched file was checked against that manifest's sizes and sha256s,
so these are the bytes the load would have read; its caller's content check then runs on them as on any load.
Otherwise (a generation committed or planted since, another manifest at that name, other files wanted) the fetch is
cancelled, its files are deleted, and the load reads as it would have. A fetch that failed is never reported: the
load reads again and meets the failure itself (a corrupt file is then skipped and quarantined by the usual path).
Nothing is written to the store, and nothing is decided from what the fetch found.

It fetches the newest complete generation of the contract its caller names (a trainer: the one its stored plan
names), never one of another contract planted beside the run. Its cost when not used: bandwidth until it is
cancelled, and a spool file until it is deleted: when the load reaches another generation, when its caller is done
loading without it (``GenerationStore.discard_ahead``), or at exit, where an unfinished download is given a few
seconds to stop and delete its partial file (:func:`wind_up`, which a process ending without exit hooks calls
first).
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import replace
from typing import Callable

from trainproof.storage.generations import COMPLETE, Ctx, GenerationInfo, Loaded, load, scan

log = logging.getLogger("trainproof.storage")

EXIT_WAIT_S = 5.0
"""At exit, how long an unfinished fetch is given to stop and delete its partial spool file."""

_FETCHES: list["FetchAhead"] = []
"""Every fetch this process started: at exit each is cancelled and given :data:`EXIT_WAIT_S` (:func:`wind_up`)."""
_FETCHES_LOCK = threading.Lock()


def wind_up() -> None:
    """For a process about to end: cancel every fetch ahead it started that was not taken, delete what they fetched,
    and give a download still running :data:`EXIT_WAIT_S` to stop and delete its partial file (a cancelled one may
    still be running: the cancel acts at its next ranged read). Run at exit; a process that ends with ``os._exit``
    (no exit hooks) calls it first."""
    with _FETCHES_LOCK:
        fetches = list(_FETCHES)
    for fetch in fetches:
        fetch.discard(wait=True)


def _track(fetch: "FetchAhead") -> None:
    with _FETCHES_LOCK:
        if not _FETCHES:
            atexit.register(wind_up)
        _FETCHES.append(fetch)


class FetchCancelled(Exception):
    """The fetch ahead was cancelled: its next ranged read stops it (its partial spool file is deleted)."""


class FetchAhead:
    """The newest complete generation of the contract ``contract()`` names (called on the fetch's thread; None:
    nothing to fetch), its files but those ``skip`` names loaded as :func:`trainproof.storage.generations.load` loads
    them (``spool_dir``, ``spool_from``), on a thread of its own from now on; :meth:`take` hands it to the load that
    reaches it, once."""

    def __init__(self, ctx: Ctx, *, contract: Callable[[], str | None], spool_dir: str | None,
                 spool_from: int | None, skip: Callable[[str], bool] | None) -> None:
        self._cancelled, self._scanned, self._lock = threading.Event(), threading.Event(), threading.Lock()
        self._ctx = replace(ctx, stop=self._go_on)
        self._contract, self._skip, self._spooling = contract, skip, (spool_dir, spool_from)
        self.info: GenerationInfo | None = None
        """The generation being fetched, once the fetch's scan found it."""
        self.names: list[str] | None = None
        self._loaded: Loaded | None = None
        self.error: BaseException | None = None
        """What the fetch raised (never raised to anyone: the load that asks reads again)."""
        self._thread = threading.Thread(target=self._run, name="trainproof-fetch-ahead", daemon=True)
        self._thread.start()
        _track(self)

    def _go_on(self) -> None:
        if self._cancelled.is_set():
            raise FetchCancelled("the generation fetched ahead is not the one asked for")

    def _run(self) -> None:
        try:
            contract = self._contract()
            found = [] if contract is None else [i for i in scan(self._ctx, contract=contract) if i.status == COMPLETE]
            if found and not self._cancelled.is_set():
                info = self.info = found[-1]
                self.names = files_to_read(info, self._skip)
                self._scanned.set()
                # One read a file: a mismatch is the resume's to judge, with reads of its own (a damaged state
                # of 100 GB is then read three times before it is quarantined, not four).
                loaded = load(self._ctx, info, None, self.names, spool_dir=self._spooling[0],
                              spool_from=self._spooling[1], attempts=1)
                with self._lock:
                    if self._cancelled.is_set():
                        loaded.close()
                    else:
                        self._loaded = loaded
        except BaseException as exc:  # noqa: BLE001 - the load that asks reads again and meets it itself
            self.error = exc
        finally:
            self._scanned.set()

    def take(self, info: GenerationInfo, names: list[str] | None, *, spool_dir: str | None,
             spool_from: int | None) -> Loaded | None:
        """What was fetched, when it is generation ``info`` (same name, same manifest) and these files into this
        spool folder: waits for its download to end. None otherwise (cancelled at once, its files deleted), or when
        the fetch failed. Once: any later call gets None. The fetch's scan began before the caller's, which found
        ``info``: it is waited for (bounded like every scan, by ``Limits.scan_seconds``)."""
        self._scanned.wait()
        if not (info.status == COMPLETE and self.info is not None and self.info.name == info.name
                and self.info.manifest == info.manifest and self.names == names
                and self._spooling == (spool_dir, spool_from)):
            self.discard()
            return None
        self._thread.join()
        with self._lock:
            loaded, self._loaded = self._loaded, None
            self._cancelled.set()  # taken: nothing more to hand out or delete
        if loaded is not None:
            log.info("%s was fetched ahead: loading it takes no download", info.name)
        return loaded

    def discard(self, *, wait: bool = False) -> None:
        """Cancel the fetch and delete what it fetched (nothing once taken). ``wait``: for a process about to end,
        give a download in progress :data:`EXIT_WAIT_S` to stop and delete its partial file."""
        self._cancelled.set()
        with self._lock:
            loaded, self._loaded = self._loaded, None
        if loaded is not None:
            try:
                loaded.close()
            except OSError as exc:
                log.warning("could not delete the files of %s fetched ahead: %s", loaded.info.name, exc)
        if wait:
            self._thread.join(EXIT_WAIT_S)  # a download in progress stops at its next read and deletes its file


def files_to_read(info: GenerationInfo, skip: Callable[[str], bool] | None) -> list[str] | None:
    """The files of ``info`` to read when ``skip`` leaves some out (None: every file)."""
    if skip is None or info.manifest is None:
        return None
    return [n for n in info.manifest["files"] if not skip(n)]
