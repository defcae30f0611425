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
   mutated stream segfaults within a few dozen inputs (measured, docs/reliability.md R-fuzz);
4. field checks, vectorised over whole columns -- one numpy reduction per column of the batch,
   no per-trajectory or per-step Python (``SchemaMismatch`` / ``FrameTooLarge``): no nulls, tight
   offsets, len(response_ids) == len(logprobs), parents point strictly backwards within their own
   trajectory, versions/turns/seq non-negative, token ids non-negative, rewards and log-probs
   finite (log-probs also <= 0), finish_reason known, metadata keys unique per trajectory,
   per-step/per-frame caps.

The whole frame is checked before any object is built. ``decode_record_batches`` stops there
and returns the validated batches; ``decode_batches`` wraps them as ``TrajectoryBatch`` es
(zero-copy numpy columns, routing fields, objects built only on demand; the replay buffer keeps
these, and ``encode_rows`` cuts a frame out of their rows); ``decode_trajectories`` goes on to
build objects. The encoder runs the same semantic checks (``_check_numbers``) on the numpy
arrays it has just built.

Objects are then built column-wise: ``AgentStep`` positionally by ``map`` over the columns (its
fields are declared in ``STEP_TYPE`` order; checked at import), strings by ``to_pylist``.
Decoded token arrays are **read-only zero-copy numpy views** into the frame's memory (the
Arrow buffers keep it alive); copy them before writing.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """int32 offsets [n + 1] from int64 lengths [n]; refuses what int32 cannot address."""
    out = np.empty(len(lengths) + 1, dtype=np.int32)
    out[0] = 0
    if len(lengths) and int(lengths.sum()) > _INT32_MAX:
        raise FrameTooLarge(f"a list column holds {int(lengths.sum())} values, over the int32 offset range")
    np.cumsum(lengths, dtype=np.int32, out=out[1:])
    return out


def _lengths(items: Sequence) -> np.ndarray:
    return np.fromiter(map(len, items), dtype=np.int64, count=len(items))


def _list_array(offsets: np.ndarray, values: pa.Array, list_type: pa.DataType) -> pa.ListArray:
    """A list array over ``values`` from int32 offsets we computed (tight by construction)."""
    return pa.Array.from_buffers(
        list_type, len(offsets) - 1, [None, pa.py_buffer(offsets)], children=[values]
    )


def _flat_list(
    arrays: Sequence[np.ndarray], dtype: type, list_type: pa.DataType
) -> tuple[pa.ListArray, np.ndarray, np.ndarray]:
    """One list<dtype> column from per-row arrays: one concatenate (a memcpy) plus offsets.

    Returns the column, the row lengths and the flat values as numpy (for the field checks).
    The values are concatenated straight into a buffer from Arrow's memory pool, which recycles
    its pages: a fresh numpy array of a megabyte page-faults on every page (measured: 3x slower).
    The cast is numpy's ``unsafe`` one, as ``astype`` would do (Python lists become int64/float64).
    """
    lengths = _lengths(arrays)
    offsets = _offsets(lengths)
    n = int(offsets[-1])
    buf = pa.allocate_buffer(n * np.dtype(dtype).itemsize)
    flat = np.frombuffer(buf, dtype)
    if n:
        np.concatenate(arrays, out=flat, casting="unsafe")
    values = pa.Array.from_buffers(list_type.value_type, n, [None, buf])
    return _list_array(offsets, values, list_type), lengths, flat


def _strings(values: Sequence[str]) -> pa.Array:
    return pa.array(values, pa.string())


