"""GraphTrajectory lists <-> Arrow IPC stream bytes, validating every decode of foreign bytes.

Encoding (see ``schema.py`` for the layout): each column is gathered in one pass over the steps
(``map(attrgetter)``, no per-step dicts); token columns are built from flat numpy buffers and
int32 offsets with ``pa.ListArray.from_arrays`` -- one ``np.concatenate`` per column, never a
Python list of ints -- and the IPC stream is written once into a pre-sized buffer (its size is
measured first with a ``MockOutputStream``, so there is no grow-and-copy). Use
``encode_trajectories_buffer`` to get that ``pa.Buffer`` without the final copy into ``bytes``
(zmq sends it zero-copy). Encode runs the same field checks as decode, so a producer learns of a
bad trajectory at its source rather than from a negative ack.

Decoding treats the bytes as hostile, in this order, each failure a typed ``ProtocolError``
(counted in ``teamrl_protocol_rejected_frames_total{reason}``):

1. size cap (``FrameTooLarge``);
2. IPC framing, message by message: the first must be the schema, equal to
   ``TRAJECTORY_SCHEMA`` with our ``SCHEMA_VERSION`` (``SchemaMismatch``); dictionary batches and
   *compressed* record batches are refused before their body is touched -- we never compress, and
   a compressed body is how a 30 kB frame would make us allocate gigabytes (compression bomb);
3. ``RecordBatch.validate(full=True)`` (``DecodeError``): without it, reading values out of a
   mutated stream segfaults within a few dozen inputs (measured, RELIABILITY.md);
4. field checks, vectorised over whole columns -- one numpy reduction per column of the batch,
   no per-trajectory or per-step Python (``SchemaMismatch`` / ``FrameTooLarge``): no nulls, tight
   offsets, len(response_ids) == len(logprobs), parents point strictly backwards within their own
   trajectory, versions/turns/seq non-negative, token ids non-negative, rewards and log-probs
   finite (log-probs also <= 0), finish_reason known, metadata keys unique per trajectory,
   per-step/per-frame caps.

The whole frame is checked before any object is built. ``decode_record_batches`` stops there
and returns the validated batches (for a consumer that keeps Arrow); ``decode_trajectories``
goes on to build objects.

Objects are then built column-wise: ``AgentStep`` positionally by ``map`` over the columns (its
fields are declared in ``STEP_TYPE`` order; checked at import), strings by ``to_pylist``.
Decoded token arrays are **read-only zero-copy numpy views** into the frame's memory (the
Arrow buffers keep it alive); copy them before writing.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from operator import attrgetter

import numpy as np
import pyarrow as pa

from teamrl.protocol import schema as S
from teamrl.protocol.errors import DecodeError, FrameTooLarge, ProtocolError, SchemaMismatch
from teamrl.protocol.metrics import count_rejection
from teamrl.protocol.trajectory import AgentStep, GraphTrajectory, ToolCall

_INT32_MAX = np.iinfo(np.int32).max
_STEP_FIELDS = tuple(S.STEP_TYPE.names)
_STEP_FIELD_LIST = list(S.STEP_TYPE)
_TOOL_FIELD_LIST = list(S.TOOL_CALL_TYPE)
_TOKEN_DTYPES = {
    "parents": np.int32,
    "prompt_ids": np.int32,
    "response_ids": np.int32,
    "logprobs": np.float32,
}
_FINISH_REASONS = frozenset(S.FINISH_REASONS)
_STEP_GETTER = attrgetter(*_STEP_FIELDS)
# Explicit options: the default ones are rebuilt from two environment variables on every writer.
_WRITE_OPTIONS = pa.ipc.IpcWriteOptions()

# Decode builds AgentStep(*columns) in STEP_TYPE order: the two declarations must agree.
assert tuple(f.name for f in dataclasses.fields(AgentStep)) == _STEP_FIELDS, "AgentStep and STEP_TYPE differ"


# --------------------------------------------------------------------------------------------
# encode


def _offsets(lengths: np.ndarray) -> pa.Array:
    """int32 Arrow offsets [n + 1] from int64 lengths [n]; refuses what int32 cannot address."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    if out[-1] > _INT32_MAX:
        raise FrameTooLarge(f"a list column holds {out[-1]} values, over the int32 offset range")
    return pa.array(out.astype(np.int32))


