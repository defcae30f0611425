"""The replay buffer's persistence: Arrow IPC segment files of admitted trajectories plus JSON
checkpoints that count only once their ``DONE`` marker exists (``teamrl.learner.buffer``'s module
docstring, "Persistence"; docs/reliability.md R-kill-buffer).
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from teamrl.learner.buffer_errors import CorruptStore
from teamrl.protocol import schema as S
from teamrl.protocol.codec import TrajectoryRow, decode_batches, rows_record_batch
from teamrl.protocol.errors import ProtocolError

log = logging.getLogger("teamrl.learner.buffer")  # the buffer's log, whichever module writes


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class _Segment:
    name: str
    first_key: int
    rows: int = 0


class SegmentStore:
    """Arrow IPC segment files plus checkpoints with a DONE marker, under one folder.

    Layout: ``segments/seg-NNNNNNNN.arrow`` (Arrow IPC *stream* of ``TRAJECTORY_SCHEMA``, one
    record batch per ``append``, rows in key order, contiguous from the segment's ``first_key``)
    and ``checkpoints/ckpt-NNNNNNNN/{state.json, DONE}``. Call sequence::

        store = SegmentStore(folder, fsync=True, keep_checkpoints=2)
        state, trajs = store.load()              # (None, {}) for a fresh folder
        if state: buf.load_state_dict(state, trajs, now)
        store.append(res.accepted)               # durable when it returns (written + fsync)
        store.checkpoint(buf.state_dict(now), buf.keys())   # complete when it returns
        store.close()

    A checkpoint lists the segments (and how many of their rows) it needs; only those rows are
    ever read back, so a torn tail written after it is harmless. After a restart appends go to a
    new segment. Segments no kept checkpoint needs are deleted.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        fsync: bool = True,
        keep_checkpoints: int = 2,
        segment_bytes: int = 64 << 20,
    ) -> None:
        self.folder = Path(folder)
        self.fsync = fsync
        self.keep_checkpoints = keep_checkpoints
        self.segment_bytes = segment_bytes
        self._seg_dir = self.folder / "segments"
        self._ckpt_dir = self.folder / "checkpoints"
        self._seg_dir.mkdir(parents=True, exist_ok=True)
        self._ckpt_dir.mkdir(parents=True, exist_ok=True)
        self._segments: list[_Segment] = []  # needed by the state in memory, oldest first
        self._needs: dict[int, set[str]] = {}  # complete checkpoint number -> segment names it needs
        self._file: Any = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._next_segment = 1 + max((self._number(p) for p in self._seg_dir.glob("seg-*.arrow")), default=0)
        self._next_ckpt = 1 + max((self._number(p) for p in self._ckpt_dir.glob("ckpt-*")), default=0)
        self.checkpoints_written = 0

    @staticmethod
    def _number(p: Path) -> int:
        try:
            return int(p.name.split("-", 1)[1].split(".", 1)[0])
        except (IndexError, ValueError):
            return 0

    def _complete(self) -> list[Path]:
        """Complete checkpoint folders, newest first."""
        found = [p for p in self._ckpt_dir.glob("ckpt-*") if (p / "DONE").is_file()]
        return sorted(found, key=self._number, reverse=True)

    # --- load ---------------------------------------------------------------------------------

    def load(self) -> tuple[dict[str, Any] | None, dict[int, TrajectoryRow]]:
        """The newest complete checkpoint's buffer state and the trajectories it holds."""
        for ckpt in self._complete():
            try:
                doc = json.loads((ckpt / "state.json").read_text())
            except (OSError, ValueError) as e:
                log.error("checkpoint %s has DONE but unreadable state (%s); trying an older one", ckpt, e)
                continue
            self._segments = [
                _Segment(s["name"], int(s["first_key"]), int(s["rows"])) for s in doc["segments"]
            ]
            self._needs[self._number(ckpt)] = {s.name for s in self._segments}
            wanted = set(doc["keys"])
            trajs: dict[int, TrajectoryRow] = {}
            for seg in self._segments:
                if any(seg.first_key <= k < seg.first_key + seg.rows for k in wanted):
                    trajs.update(self._read(seg, wanted))
            log.info("loaded checkpoint %s: %d trajectories", ckpt.name, len(trajs))
            return doc["buffer"], trajs
        return None, {}

    def _read(self, seg: _Segment, wanted: set[int]) -> dict[int, TrajectoryRow]:
        path = self._seg_dir / seg.name
        out: dict[int, TrajectoryRow] = {}
        key = seg.first_key
        try:
            reader = pa.ipc.MessageReader.open_stream(pa.memory_map(str(path)))
            head = reader.read_next_message().serialize().to_pybytes()
            while key < seg.first_key + seg.rows:
                msg = reader.read_next_message()
                # Each batch is re-framed as a one-batch stream so it goes through the validating
                # decoder: bytes on disk after a crash are as foreign as bytes off the wire.
                for batch in decode_batches(head + msg.serialize().to_pybytes()):
                    for row in batch.rows():
                        if key in wanted:
                            out[key] = row
                        key += 1
        except (OSError, StopIteration, pa.ArrowException, ProtocolError) as e:
            raise CorruptStore(
                f"segment {path}: cannot read row {key - seg.first_key} of {seg.rows}: {e}"
            ) from e
        return out

    # --- write --------------------------------------------------------------------------------

    def _open_segment(self, first_key: int) -> None:
        self._close_segment()
        name = f"seg-{self._next_segment:08d}.arrow"
        self._next_segment += 1
        self._file = open(self._seg_dir / name, "wb")  # noqa: SIM115 -- lives until rotation/close
        self._writer = pa.ipc.new_stream(self._file, S.TRAJECTORY_SCHEMA)
        self._sync()
        if self.fsync:
            _fsync_dir(self._seg_dir)
        self._segments.append(_Segment(name, first_key))

    def _close_segment(self) -> None:
        if self._writer is not None:
            self._writer.close()  # writes the end-of-stream marker
            self._sync()
            self._file.close()
            self._writer = self._file = None

    def _sync(self) -> None:
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def append(self, accepted: list[tuple[int, TrajectoryRow]]) -> None:
        """Append (key, row) pairs, keys increasing; durable when this returns. A whole decoded
        frame is written as the record batch it arrived in (no re-encoding)."""
        if not accepted:
            return
        first = accepted[0][0]
        seg = self._segments[-1] if self._segments and self._writer is not None else None
        if (
            seg is None
            or seg.first_key + seg.rows != first
            or self._file.tell() >= self.segment_bytes
            or any(k != first + i for i, (k, _) in enumerate(accepted))
        ):
            if any(k != first + i for i, (k, _) in enumerate(accepted)):
                raise ValueError("append needs consecutive keys")
            self._open_segment(first)
            seg = self._segments[-1]
        assert self._writer is not None
        self._writer.write_batch(rows_record_batch([r for _, r in accepted]))
        self._sync()
        seg.rows += len(accepted)

    def checkpoint(self, buffer_state: dict[str, Any], keys: list[int]) -> Path:
        """Write a complete checkpoint of ``buffer_state`` (``keys``: sorted keys it holds), then
        delete what no kept checkpoint needs. The checkpoint counts once this returns."""
        current = self._segments[-1].name if self._writer is not None else None
        needed = []
        for seg in self._segments:
            i = bisect.bisect_left(keys, seg.first_key)
            if seg.name == current or (i < len(keys) and keys[i] < seg.first_key + seg.rows):
                needed.append(seg)
        self._segments = needed
        n = self._next_ckpt
        self._next_ckpt += 1
        folder = self._ckpt_dir / f"ckpt-{n:08d}"
        folder.mkdir()
        doc = {
            "buffer": buffer_state,
            "keys": keys,
            "segments": [{"name": s.name, "first_key": s.first_key, "rows": s.rows} for s in needed],
        }
        self._write(folder / "state.json", json.dumps(doc, separators=(",", ":")).encode())
        self._write(folder / "DONE", b"ok\n")
        if self.fsync:
            _fsync_dir(folder)
            _fsync_dir(self._ckpt_dir)
        self._needs[n] = {s.name for s in needed}
        self.checkpoints_written += 1
        self._collect_garbage(n)
        return folder

    def _write(self, path: Path, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    def _collect_garbage(self, newest: int) -> None:
        complete = [self._number(p) for p in self._complete()]
        keep = set(complete[: self.keep_checkpoints])
        for p in self._ckpt_dir.glob("ckpt-*"):
            num = self._number(p)
            if num in keep or num > newest:
                continue
            (p / "DONE").unlink(missing_ok=True)  # first: a half-deleted checkpoint is incomplete
            shutil.rmtree(p, ignore_errors=True)
            self._needs.pop(num, None)
        needed: set[str] = set()
        for k in keep:
            if k not in self._needs:  # an older checkpoint this process did not load or write
                doc = json.loads((self._ckpt_dir / f"ckpt-{k:08d}" / "state.json").read_text())
                self._needs[k] = {s["name"] for s in doc["segments"]}
            needed |= self._needs[k]
        if self._writer is not None:
            needed.add(self._segments[-1].name)
        for p in self._seg_dir.glob("seg-*.arrow"):
            if p.name not in needed:
                p.unlink(missing_ok=True)

    def close(self) -> None:
        self._close_segment()
