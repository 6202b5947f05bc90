"""Live training curves for TensorBoard: every step's loss, learning rate and throughput as event files.

``tensorboard --logdir DIR`` reads them while the run trains (each step is flushed). The files are written here,
without TensorFlow or the ``tensorboard`` package: an event file is a sequence of TFRecords (length, masked CRC-32C
of the length, the record, masked CRC-32C of the record), each record one serialized ``tensorflow.Event``
protobuf; a scalar is an ``Event`` with ``step``, ``wall_time`` and a ``Summary`` of ``(tag, simple_value)``.

Each process writes its own file (the name holds the time, host and pid, as TensorBoard's writers do), so a
resumed run adds a file and never rewrites one; steps trained again after a preemption appear in both files, and
TensorBoard draws the newest points over the older ones.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any

from trainproof.train.progress import Reporter

SCALARS = ("loss", "lr", "grad_norm", "steps_per_s", "samples_per_s", "targets_per_s")
"""The per-step values written (those a step's record has), under ``train/<name>``."""


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord framing uses it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(*, wall_time: float, step: int | None = None, scalars: dict[str, float] | None = None,
          file_version: str | None = None) -> bytes:
    """One serialized ``tensorflow.Event``."""
    out = b"\x09" + struct.pack("<d", wall_time)  # field 1, 64-bit
    if step is not None:
        out += b"\x10" + _varint(step)  # field 2, varint
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:
        values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
                          for tag, value in scalars.items())  # Summary.value: Value{tag=1, simple_value=2}
        out += _field(5, values)
    return out


def record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + _masked(length) + data + _masked(data)


class EventFile:
    """One event file in ``folder``, appended to and flushed a step at a time."""

    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.trainproof"
        self.path = os.path.join(folder, name)
        self._file = open(self.path, "ab")
        self._write(event(wall_time=time.time(), file_version="brain.Event:2"))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._write(event(wall_time=time.time(), step=step, scalars=values))

    def _write(self, data: bytes) -> None:
        self._file.write(record(data))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardReporter(Reporter):
    """Another reporter's steps and events, each logged step also written to an event file."""

    def __init__(self, inner: Reporter, folder: str) -> None:
        super().__init__(log_every=inner.log_every)
        self.inner = inner
        self.file: EventFile | None = EventFile(folder)

    def begin(self, *, step: int, target: int) -> None:
        self.inner.begin(step=step, target=target)

    def step(self, record: dict[str, Any], *, target: int) -> None:
        self.inner.step(record, target=target)
        if self.file is None:
            return
        values = {**record, **self.inner.throughput()}
        try:
            self.file.scalars(record["step"], {f"train/{k}": float(values[k]) for k in SCALARS
                                               if isinstance(values.get(k), (int, float))})
        except OSError as exc:  # a full disk: warn once, train on
            self.inner.warn(f"TensorBoard event files stop at step {record['step']}: {exc.strerror or exc}")
            self.file = None

    def throughput(self) -> dict[str, float]:
        return self.inner.throughput()

    def event(self, name: str, **fields: Any) -> None:
        self.inner.event(name, **fields)

    def warn(self, message: str) -> None:
        self.inner.warn(message)

    def close(self) -> None:
        self.inner.close()
        if self.file is not None:
            self.file.close()


def with_tensorboard(reporter: Reporter, setting: str, run_folder: str | None) -> Reporter:
    """``reporter``, also writing event files where ``setting`` says (``--tensorboard``): ``auto`` beside the run
    when it is a folder of this machine (``run_folder``), ``off``, or a folder."""
    if setting == "off" or (setting == "auto" and run_folder is None):
        return reporter
    folder = os.path.join(run_folder, "tensorboard") if setting == "auto" and run_folder else setting
    try:
        return TensorBoardReporter(reporter, folder)
    except OSError as exc:  # curves are a convenience: never a reason not to train
        reporter.warn(f"no TensorBoard event files: {folder} cannot be written ({exc.strerror or exc})")
        return reporter

