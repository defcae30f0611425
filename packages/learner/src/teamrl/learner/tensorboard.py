"""TensorBoard event files for the learner's scalars, written with ``tensorboardX``.

What users of verl and OpenRLHF look at. ``tensorboardX`` writes the TFRecord framing
(``[uint64 length][masked crc32c(length)][data][masked crc32c(data)]``) and the ``tensorflow.Event``
protobufs; this module only keeps the learner's call shape: one event per call holding every finite
number of a metrics row, flushed at once so a live TensorBoard (or ``teamrl show``) sees each step.

``read_records`` / ``read_scalars`` read a file back (CRCs checked with tensorboardX's CRC-32C, the
events decoded with its protobuf classes), for tests and for tools that want the numbers without
installing TensorBoard.
"""

from __future__ import annotations

import math
import os
import struct
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

from tensorboardX import SummaryWriter
from tensorboardX.crc32c import crc32c as _crc32c
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum TFRecord uses."""
    return _crc32c(data)


class EventWriter:
    """Appends scalar events to ``folder/events.out.tfevents.<time>.<host>.<pid>.<random>`` (flushed per call)."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        suffix = f".{os.getpid()}.{uuid.uuid4().hex[:8]}"  # names this writer's file among any others
        self._writer = SummaryWriter(str(folder), filename_suffix=suffix, flush_secs=3600)
        self._writer.flush()  # the file and its "brain.Event:2" first record exist from here on
        (self.path,) = folder.glob(f"events.out.tfevents.*{suffix}")

    def scalars(self, step: int, values: Mapping[str, float], wall_time: float | None = None) -> None:
        """One event holding every finite number in ``values`` at ``step``."""
        finite = {k: float(v) for k, v in values.items() if isinstance(v, int | float) and math.isfinite(v)}
        if finite:
            summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in finite.items()])
            when = time.time() if wall_time is None else wall_time
            self._writer.file_writer.add_summary(summary, step, when)
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# --- reading back -------------------------------------------------------------------------------


def read_records(path: str | Path) -> Iterator[bytes]:
    """The payload of every TFRecord in ``path``; ValueError on a checksum mismatch."""
    data = Path(path).read_bytes()
    i = 0
    while i < len(data):
        header = data[i : i + 8]
        (n,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[i + 8 : i + 12])
        if hcrc != masked_crc32c(header):
            raise ValueError(f"{path}: bad length checksum at byte {i}")
        body = data[i + 12 : i + 12 + n]
        (bcrc,) = struct.unpack("<I", data[i + 12 + n : i + 16 + n])
        if bcrc != masked_crc32c(body):
            raise ValueError(f"{path}: bad data checksum at byte {i}")
        yield body
        i += 16 + n


def read_scalars(path: str | Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in an event file, in file order."""
    out = []
    for rec in read_records(path):
        event = Event.FromString(rec)
        if event.HasField("summary"):
            out.extend((event.step, v.tag, v.simple_value) for v in event.summary.value)
    return out