def to_record_batch(trajectories: Sequence[GraphTrajectory]) -> pa.RecordBatch:
    """Build the Arrow record batch (one row per trajectory) and run the same field checks as decode.

    The checks read the numpy arrays this function built (``_Numbers``), not the Arrow tree, and
    skip what holds by construction: offsets are tight, metadata keys come from dicts.
    """
    step, lens, flat, finish_reasons = _step_arrays([s for t in trajectories for s in t.steps])
    sch = S.TRAJECTORY_SCHEMA
    metas = [t.metadata for t in trajectories]
    turn_rewards, _, turn_flat = _flat_list(
        [t.turn_rewards for t in trajectories], np.float32, sch.field("turn_rewards").type
    )
    n_steps = np.fromiter(map(len, map(attrgetter("steps"), trajectories)), np.int64, len(trajectories))
    seq, reward = _top_array(trajectories, "seq"), _top_array(trajectories, "reward")
    batch = pa.RecordBatch.from_arrays(
        [
            _top_array(trajectories, "episode_id"),
            _top_array(trajectories, "incarnation"),
            seq,
            _top_array(trajectories, "task_id"),
            _top_array(trajectories, "group_id"),
            _top_array(trajectories, "workflow"),
            reward,
            turn_rewards,
            _metadata_array(metas, sch.field("metadata").type),
            _list_array(
                _offsets(n_steps),
                pa.StructArray.from_arrays(list(step.values()), fields=_STEP_FIELD_LIST),
                sch.field("steps").type,
            ),
        ],
        schema=sch,
    )
    _refuse_nulls((*zip(batch.schema.names, batch.columns, strict=True), *step.items()))
    _check_numbers(
        _Numbers(
            num_rows=len(trajectories),
            step_lens=n_steps,
            lens=lens,
            values=flat,
            turn_rewards=turn_flat,
            step_reward=step["reward"].to_numpy(),
            reward=reward.to_numpy(),
            policy_version=step["policy_version"].to_numpy(),
            turn=step["turn"].to_numpy(),
            seq=seq.to_numpy(),
            finish_reasons=finish_reasons,
        )
    )
    return batch


def _step_arrays(
    steps: Sequence[AgentStep],
) -> tuple[dict[str, pa.Array], dict[str, np.ndarray], dict[str, np.ndarray], set[str]]:
    """Every step column as one Arrow array, in ``STEP_TYPE`` order; the token columns' row lengths
    and flat numpy values (for the field checks); the distinct finish reasons."""
    # One C-level getter per step, then a transpose: faster than a pass per field (measured).
    columns = (
        dict(zip(_STEP_FIELDS, zip(*map(_STEP_GETTER, steps), strict=True), strict=True))
        if steps
        else {f: () for f in _STEP_FIELDS}
    )
    arrays: dict[str, pa.Array] = {}
    lens: dict[str, np.ndarray] = {}
    flat: dict[str, np.ndarray] = {}
    for f in _STEP_FIELD_LIST:
        values = columns[f.name]
        if f.name in _TOKEN_DTYPES:
            arrays[f.name], lens[f.name], flat[f.name] = _flat_list(values, _TOKEN_DTYPES[f.name], f.type)
        elif f.name == "tool_calls":
            arrays[f.name] = _tool_calls_array(values, f.type)
        else:
            arrays[f.name] = pa.array(values, f.type)
    return arrays, lens, flat, set(columns["finish_reason"])


def _tool_calls_array(per_step: Sequence[Sequence[ToolCall]], list_type: pa.DataType) -> pa.ListArray:
    """The ``tool_calls`` column: every step's calls as one struct array, one column getter per field."""
    calls = [c for step_calls in per_step for c in step_calls]
    tool_struct = pa.StructArray.from_arrays(
        [pa.array(list(map(attrgetter(t.name), calls)), t.type) for t in _TOOL_FIELD_LIST],
        fields=_TOOL_FIELD_LIST,
    )
    return _list_array(_offsets(_lengths(per_step)), tool_struct, list_type)


def _top_array(trajectories: Sequence[GraphTrajectory], name: str) -> pa.Array:
    """A plain per-trajectory column (one value per row)."""
    return pa.array(list(map(attrgetter(name), trajectories)), S.TRAJECTORY_SCHEMA.field(name).type)


def _metadata_array(metas: Sequence[dict[str, str]], map_type: pa.DataType) -> pa.MapArray:
    """The ``metadata`` column: one map per trajectory, keys and values flattened once."""
    return pa.MapArray.from_arrays(
        pa.array(_offsets(_lengths(metas))),
        _strings([k for m in metas for k in m]),
        _strings([v for m in metas for v in m.values()]),
        type=map_type,
    )


