"""GraphTrajectory lists <-> Arrow IPC stream bytes, validating every decode of foreign bytes.

Encoding (see ``schema.py`` for the layout): token columns are built from flat numpy buffers and
int32 offsets with ``pa.ListArray.from_arrays`` -- one ``np.concatenate`` per column, never a
Python list of ints -- and the IPC stream is written once into a pre-sized buffer (its size is
measured first with a ``MockOutputStream``, so there is no grow-and-copy). Use
``encode_trajectories_buffer`` to get that ``pa.Buffer`` without the final copy into ``bytes``
(zmq sends it zero-copy).

Decoding treats the bytes as hostile, in this order, each failure a typed ``ProtocolError``
(counted in ``teamrl_protocol_rejected_frames_total{reason}``):

1. size cap (``FrameTooLarge``);
2. IPC framing, message by message: the first must be the schema, equal to
   ``TRAJECTORY_SCHEMA`` with our ``SCHEMA_VERSION`` (``SchemaMismatch``); dictionary batches and
   *compressed* record batches are refused before their body is touched -- we never compress, and
   a compressed body is how a 30 kB frame would make us allocate gigabytes (compression bomb);
3. ``RecordBatch.validate(full=True)`` (``DecodeError``): without it, reading values out of a
   mutated stream segfaults within a few dozen inputs (measured, RELIABILITY.md);
4. field checks, vectorised over the flat buffers (``SchemaMismatch`` / ``FrameTooLarge``): no
   nulls, tight offsets, len(response_ids) == len(logprobs), parents point strictly backwards
   within their own trajectory, versions/turns/seq non-negative, token ids non-negative, rewards
   and log-probs finite (log-probs also <= 0), finish_reason known, per-step/per-frame caps.

Decoded token arrays are **read-only zero-copy numpy views** into the frame's memory (the
Arrow buffers keep it alive); copy them before writing.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from teamrl.protocol import schema as S
from teamrl.protocol.errors import DecodeError, FrameTooLarge, ProtocolError, SchemaMismatch
from teamrl.protocol.metrics import count_rejection
from teamrl.protocol.trajectory import AgentStep, GraphTrajectory, ToolCall

_TOKEN_COLUMNS = (("parents", np.int32), ("prompt_ids", np.int32), ("response_ids", np.int32))


# --------------------------------------------------------------------------------------------
# encode


def _list_array(arrays: Sequence[np.ndarray], dtype: type, list_type: pa.DataType) -> pa.ListArray:
    """One list<dtype> column from per-row numpy arrays: concatenate once, offsets from lengths."""
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise FrameTooLarge(f"a list column holds {offsets[-1]} values, over the int32 offset range")
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values), type=list_type)


def _offsets(counts: Sequence[int]) -> pa.Array:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(np.asarray(counts, dtype=np.int64), out=out[1:])
    if out[-1] > np.iinfo(np.int32).max:
        raise FrameTooLarge(f"{out[-1]} nested items, over the int32 offset range")
    return pa.array(out.astype(np.int32))


def to_record_batch(trajectories: Sequence[GraphTrajectory]) -> pa.RecordBatch:
    """Build the Arrow record batch (one row per trajectory) and run the same field checks as decode."""
    steps = [s for t in trajectories for s in t.steps]
    st = S.STEP_TYPE
    tools = [c for s in steps for c in s.tool_calls]
    tool_struct = pa.StructArray.from_arrays(
        [
            pa.array([c.name for c in tools], pa.string()),
            pa.array([c.arguments for c in tools], pa.string()),
            pa.array([c.result for c in tools], pa.string()),
        ],
        fields=list(S.TOOL_CALL_TYPE),
    )
    columns = {
        "agent_id": pa.array([s.agent_id for s in steps], pa.string()),
        "role": pa.array([s.role for s in steps], pa.string()),
        "model_id": pa.array([s.model_id for s in steps], pa.string()),
        "adapter": pa.array([s.adapter for s in steps], pa.string()),
        "policy_version": pa.array([s.policy_version for s in steps], pa.int64()),
        "turn": pa.array([s.turn for s in steps], pa.int32()),
        "parents": _list_array([s.parents for s in steps], np.int32, st.field("parents").type),
        "prompt_ids": _list_array([s.prompt_ids for s in steps], np.int32, st.field("prompt_ids").type),
        "response_ids": _list_array([s.response_ids for s in steps], np.int32, st.field("response_ids").type),
        "logprobs": _list_array([s.logprobs for s in steps], np.float32, st.field("logprobs").type),
        "finish_reason": pa.array([s.finish_reason for s in steps], pa.string()),
        "reward": pa.array([s.reward for s in steps], pa.float64()),
        "response_text": pa.array([s.response_text for s in steps], pa.string()),
        "tool_calls": pa.ListArray.from_arrays(
            _offsets([len(s.tool_calls) for s in steps]), tool_struct, type=st.field("tool_calls").type
        ),
        "t_start": pa.array([s.t_start for s in steps], pa.float64()),
        "t_end": pa.array([s.t_end for s in steps], pa.float64()),
    }
    step_struct = pa.StructArray.from_arrays([columns[f.name] for f in st], fields=list(st))
    sch = S.TRAJECTORY_SCHEMA
    meta_keys = [k for t in trajectories for k in t.metadata]
    meta_vals = [v for t in trajectories for v in t.metadata.values()]
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array([t.episode_id for t in trajectories], pa.string()),
            pa.array([t.incarnation for t in trajectories], pa.string()),
            pa.array([t.seq for t in trajectories], pa.int64()),
            pa.array([t.task_id for t in trajectories], pa.string()),
            pa.array([t.group_id for t in trajectories], pa.string()),
            pa.array([t.workflow for t in trajectories], pa.string()),
            pa.array([t.reward for t in trajectories], pa.float64()),
            _list_array([t.turn_rewards for t in trajectories], np.float32, sch.field("turn_rewards").type),
            pa.MapArray.from_arrays(
                _offsets([len(t.metadata) for t in trajectories]),
                pa.array(meta_keys, pa.string()),
                pa.array(meta_vals, pa.string()),
                type=sch.field("metadata").type,
            ),
            pa.ListArray.from_arrays(
                _offsets([len(t.steps) for t in trajectories]), step_struct, type=sch.field("steps").type
            ),
        ],
        schema=sch,
    )
    _check_fields(batch)
    return batch


def encode_trajectories_buffer(trajectories: Sequence[GraphTrajectory]) -> pa.Buffer:
    """Encode to one Arrow IPC stream in a ``pa.Buffer`` (supports the buffer protocol, no extra copy)."""
    batch = to_record_batch(trajectories)
    mock = pa.MockOutputStream()
    with pa.ipc.new_stream(mock, S.TRAJECTORY_SCHEMA) as w:
        w.write_batch(batch)
    buf = pa.allocate_buffer(mock.size())
    with pa.ipc.new_stream(pa.FixedSizeBufferWriter(buf), S.TRAJECTORY_SCHEMA) as w:
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


def _no_nulls(arr: pa.Array, path: str) -> None:
    if arr.null_count:
        raise SchemaMismatch(f"{path} has {arr.null_count} nulls; no field is nullable")
    t = arr.type
    if pa.types.is_struct(t):
        for i in range(t.num_fields):
            _no_nulls(arr.field(i), f"{path}.{t.field(i).name}")
    elif pa.types.is_map(t):
        _no_nulls(arr.keys, f"{path}.key")
        _no_nulls(arr.items, f"{path}.value")
    elif pa.types.is_list(t):
        _no_nulls(arr.values, f"{path}[]")


def _tight_offsets(arr: pa.Array, path: str) -> np.ndarray:
    """Offsets as numpy; require the canonical layout (start at 0, end at len(values))."""
    off = arr.offsets.to_numpy(zero_copy_only=True)
    n_values = len(arr.keys) if pa.types.is_map(arr.type) else len(arr.values)
    if off[0] != 0 or off[-1] != n_values:
        raise SchemaMismatch(f"{path} offsets span [{off[0]}, {off[-1]}) of {n_values} values, not all")
    return off


def _check_finite(values: np.ndarray, path: str) -> None:
    if values.size and not np.isfinite(values).all():
        raise SchemaMismatch(f"{path} holds NaN or infinite values")


def _check_nonneg(values: np.ndarray, path: str) -> None:
    if values.size and values.min() < 0:
        raise SchemaMismatch(f"{path} holds a negative value ({values.min()}), expected >= 0")


def _check_fields(batch: pa.RecordBatch) -> dict[str, np.ndarray]:
    """Semantic checks on a validated batch; returns the offsets it computed, for reuse."""
    for i, f in enumerate(batch.schema):
        _no_nulls(batch.column(i), f.name)
    if batch.num_rows > S.MAX_TRAJECTORIES_PER_FRAME:
        raise FrameTooLarge(f"{batch.num_rows} trajectories in one batch, cap {S.MAX_TRAJECTORIES_PER_FRAME}")
    steps_col = batch.column("steps")
    step_off = _tight_offsets(steps_col, "steps")
    n_steps_per = np.diff(step_off)
    if n_steps_per.size and n_steps_per.max() > S.MAX_STEPS_PER_TRAJECTORY:
        raise FrameTooLarge(f"a trajectory has {n_steps_per.max()} steps, cap {S.MAX_STEPS_PER_TRAJECTORY}")
    steps = steps_col.values
    offs: dict[str, np.ndarray] = {"steps": step_off}
    for name in ("parents", "prompt_ids", "response_ids", "logprobs", "tool_calls"):
        offs[name] = _tight_offsets(steps.field(name), f"steps.{name}")
    offs["turn_rewards"] = _tight_offsets(batch.column("turn_rewards"), "turn_rewards")
    offs["metadata"] = _tight_offsets(batch.column("metadata"), "metadata")

    resp_len = np.diff(offs["response_ids"])
    if not np.array_equal(resp_len, np.diff(offs["logprobs"])):
        bad = int(np.nonzero(resp_len != np.diff(offs["logprobs"]))[0][0])
        raise SchemaMismatch(
            f"step {bad}: {resp_len[bad]} response tokens but {np.diff(offs['logprobs'])[bad]} log-probs"
        )
    for name, cap in (
        ("prompt_ids", S.MAX_TOKENS_PER_STEP),
        ("response_ids", S.MAX_TOKENS_PER_STEP),
        ("parents", S.MAX_PARENTS_PER_STEP),
    ):
        lens = np.diff(offs[name])
        if lens.size and lens.max() > cap:
            raise FrameTooLarge(f"a step has {lens.max()} {name}, cap {cap}")

    for name, _ in _TOKEN_COLUMNS[1:]:
        _check_nonneg(steps.field(name).values.to_numpy(zero_copy_only=True), f"steps.{name}")
    logp = steps.field("logprobs").values.to_numpy(zero_copy_only=True)
    _check_finite(logp, "steps.logprobs")
    if logp.size and logp.max() > 1e-3:  # a probability above 1: a bug or a forged frame
        raise SchemaMismatch(f"steps.logprobs holds {logp.max()} > 0; log-probs must be <= 0")
    _check_finite(steps.field("reward").to_numpy(zero_copy_only=True), "steps.reward")
    _check_finite(batch.column("reward").to_numpy(zero_copy_only=True), "reward")
    _check_finite(batch.column("turn_rewards").values.to_numpy(zero_copy_only=True), "turn_rewards")
    _check_nonneg(steps.field("policy_version").to_numpy(zero_copy_only=True), "steps.policy_version")
    _check_nonneg(steps.field("turn").to_numpy(zero_copy_only=True), "steps.turn")
    _check_nonneg(batch.column("seq").to_numpy(zero_copy_only=True), "seq")

    # Parents point strictly backwards inside their own trajectory: 0 <= p < local index.
    par = steps.field("parents").values.to_numpy(zero_copy_only=True)
    if par.size:
        n_steps = len(steps)
        step_start = np.repeat(step_off[:-1], n_steps_per)  # [n_steps] first global step of its traj
        owner = np.repeat(np.arange(n_steps), np.diff(offs["parents"]))  # [n_parents] global step
        local = owner - step_start[owner]
        bad = (par < 0) | (par >= local)
        if bad.any():
            k = int(np.nonzero(bad)[0][0])
            raise SchemaMismatch(
                f"step {local[k]} of its trajectory names parent {par[k]}; parents must be earlier steps"
            )
    known = pc.is_in(steps.field("finish_reason"), value_set=pa.array(S.FINISH_REASONS))
    if not pc.all(known).as_py() and len(steps):
        raise SchemaMismatch(f"unknown finish_reason, expected one of {S.FINISH_REASONS}")
    return offs


def _from_batch(batch: pa.RecordBatch) -> list[GraphTrajectory]:
    offs = _check_fields(batch)
    steps = batch.column("steps").values
    step_off = offs["steps"].tolist()

    def strs(arr: pa.Array) -> list[str]:
        # Slicing one bytes object is ~5x faster than Array.to_pylist (no Arrow scalars); utf-8
        # is already checked by validate(full=True). Repeated values (agent ids) share one str.
        if len(arr) == 0:  # a zero-length array may legally have an empty offsets buffer
            return []
        # count/offset, not a whole-buffer view: Arrow buffers may be longer (and oddly sized).
        off = np.frombuffer(arr.buffers()[1], np.int32, count=len(arr) + 1, offset=4 * arr.offset).tolist()
        data = arr.buffers()[2]
        raw = data.to_pybytes() if data is not None else b""
        cache: dict[bytes, str] = {}
        out = []
        for a, b in zip(off[:-1], off[1:], strict=True):
            piece = raw[a:b]
            v = cache.get(piece)
            if v is None:
                v = cache[piece] = piece.decode()
            out.append(v)
        return out

    def nums(arr: pa.Array) -> list:
        return arr.to_numpy(zero_copy_only=True).tolist()

    token_views = {}
    for name in ("parents", "prompt_ids", "response_ids", "logprobs"):
        token_views[name] = (steps.field(name).values.to_numpy(zero_copy_only=True), offs[name].tolist())
    tc = steps.field("tool_calls").values
    tc_name, tc_args, tc_res = strs(tc.field(0)), strs(tc.field(1)), strs(tc.field(2))
    tc_off = offs["tool_calls"].tolist()
    cols = {
        f.name: (strs if pa.types.is_string(f.type) else nums)(steps.field(f.name))
        for f in S.STEP_TYPE
        if f.name not in token_views and f.name != "tool_calls"
    }
    out_steps: list[AgentStep] = []
    for i in range(len(steps)):
        views = {name: v[o[i] : o[i + 1]] for name, (v, o) in token_views.items()}
        out_steps.append(
            AgentStep(
                agent_id=cols["agent_id"][i],
                role=cols["role"][i],
                model_id=cols["model_id"][i],
                adapter=cols["adapter"][i],
                policy_version=cols["policy_version"][i],
                turn=cols["turn"][i],
                finish_reason=cols["finish_reason"][i],
                reward=cols["reward"][i],
                response_text=cols["response_text"][i],
                t_start=cols["t_start"][i],
                t_end=cols["t_end"][i],
                tool_calls=[
                    ToolCall(tc_name[j], tc_args[j], tc_res[j]) for j in range(tc_off[i], tc_off[i + 1])
                ],
                **views,
            )
        )
    meta = batch.column("metadata")
    mk, mv, mo = strs(meta.keys), strs(meta.items), offs["metadata"].tolist()
    tr_vals, tr_off = batch.column("turn_rewards").values.to_numpy(zero_copy_only=True), offs["turn_rewards"]
    top = {name: strs(batch.column(name)) for name in ("episode_id", "incarnation", "task_id")}
    top.update({name: strs(batch.column(name)) for name in ("group_id", "workflow")})
    top.update({name: nums(batch.column(name)) for name in ("seq", "reward")})
    out: list[GraphTrajectory] = []
    for r in range(batch.num_rows):
        metadata = dict(zip(mk[mo[r] : mo[r + 1]], mv[mo[r] : mo[r + 1]], strict=True))
        if len(metadata) != mo[r + 1] - mo[r]:
            raise SchemaMismatch(f"trajectory {r}: duplicate metadata keys")
        out.append(
            GraphTrajectory(
                episode_id=top["episode_id"][r],
                incarnation=top["incarnation"][r],
                seq=top["seq"][r],
                task_id=top["task_id"][r],
                group_id=top["group_id"][r],
                workflow=top["workflow"][r],
                reward=top["reward"][r],
                steps=out_steps[step_off[r] : step_off[r + 1]],
                turn_rewards=tr_vals[tr_off[r] : tr_off[r + 1]],
                metadata=metadata,
            )
        )
    return out


def decode_trajectories(data: bytes | bytearray | memoryview | pa.Buffer) -> list[GraphTrajectory]:
    """Decode foreign Arrow IPC bytes into trajectories (zero-copy, read-only token views).

    Raises a ``ProtocolError`` subclass (and counts it by ``reason``) on anything invalid.
    """
    try:
        size = data.size if isinstance(data, pa.Buffer) else memoryview(data).nbytes
        if size > S.MAX_FRAME_BYTES:
            raise FrameTooLarge(f"frame is {size} bytes, cap is {S.MAX_FRAME_BYTES}")
        buf = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
        out: list[GraphTrajectory] = []
        for batch in _iter_batches(buf):
            out.extend(_from_batch(batch))
        return out
    except ProtocolError as e:
        count_rejection(e.reason)
        raise
