"""TensorBoard event files without TensorBoard: scalar summaries in the TFRecord format.

What users of verl and OpenRLHF look at, written with no extra dependency: an event file is a
sequence of records ``[uint64 length][uint32 masked crc32c(length)][data][uint32 masked crc32c(data)]``
(little-endian), each ``data`` a serialised ``tensorflow.Event`` protobuf. Only the fields scalars
need are written (field numbers from TensorFlow's ``event.proto`` / ``summary.proto``):

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

The first record carries ``file_version = "brain.Event:2"``, as TensorBoard expects. ``read_scalars``
reads such a file back (CRCs checked), for tests and for tools that want the numbers.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum TFRecord uses."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 two's complement, as protobuf encodes negatives
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(num: int, wire: int, payload: bytes) -> bytes:
    key = _varint((num << 3) | wire)
    if wire == 2:
        return key + _varint(len(payload)) + payload
    return key + payload


def _event(
    wall_time: float, step: int | None = None, *, file_version: str = "", summary: bytes = b""
) -> bytes:
    out = _field(1, 1, struct.pack("<d", wall_time))
    if step is not None:
        out += _field(2, 0, _varint(step))
    if file_version:
        out += _field(3, 2, file_version.encode())
    if summary:
        out += _field(5, 2, summary)
    return out


def _scalar_summary(values: Mapping[str, float]) -> bytes:
    out = b""
    for tag, v in values.items():
        value = _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", v))
        out += _field(1, 2, value)
    return out


class EventWriter:
    """Appends scalar events to ``folder/events.out.tfevents.<time>.<host>`` (flushed per call)."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self._f = self.path.open("ab")
        self._write(_event(time.time(), file_version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._f.write(header + struct.pack("<I", _masked(crc32c(header))) + data)
        self._f.write(struct.pack("<I", _masked(crc32c(data))))
        self._f.flush()

    def scalars(self, step: int, values: Mapping[str, float], wall_time: float | None = None) -> None:
        """One event holding every finite number in ``values`` at ``step``."""
        finite = {k: float(v) for k, v in values.items() if isinstance(v, int | float) and math.isfinite(v)}
        if finite:
            self._write(
                _event(time.time() if wall_time is None else wall_time, step, summary=_scalar_summary(finite))
            )

    def close(self) -> None:
        self._f.close()


# --- reading back -------------------------------------------------------------------------------


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, object]]:
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _read_varint(buf, i)
        elif wire == 1:
            v, i = buf[i : i + 8], i + 8
        elif wire == 5:
            v, i = buf[i : i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            v, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield num, wire, v


def read_records(path: str | Path) -> Iterator[bytes]:
    data = Path(path).read_bytes()
    i = 0
    while i < len(data):
        header = data[i : i + 8]
        (n,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[i + 8 : i + 12])
        if hcrc != _masked(crc32c(header)):
            raise ValueError(f"{path}: bad length checksum at byte {i}")
        body = data[i + 12 : i + 12 + n]
        (bcrc,) = struct.unpack("<I", data[i + 12 + n : i + 16 + n])
        if bcrc != _masked(crc32c(body)):
            raise ValueError(f"{path}: bad data checksum at byte {i}")
        yield body
        i += 16 + n


def read_scalars(path: str | Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in an event file, in file order."""
    out = []
    for rec in read_records(path):
        step = 0
        summaries = []
        for num, _wire, v in _fields(rec):
            if num == 2:
                step = int(v)  # type: ignore[arg-type]
            elif num == 5:
                summaries.append(v)
        for s in summaries:
            for _n, _w, value in _fields(s):  # type: ignore[arg-type]
                tag, val = "", math.nan
                for n2, _w2, x in _fields(value):  # type: ignore[arg-type]
                    if n2 == 1:
                        tag = bytes(x).decode()  # type: ignore[arg-type]
                    elif n2 == 2:
                        (val,) = struct.unpack("<f", x)  # type: ignore[arg-type]
                out.append((step, tag, val))
    return out