def _refuse_nulls(arrays: Iterable[tuple[str, pa.Array]]) -> None:
    """A None in a Python column becomes a null: refused, naming the column."""
    for path, arr in arrays:
        if arr.null_count:
            raise SchemaMismatch(f"{path} has {arr.null_count} nulls; no field is nullable")


def encode_trajectories_buffer(trajectories: Sequence[GraphTrajectory]) -> pa.Buffer:
    """Encode to one Arrow IPC stream in a ``pa.Buffer`` (supports the buffer protocol, no extra copy)."""
    return _write_stream(to_record_batch(trajectories))


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


@dataclass(frozen=True)
class _Numbers:
    """The numeric view of one batch that the semantic checks read: flat numpy arrays.

    The decoder fills it from the validated Arrow buffers (zero-copy), the encoder from the arrays
    it has just built, so one function checks both sides.
    """

    num_rows: int
    step_lens: np.ndarray  # [rows] steps per trajectory
    lens: dict[str, np.ndarray]  # token/parent column -> [steps] list lengths
    values: dict[str, np.ndarray]  # token/parent column -> flat values
    turn_rewards: np.ndarray
    step_reward: np.ndarray
    reward: np.ndarray
    policy_version: np.ndarray
    turn: np.ndarray
    seq: np.ndarray
    finish_reasons: Iterable[str]  # the distinct values


def _check_numbers(n: _Numbers) -> None:
    """Semantic checks, each one numpy call over a whole column (no per-step Python)."""
    if n.num_rows > S.MAX_TRAJECTORIES_PER_FRAME:
        raise FrameTooLarge(f"{n.num_rows} trajectories in one batch, cap {S.MAX_TRAJECTORIES_PER_FRAME}")
    if n.step_lens.size and n.step_lens.max() > S.MAX_STEPS_PER_TRAJECTORY:
        raise FrameTooLarge(f"a trajectory has {n.step_lens.max()} steps, cap {S.MAX_STEPS_PER_TRAJECTORY}")
    resp_len, logp_len = n.lens["response_ids"], n.lens["logprobs"]
    if not np.array_equal(resp_len, logp_len):
        bad = int(np.nonzero(resp_len != logp_len)[0][0])
        raise SchemaMismatch(f"step {bad}: {resp_len[bad]} response tokens but {logp_len[bad]} log-probs")
    for name, cap in (
        ("prompt_ids", S.MAX_TOKENS_PER_STEP),
        ("response_ids", S.MAX_TOKENS_PER_STEP),
        ("parents", S.MAX_PARENTS_PER_STEP),
    ):
        lens = n.lens[name]
        if lens.size and lens.max() > cap:
            raise FrameTooLarge(f"a step has {lens.max()} {name}, cap {cap}")

    for name in ("prompt_ids", "response_ids"):
        _check_nonneg(n.values[name], f"steps.{name}")
    logp = n.values["logprobs"]
    if logp.size:  # one min and one max serve both checks
        lo, hi = logp.min(), logp.max()
        if not (-np.inf < lo and hi < np.inf):
            raise SchemaMismatch("steps.logprobs holds NaN or infinite values")
        if hi > 1e-3:  # a probability above 1: a bug or a forged frame
            raise SchemaMismatch(f"steps.logprobs holds {hi} > 0; log-probs must be <= 0")
    _check_finite(n.step_reward, "steps.reward")
    _check_finite(n.reward, "reward")
    _check_finite(n.turn_rewards, "turn_rewards")
    _check_nonneg(n.policy_version, "steps.policy_version")
    _check_nonneg(n.turn, "steps.turn")
    _check_nonneg(n.seq, "seq")

    # Parents point strictly backwards inside their own trajectory: 0 <= p < local index.
    par = n.values["parents"]
    if par.size:
        # local index of every step = global index - index of its trajectory's first step
        n_steps = len(n.lens["parents"])
        first = np.zeros(len(n.step_lens), np.int64)
        np.cumsum(n.step_lens[:-1], out=first[1:])
        local_of_step = np.arange(n_steps) - np.repeat(first, n.step_lens)
        local = np.repeat(local_of_step, n.lens["parents"])  # [n_parents]
        bad = (par < 0) | (par >= local)
        if bad.any():
            k = int(np.nonzero(bad)[0][0])
            raise SchemaMismatch(
                f"step {local[k]} of its trajectory names parent {par[k]}; parents must be earlier steps"
            )
    if not _FINISH_REASONS.issuperset(n.finish_reasons):
        raise SchemaMismatch(f"unknown finish_reason, expected one of {S.FINISH_REASONS}")