def _lengths(items: Sequence) -> np.ndarray:
    return np.fromiter(map(len, items), dtype=np.int64, count=len(items))


def _flat_list(arrays: Sequence[np.ndarray], dtype: type, list_type: pa.DataType) -> pa.ListArray:
    """One list<dtype> column from per-row arrays: one concatenate (a memcpy) plus offsets.

    The values are concatenated straight into a buffer from Arrow's memory pool, which recycles
    its pages: a fresh numpy array of a megabyte page-faults on every page (measured: 3x slower).
    The cast is numpy's ``unsafe`` one, as ``astype`` would do (Python lists become int64/float64).
    """
    lengths = _lengths(arrays)
    offsets = _offsets(lengths)
    n = int(lengths.sum())
    buf = pa.allocate_buffer(n * np.dtype(dtype).itemsize)
    if n:
        np.concatenate(arrays, out=np.frombuffer(buf, dtype), casting="unsafe")
    values = pa.Array.from_buffers(list_type.value_type, n, [None, buf])
    return pa.ListArray.from_arrays(offsets, values, type=list_type)


def to_record_batch(trajectories: Sequence[GraphTrajectory]) -> pa.RecordBatch:
    """Build the Arrow record batch (one row per trajectory) and run the same field checks as decode."""
    steps = [s for t in trajectories for s in t.steps]
    # One C-level getter per step, then a transpose: faster than a pass per field (measured).
    columns = list(zip(*map(_STEP_GETTER, steps), strict=True)) or [()] * len(_STEP_FIELDS)
    children = []
    for f, values in zip(_STEP_FIELD_LIST, columns, strict=True):
        if f.name in _TOKEN_DTYPES:
            children.append(_flat_list(values, _TOKEN_DTYPES[f.name], f.type))
        elif f.name == "tool_calls":
            calls = [c for per_step in values for c in per_step]
            tool_struct = pa.StructArray.from_arrays(
                [pa.array(list(map(attrgetter(t.name), calls)), t.type) for t in _TOOL_FIELD_LIST],
                fields=_TOOL_FIELD_LIST,
            )
            children.append(pa.ListArray.from_arrays(_offsets(_lengths(values)), tool_struct, type=f.type))
        else:
            children.append(pa.array(values, f.type))
    step_struct = pa.StructArray.from_arrays(children, fields=_STEP_FIELD_LIST)
    sch = S.TRAJECTORY_SCHEMA

    def top(name: str) -> pa.Array:
        return pa.array(list(map(attrgetter(name), trajectories)), sch.field(name).type)

    metas = [t.metadata for t in trajectories]
    batch = pa.RecordBatch.from_arrays(
        [
            top("episode_id"),
            top("incarnation"),
            top("seq"),
            top("task_id"),
            top("group_id"),
            top("workflow"),
            top("reward"),
            _flat_list([t.turn_rewards for t in trajectories], np.float32, sch.field("turn_rewards").type),
            pa.MapArray.from_arrays(
                _offsets(_lengths(metas)),
                pa.array([k for m in metas for k in m], pa.string()),
                pa.array([v for m in metas for v in m.values()], pa.string()),
                type=sch.field("metadata").type,
            ),
            pa.ListArray.from_arrays(
                _offsets(np.fromiter((len(t.steps) for t in trajectories), np.int64, len(trajectories))),
                step_struct,
                type=sch.field("steps").type,
            ),
        ],
        schema=sch,
    )
    _check_fields(_Columns(batch))
    return batch