def _check_fields(c: _Columns) -> None:
    """Every check of a decoded batch: no nulls, tight offsets, unique metadata keys, then
    ``_check_numbers``. Fills ``c.off`` with the checked offsets, for the object builder."""
    for path, arr in c.paths:
        if arr.null_count:
            raise SchemaMismatch(f"{path} has {arr.null_count} nulls; no field is nullable")
    off = c.off
    off["steps"] = _tight_offsets(c.top["steps"], len(c.steps), "steps")
    for name in _TOKEN_DTYPES:
        off[name] = _tight_offsets(c.step[name], len(c.values[name]), f"steps.{name}")
    off["tool_calls"] = _tight_offsets(c.step["tool_calls"], len(c.tools), "steps.tool_calls")
    off["turn_rewards"] = _tight_offsets(c.top["turn_rewards"], len(c.values["turn_rewards"]), "turn_rewards")
    off["metadata"] = _tight_offsets(c.top["metadata"], len(c.meta_keys), "metadata")
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
    _check_numbers(
        _Numbers(
            num_rows=c.num_rows,
            step_lens=np.diff(off["steps"]),
            lens={name: np.diff(off[name]) for name in _TOKEN_DTYPES},
            values={name: c.numpy(c.values[name]) for name in _TOKEN_DTYPES},
            turn_rewards=c.numpy(c.values["turn_rewards"]),
            step_reward=c.numpy(c.step["reward"]),
            reward=c.numpy(c.top["reward"]),
            policy_version=c.numpy(c.step["policy_version"]),
            turn=c.numpy(c.step["turn"]),
            seq=c.numpy(c.top["seq"]),
            # unique() is one C pass; the set test then touches only the few distinct values
            finish_reasons=c.step["finish_reason"].unique().to_pylist(),
        )
    )


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


# --------------------------------------------------------------------------------------------
# columnar batches: what the replay buffer keeps (no per-step Python objects)