def encode_trajectories_buffer(trajectories: Sequence[GraphTrajectory]) -> pa.Buffer:
    """Encode to one Arrow IPC stream in a ``pa.Buffer`` (supports the buffer protocol, no extra copy)."""
    batch = to_record_batch(trajectories)
    mock = pa.MockOutputStream()
    with pa.ipc.new_stream(mock, S.TRAJECTORY_SCHEMA, options=_WRITE_OPTIONS) as w:
        w.write_batch(batch)
    buf = pa.allocate_buffer(mock.size())
    with pa.ipc.new_stream(pa.FixedSizeBufferWriter(buf), S.TRAJECTORY_SCHEMA, options=_WRITE_OPTIONS) as w:
        w.write_batch(batch)
    if buf.size > S.MAX_FRAME_BYTES:
        raise FrameTooLarge(f"encoded frame is {buf.size} bytes, cap is {S.MAX_FRAME_BYTES}")
    return buf


def encode_trajectories(trajectories: Sequence[GraphTrajectory]) -> bytes:
    """Encode a batch of trajectories to Arrow IPC stream bytes (schema + one record batch)."""
    return encode_trajectories_buffer(trajectories).to_pybytes()


# --------------------------------------------------------------------------------------------
# decode


def _u32(b: memoryview, pos: int) -> int:
    if pos < 0 or pos + 4 > len(b):
        raise DecodeError(f"IPC metadata offset {pos} out of bounds ({len(b)} bytes)")
    return struct.unpack_from("<I", b, pos)[0]


def _field_pos(b: memoryview, table: int, field_id: int) -> int:
    """Absolute position of a flatbuffer table field, or 0 when absent (minimal reader)."""
    vtable = table - struct.unpack_from("<i", b, table)[0] if 0 <= table <= len(b) - 4 else -1
    if vtable < 0 or vtable + 4 > len(b):
        raise DecodeError("IPC metadata vtable out of bounds")
    vt_size = struct.unpack_from("<H", b, vtable)[0]
    slot = 4 + 2 * field_id
    if slot + 2 > vt_size or vtable + slot + 2 > len(b):
        return 0
    off = struct.unpack_from("<H", b, vtable + slot)[0]
    return table + off if off else 0


def _record_batch_is_compressed(metadata: pa.Buffer) -> bool:
    """True when the Message's RecordBatch header has a ``compression`` field (Message.fbs).

    Message: field 2 = header (union value, RecordBatch here); RecordBatch: field 3 = compression.
    pyarrow exposes no accessor for it, and we must know before the body is decompressed.
    """
    b = memoryview(metadata)
    root = _u32(b, 0)
    header = _field_pos(b, root, 2)
    if not header:
        raise DecodeError("record batch message without a header")
    rb = header + _u32(b, header)
    return bool(_field_pos(b, rb, 3))


def _iter_batches(buf: pa.Buffer) -> list[pa.RecordBatch]:
    try:
        reader = pa.ipc.MessageReader.open_stream(buf)
        first = reader.read_next_message()
    except (pa.ArrowInvalid, pa.ArrowException, StopIteration, OSError) as e:
        raise DecodeError(f"not an Arrow IPC stream: {e}") from e
    if first.type != "schema":
        raise DecodeError(f"IPC stream starts with a {first.type!r} message, expected the schema")
    try:
        schema = pa.ipc.read_schema(first)
    except (pa.ArrowException, OSError) as e:
        raise DecodeError(f"unreadable IPC schema: {e}") from e
    version = (schema.metadata or {}).get(S.SCHEMA_VERSION_KEY)
    if version != str(S.SCHEMA_VERSION).encode():
        raise SchemaMismatch(f"schema version {version!r}, expected {S.SCHEMA_VERSION}")
    if not schema.equals(S.TRAJECTORY_SCHEMA, check_metadata=False):
        raise SchemaMismatch(f"trajectory schema differs from version {S.SCHEMA_VERSION}'s: got {schema}")
    batches = []
    while True:
        try:
            msg = reader.read_next_message()
        except StopIteration:
            break
        except (pa.ArrowException, OSError) as e:
            raise DecodeError(f"bad IPC message after {len(batches)} batches: {e}") from e
        if msg.type != "record batch":
            raise SchemaMismatch(f"unexpected IPC {msg.type!r} message (only record batches allowed)")
        if _record_batch_is_compressed(msg.metadata):
            raise SchemaMismatch("compressed record batch refused (senders never compress)")
        if len(batches) >= S.MAX_RECORD_BATCHES_PER_FRAME:
            raise FrameTooLarge(f"more than {S.MAX_RECORD_BATCHES_PER_FRAME} record batches in one frame")
        try:
            batch = pa.ipc.read_record_batch(msg, schema)
            batch.validate(full=True)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DecodeError(f"record batch {len(batches)} fails Arrow validation: {e}") from e
        batches.append(batch)
    return batches


class _Columns:
    """Every array of one trajectory record batch, fetched once, and its offsets as numpy.

    Each pyarrow accessor call (``.field(i)``, ``.values``, ``.offsets``) builds a new wrapper, and
    the checks and the object builder both need most arrays, so they share this one walk.
    ``paths`` lists every array of the tree with a dotted name, for the no-nulls check.
    """

    def __init__(self, batch: pa.RecordBatch) -> None:
        self.batch = batch
        self.num_rows = batch.num_rows
        self.top = dict(zip(batch.schema.names, batch.columns, strict=True))
        self.steps = self.top["steps"].values  # StructArray [n_steps], every step of every trajectory
        self.step = {name: self.steps.field(i) for i, name in enumerate(_STEP_FIELDS)}
        self.tools = self.step["tool_calls"].values
        self.tool = [self.tools.field(i) for i in range(len(_TOOL_FIELD_LIST))]
        meta = self.top["metadata"]
        self.meta_keys, self.meta_items = meta.keys, meta.items
        # flat child arrays of the list columns; numpy for the numeric ones, zero-copy
        self.values = {name: self.step[name].values for name in _TOKEN_DTYPES}
        self.values["turn_rewards"] = self.top["turn_rewards"].values
        self.paths: list[tuple[str, pa.Array]] = [
            *self.top.items(),
            ("steps[]", self.steps),
            *((f"steps[].{n}", a) for n, a in self.step.items()),
            *((f"steps[].{n}[]", self.values[n]) for n in _TOKEN_DTYPES),
            ("steps[].tool_calls[]", self.tools),
            *(
                (f"steps[].tool_calls[].{f.name}", a)
                for f, a in zip(_TOOL_FIELD_LIST, self.tool, strict=True)
            ),
            ("turn_rewards[]", self.values["turn_rewards"]),
            ("metadata.key", self.meta_keys),
            ("metadata.value", self.meta_items),
        ]
        self.off: dict[str, np.ndarray] = {}  # filled by _check_fields (tight offsets)

    def numpy(self, arr: pa.Array) -> np.ndarray:
        return arr.to_numpy(zero_copy_only=True)


def _tight_offsets(arr: pa.Array, n_values: int, path: str) -> np.ndarray:
    """Offsets as numpy; require the canonical layout (start at 0, end at len(values))."""
    off = arr.offsets.to_numpy(zero_copy_only=True)
    if off[0] != 0 or off[-1] != n_values:
        raise SchemaMismatch(f"{path} offsets span [{off[0]}, {off[-1]}) of {n_values} values, not all")
    return off


def _check_nonneg(values: np.ndarray, path: str) -> None:
    if values.size and values.min() < 0:
        raise SchemaMismatch(f"{path} holds a negative value ({values.min()}), expected >= 0")


def _check_finite(values: np.ndarray, path: str) -> None:
    # min/max instead of isfinite().all(): two reductions, no temporary bool array; NaN propagates.
    if values.size and not (-np.inf < values.min() and values.max() < np.inf):
        raise SchemaMismatch(f"{path} holds NaN or infinite values")