class TrajectoryBatch:
    """Validated trajectories kept as one Arrow record batch: numpy columns, objects on demand.

    What a consumer that only routes trajectories needs (the replay buffer: group ids, rewards,
    policy-version ranges, steps per agent, and the rows themselves to persist and hand out) is
    read straight from the columns, without building an ``AgentStep`` per step. ``trajectory(i)``
    builds the Python objects of the whole batch once, on first use, and caches them.

    Build one with ``decode_batches(frame)`` (foreign bytes, every check of ``decode_trajectories``)
    or ``TrajectoryBatch.from_trajectories(objects)`` (the encoder's checks). Row ``i`` is
    ``TrajectoryRow(batch, i)``; ``encode_rows`` turns rows of any batches back into one frame.
    """

    def __init__(self, columns: _Columns) -> None:
        self._c = columns
        self.record_batch = columns.batch
        off = columns.off["steps"]
        self.step_offsets = off  # [rows + 1] int32
        self.reward = columns.numpy(columns.top["reward"])  # [rows] float64
        self.group_id: list[str] = columns.top["group_id"].to_pylist()
        self.episode_id: list[str] = columns.top["episode_id"].to_pylist()
        self.agent_id: list[str] = columns.step["agent_id"].to_pylist()  # [steps]
        versions = columns.numpy(columns.step["policy_version"])
        n_steps = np.diff(off)
        has = n_steps > 0
        starts = off[:-1][has]
        self.min_version = np.full(len(n_steps), -1, np.int64)  # -1 for a trajectory without steps
        self.max_version = np.full(len(n_steps), -1, np.int64)
        if versions.size:
            self.min_version[has] = np.minimum.reduceat(versions, starts)
            self.max_version[has] = np.maximum.reduceat(versions, starts)
        self.has_steps = has
        self._objects: list[GraphTrajectory] | None = None
        self._models: tuple[np.ndarray, list[str]] | None = None  # step_strings("model_id"), on demand
        self._trained: np.ndarray | None = None  # per step: sampled with an adapter, on demand

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[GraphTrajectory]) -> TrajectoryBatch:
        c = _Columns(to_record_batch(trajectories))
        _fill_offsets(c)
        batch = cls(c)
        batch._objects = list(trajectories)
        return batch

    def __len__(self) -> int:
        return self.record_batch.num_rows

    def rows(self) -> list[TrajectoryRow]:
        return [TrajectoryRow(self, i) for i in range(len(self))]

    def steps_per_agent(self, i: int) -> dict[str, int]:
        a, b = int(self.step_offsets[i]), int(self.step_offsets[i + 1])
        out: dict[str, int] = {}
        for agent in self.agent_id[a:b]:
            out[agent] = out.get(agent, 0) + 1
        return out

    def versions_per_model(self, i: int, trained_only: bool = False) -> dict[str, tuple[int, int]]:
        """Row ``i``'s (min, max) step ``policy_version`` per step ``model_id`` (base model); {}
        without steps. ``trained_only``: over the steps sampled with an adapter only (``adapter`` not
        ''; a step on base weights records version 0 however late it ran). From the columns: the
        model and adapter columns are dictionary-encoded once per batch."""
        a, b = int(self.step_offsets[i]), int(self.step_offsets[i + 1])
        if a == b:
            return {}
        if self._models is None:
            self._models = self.step_strings("model_id")
        codes, labels = self._models
        c = codes[a:b]
        v = self.step_numpy("policy_version")[a:b]
        if trained_only:
            if self._trained is None:  # [steps] bool: sampled with an adapter
                a_codes, a_labels = self.step_strings("adapter")
                self._trained = np.asarray([bool(x) for x in a_labels], dtype=bool)[a_codes]
            keep = self._trained[a:b]
            c, v = c[keep], v[keep]
        out: dict[str, tuple[int, int]] = {}
        for k in np.unique(c):
            sel = v[c == k]
            out[labels[int(k)]] = (int(sel.min()), int(sel.max()))
        return out

    def step_numpy(self, name: str) -> np.ndarray:
        """A numeric step column (``policy_version``, ``turn``, ``reward``, ...) as a zero-copy numpy
        view, indexed like ``step_offsets`` (absolute step positions)."""
        return self._c.numpy(self._c.step[name])

    def step_strings(self, name: str) -> tuple[np.ndarray, list[str]]:
        """A string step column (``agent_id``, ``adapter``, ...) as (codes [steps] int32, labels):
        Arrow's dictionary encoding, so a consumer maps a few labels instead of every step's string."""
        enc = self._c.step[name].dictionary_encode()
        return enc.indices.to_numpy(zero_copy_only=False), enc.dictionary.to_pylist()

    def tokens(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets [steps + 1] int32, flat values) of a token column (``prompt_ids``,
        ``response_ids``, ``logprobs``, ``parents``): step ``s`` holds ``values[off[s]:off[s + 1]]``."""
        return self._c.off[name], self._c.numpy(self._c.values[name])

    def trajectories(self) -> list[GraphTrajectory]:
        if self._objects is None:
            self._objects = _from_columns(self._c)
        return self._objects

    def trajectory(self, i: int) -> GraphTrajectory:
        return self.trajectories()[i]


@dataclass(frozen=True, eq=False)
class TrajectoryRow:
    """One trajectory of a ``TrajectoryBatch``: its routing fields, and the object on demand."""

    batch: TrajectoryBatch
    index: int

    @property
    def episode_id(self) -> str:
        return self.batch.episode_id[self.index]

    @property
    def group_id(self) -> str:
        return self.batch.group_id[self.index]

    @property
    def reward(self) -> float:
        return float(self.batch.reward[self.index])

    def versions(self, default: int) -> tuple[int, int]:
        """(min, max) policy version of the steps; (default, default) without steps."""
        if not self.batch.has_steps[self.index]:
            return default, default
        return int(self.batch.min_version[self.index]), int(self.batch.max_version[self.index])

    def steps_per_agent(self) -> dict[str, int]:
        return self.batch.steps_per_agent(self.index)

    def versions_per_model(self, trained_only: bool = False) -> dict[str, tuple[int, int]]:
        """(min, max) policy version of the steps per base model id; {} without steps.
        ``trained_only``: of the steps sampled with an adapter only."""
        return self.batch.versions_per_model(self.index, trained_only)

    def trajectory(self) -> GraphTrajectory:
        return self.batch.trajectory(self.index)


def _fill_offsets(c: _Columns) -> None:
    """The offsets ``_check_fields`` would record, for a batch this process built and checked."""
    c.off["steps"] = c.top["steps"].offsets.to_numpy()
    for name in _TOKEN_DTYPES:
        c.off[name] = c.step[name].offsets.to_numpy()
    c.off["tool_calls"] = c.step["tool_calls"].offsets.to_numpy()
    c.off["turn_rewards"] = c.top["turn_rewards"].offsets.to_numpy()
    c.off["metadata"] = c.top["metadata"].offsets.to_numpy()


def decode_batches(data: bytes | bytearray | memoryview | pa.Buffer) -> list[TrajectoryBatch]:
    """Validate foreign Arrow IPC bytes into ``TrajectoryBatch`` es (no per-step objects).

    Exactly the checks of ``decode_trajectories``; raises (and counts) a ``ProtocolError`` subclass.
    """
    try:
        return [TrajectoryBatch(c) for c in _validated(data)]
    except ProtocolError as e:
        count_rejection(e.reason)
        raise


def rows_record_batch(rows: Sequence[TrajectoryRow]) -> pa.RecordBatch:
    """One record batch holding ``rows`` in order: the original batch when the rows are all of it,
    else Arrow ``take`` per run of rows from one batch (a C++ copy with compact offsets)."""
    if not rows:
        return to_record_batch([])
    first = rows[0].batch
    if len(rows) == len(first) and all(r.batch is first and r.index == i for i, r in enumerate(rows)):
        return first.record_batch
    parts, start = [], 0
    for k in range(1, len(rows) + 1):
        if k == len(rows) or rows[k].batch is not rows[start].batch:
            idx = pa.array([r.index for r in rows[start:k]], pa.int32())
            parts.append(rows[start].batch.record_batch.take(idx))
            start = k
    if len(parts) == 1:
        return parts[0]
    return pa.Table.from_batches(parts, schema=S.TRAJECTORY_SCHEMA).combine_chunks().to_batches()[0]


def _write_stream(batch: pa.RecordBatch) -> pa.Buffer:
    mock = pa.MockOutputStream()
    with pa.ipc.new_stream(mock, S.TRAJECTORY_SCHEMA, options=_WRITE_OPTIONS) as w:
        w.write_batch(batch)
    buf = pa.allocate_buffer(mock.size())
    with pa.ipc.new_stream(pa.FixedSizeBufferWriter(buf), S.TRAJECTORY_SCHEMA, options=_WRITE_OPTIONS) as w:
        w.write_batch(batch)
    if buf.size > S.MAX_FRAME_BYTES:
        raise FrameTooLarge(f"encoded frame is {buf.size} bytes, cap is {S.MAX_FRAME_BYTES}")
    return buf


def encode_rows(rows: Sequence[TrajectoryRow]) -> pa.Buffer:
    """One Arrow IPC frame of ``rows`` (of any batches), without building Python objects."""
    return _write_stream(rows_record_batch(rows))