def _check_fields(c: _Columns) -> None:
    """Semantic checks on a validated batch, each one numpy call over a whole column.

    Fills ``c.off`` with the checked offsets, for the object builder.
    """
    for path, arr in c.paths:
        if arr.null_count:
            raise SchemaMismatch(f"{path} has {arr.null_count} nulls; no field is nullable")
    if c.num_rows > S.MAX_TRAJECTORIES_PER_FRAME:
        raise FrameTooLarge(f"{c.num_rows} trajectories in one batch, cap {S.MAX_TRAJECTORIES_PER_FRAME}")
    off = c.off
    step_off = off["steps"] = _tight_offsets(c.top["steps"], len(c.steps), "steps")
    n_steps_per = np.diff(step_off)
    if n_steps_per.size and n_steps_per.max() > S.MAX_STEPS_PER_TRAJECTORY:
        raise FrameTooLarge(f"a trajectory has {n_steps_per.max()} steps, cap {S.MAX_STEPS_PER_TRAJECTORY}")
    for name in _TOKEN_DTYPES:
        off[name] = _tight_offsets(c.step[name], len(c.values[name]), f"steps.{name}")
    off["tool_calls"] = _tight_offsets(c.step["tool_calls"], len(c.tools), "steps.tool_calls")
    off["turn_rewards"] = _tight_offsets(c.top["turn_rewards"], len(c.values["turn_rewards"]), "turn_rewards")
    off["metadata"] = _tight_offsets(c.top["metadata"], len(c.meta_keys), "metadata")

    resp_len, logp_len = np.diff(off["response_ids"]), np.diff(off["logprobs"])
    if not np.array_equal(resp_len, logp_len):
        bad = int(np.nonzero(resp_len != logp_len)[0][0])
        raise SchemaMismatch(f"step {bad}: {resp_len[bad]} response tokens but {logp_len[bad]} log-probs")
    for name, cap in (
        ("prompt_ids", S.MAX_TOKENS_PER_STEP),
        ("response_ids", S.MAX_TOKENS_PER_STEP),
        ("parents", S.MAX_PARENTS_PER_STEP),
    ):
        lens = np.diff(off[name])
        if lens.size and lens.max() > cap:
            raise FrameTooLarge(f"a step has {lens.max()} {name}, cap {cap}")

    for name in ("prompt_ids", "response_ids"):
        _check_nonneg(c.numpy(c.values[name]), f"steps.{name}")
    logp = c.numpy(c.values["logprobs"])
    if logp.size:  # one min and one max serve both checks
        lo, hi = logp.min(), logp.max()
        if not (-np.inf < lo and hi < np.inf):
            raise SchemaMismatch("steps.logprobs holds NaN or infinite values")
        if hi > 1e-3:  # a probability above 1: a bug or a forged frame
            raise SchemaMismatch(f"steps.logprobs holds {hi} > 0; log-probs must be <= 0")
    _check_finite(c.numpy(c.step["reward"]), "steps.reward")
    _check_finite(c.numpy(c.top["reward"]), "reward")
    _check_finite(c.numpy(c.values["turn_rewards"]), "turn_rewards")
    _check_nonneg(c.numpy(c.step["policy_version"]), "steps.policy_version")
    _check_nonneg(c.numpy(c.step["turn"]), "steps.turn")
    _check_nonneg(c.numpy(c.top["seq"]), "seq")

    # Parents point strictly backwards inside their own trajectory: 0 <= p < local index.
    par = c.numpy(c.values["parents"])
    if par.size:
        step_start = np.repeat(step_off[:-1], n_steps_per)  # [n_steps] first global step of its traj
        owner = np.repeat(np.arange(len(c.steps)), np.diff(off["parents"]))  # [n_parents] global step
        local = owner - step_start[owner]
        bad = (par < 0) | (par >= local)
        if bad.any():
            k = int(np.nonzero(bad)[0][0])
            raise SchemaMismatch(
                f"step {local[k]} of its trajectory names parent {par[k]}; parents must be earlier steps"
            )
    # Metadata keys are unique within each trajectory: one set over (row, key) pairs of the frame.
    n_keys = len(c.meta_keys)
    if n_keys:
        rows = np.repeat(np.arange(c.num_rows), np.diff(off["metadata"])).tolist()
        keys = c.meta_keys.to_pylist()
        if len(set(zip(rows, keys, strict=True))) != n_keys:
            seen: set[tuple[int, str]] = set()
            for pair in zip(rows, keys, strict=True):
                if pair in seen:
                    raise SchemaMismatch(f"trajectory {pair[0]}: duplicate metadata key {pair[1]!r}")
                seen.add(pair)
    # unique() is one C pass; the set test then touches only the few distinct values
    if not _FINISH_REASONS.issuperset(c.step["finish_reason"].unique().to_pylist()):
        raise SchemaMismatch(f"unknown finish_reason, expected one of {S.FINISH_REASONS}")


def _split(items: Sequence, off: list[int]) -> list:
    """``items`` cut at ``off`` [n + 1]: n slices (zero-copy views when ``items`` is an ndarray)."""
    return [items[a:b] for a, b in zip(off[:-1], off[1:], strict=True)]


def _from_columns(c: _Columns) -> list[GraphTrajectory]:
    """Python objects from a checked batch: every column converted once, steps built by ``map``."""
    columns = []
    for f in _STEP_FIELD_LIST:
        if f.name in _TOKEN_DTYPES:
            columns.append(_split(c.numpy(c.values[f.name]), c.off[f.name].tolist()))
        elif f.name == "tool_calls":
            calls = list(map(ToolCall, *(a.to_pylist() for a in c.tool)))
            columns.append(_split(calls, c.off["tool_calls"].tolist()))
        elif pa.types.is_string(f.type):
            columns.append(c.step[f.name].to_pylist())
        else:
            columns.append(c.numpy(c.step[f.name]).tolist())
    steps = list(map(AgentStep, *columns))

    top = {n: a.to_pylist() for n, a in c.top.items() if pa.types.is_string(a.type)}
    seq, reward = c.numpy(c.top["seq"]).tolist(), c.numpy(c.top["reward"]).tolist()
    turn_rewards = _split(c.numpy(c.values["turn_rewards"]), c.off["turn_rewards"].tolist())
    mk, mv, mo = c.meta_keys.to_pylist(), c.meta_items.to_pylist(), c.off["metadata"].tolist()
    so = c.off["steps"].tolist()
    return [
        GraphTrajectory(
            episode_id=top["episode_id"][r],
            incarnation=top["incarnation"][r],
            seq=seq[r],
            task_id=top["task_id"][r],
            group_id=top["group_id"][r],
            workflow=top["workflow"][r],
            reward=reward[r],
            steps=steps[so[r] : so[r + 1]],
            turn_rewards=turn_rewards[r],
            metadata=dict(zip(mk[mo[r] : mo[r + 1]], mv[mo[r] : mo[r + 1]], strict=True)),
        )
        for r in range(c.num_rows)
    ]


def _validated(data: bytes | bytearray | memoryview | pa.Buffer) -> list[_Columns]:
    """Every check of the module docstring, over the whole frame, before anything is built."""
    size = data.size if isinstance(data, pa.Buffer) else memoryview(data).nbytes
    if size > S.MAX_FRAME_BYTES:
        raise FrameTooLarge(f"frame is {size} bytes, cap is {S.MAX_FRAME_BYTES}")
    buf = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    checked = []
    for batch in _iter_batches(buf):
        c = _Columns(batch)
        _check_fields(c)
        checked.append(c)
    return checked


def decode_record_batches(data: bytes | bytearray | memoryview | pa.Buffer) -> list[pa.RecordBatch]:
    """Validate foreign Arrow IPC bytes and return the record batches, building no Python objects.

    Exactly the checks of ``decode_trajectories`` (which is this plus the object builder), for a
    consumer that keeps the data in Arrow. Raises a ``ProtocolError`` subclass (and counts it by
    ``reason``) on anything invalid.
    """
    try:
        return [c.batch for c in _validated(data)]
    except ProtocolError as e:
        count_rejection(e.reason)
        raise


def decode_trajectories(data: bytes | bytearray | memoryview | pa.Buffer) -> list[GraphTrajectory]:
    """Decode foreign Arrow IPC bytes into trajectories (zero-copy, read-only token views).

    Raises a ``ProtocolError`` subclass (and counts it by ``reason``) on anything invalid.
    """
    try:
        return [t for c in _validated(data) for t in _from_columns(c)]
    except ProtocolError as e:
        count_rejection(e.reason)
        raise
