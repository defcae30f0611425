"""Arrow codec: round trips (hypothesis), zero-copy views, and a typed, counted rejection per bad field."""

from __future__ import annotations

import collections
import dataclasses
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_strategies import assert_same, trajectories

from teamrl.protocol import (
    AgentStep,
    DecodeError,
    FrameTooLarge,
    ProtocolError,
    SchemaMismatch,
    decode_trajectories,
    encode_trajectories,
    example_trajectories,
)
from teamrl.protocol import schema as S
from teamrl.protocol.codec import (
    TrajectoryBatch,
    decode_batches,
    decode_record_batches,
    encode_rows,
    rows_record_batch,
    to_record_batch,
)
from teamrl.protocol.metrics import rejected_count


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(trajectories(), max_size=4))
def test_round_trip_property(trajs):
    out = decode_trajectories(encode_trajectories(trajs))
    assert len(out) == len(trajs)
    for a, b in zip(trajs, out, strict=True):
        assert_same(a, b)


def test_examples_are_valid_and_realistic():
    trajs = example_trajectories(8, seed=3, tokens=512)
    for t in trajs:
        assert 2 <= len(t.agents) <= 3
        assert len({s.turn for s in t.steps}) >= 2
        for i, s in enumerate(t.steps):
            assert all(p < i for p in s.parents)
            assert len(s.response_ids) == len(s.logprobs)
    assert 300 < np.mean([len(s.prompt_ids) + len(s.response_ids) for t in trajs for s in t.steps]) < 700
    assert example_trajectories(2, seed=3)[0].steps[0].prompt_ids.tolist() == (
        example_trajectories(2, seed=3)[0].steps[0].prompt_ids.tolist()
    )


def test_decode_gives_zero_copy_read_only_views():
    frame = encode_trajectories(example_trajectories(2, seed=1))
    out = decode_trajectories(frame)
    ids = out[0].steps[0].prompt_ids
    assert ids.dtype == np.int32 and not ids.flags.writeable
    # the view's memory lies inside the frame's bytes: no copy was made
    base = np.frombuffer(frame, dtype=np.uint8).ctypes.data
    assert base <= ids.ctypes.data < base + len(frame)


def _batch_bytes(batch: pa.RecordBatch, schema: pa.Schema | None = None) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema or batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _mutate_column(batch: pa.RecordBatch, step_field: str, fn) -> bytes:
    """Replace one field of the step struct by fn(old_array) and re-encode without checks."""
    steps = batch.column("steps")
    struct = steps.values
    fields = list(S.STEP_TYPE)
    children = [
        fn(struct.field(i)) if f.name == step_field else struct.field(i) for i, f in enumerate(fields)
    ]
    new_struct = pa.StructArray.from_arrays(children, fields=fields)
    new_steps = pa.ListArray.from_arrays(
        steps.offsets, new_struct, type=S.TRAJECTORY_SCHEMA.field("steps").type
    )
    cols = [new_steps if n == "steps" else batch.column(n) for n in batch.schema.names]
    return _batch_bytes(pa.RecordBatch.from_arrays(cols, schema=S.TRAJECTORY_SCHEMA))


def _list_of(arr_values: np.ndarray, offsets: np.ndarray, like: pa.ListArray) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(arr_values), type=like.type)


def _bad_logprob_lengths(col: pa.ListArray) -> pa.ListArray:
    vals = col.values.to_numpy()
    return _list_of(
        np.append(vals, np.float32(-1.0)), np.append(col.offsets.to_numpy()[:-1], len(vals) + 1), col
    )


def _bad_parents(col: pa.ListArray) -> pa.ListArray:
    off = col.offsets.to_numpy().copy()
    vals = np.append(col.values.to_numpy(), np.int32(0))
    off[1:] += 1  # step 0 now has a parent (0): points at itself, not backwards
    return _list_of(np.concatenate([[0], vals[:-1]]).astype(np.int32), off, col)


def _negate(col: pa.Array) -> pa.Array:
    return pa.array(-1 - col.to_numpy(), type=col.type)


def _nan_logprob(col: pa.ListArray) -> pa.ListArray:
    vals = col.values.to_numpy().copy()
    vals[0] = np.nan
    return _list_of(vals, col.offsets.to_numpy(), col)


def _unknown_finish(col: pa.Array) -> pa.Array:
    return pa.array(["exploded"] * len(col), pa.string())


@pytest.mark.parametrize(
    ("step_field", "fn", "error", "needle"),
    [
        ("logprobs", _bad_logprob_lengths, SchemaMismatch, "log-probs"),
        ("parents", _bad_parents, SchemaMismatch, "parent"),
        ("policy_version", _negate, SchemaMismatch, "policy_version"),
        ("turn", _negate, SchemaMismatch, "turn"),
        ("logprobs", _nan_logprob, SchemaMismatch, "NaN"),
        ("finish_reason", _unknown_finish, SchemaMismatch, "finish_reason"),
    ],
)
@pytest.mark.parametrize("decode", [decode_trajectories, decode_record_batches])
def test_field_checks_reject_with_reason(step_field, fn, error, needle, decode):
    batch = to_record_batch(example_trajectories(3, seed=5))
    frame = _mutate_column(batch, step_field, fn)
    before = rejected_count(error.reason)
    with pytest.raises(error, match=needle):
        decode(frame)
    assert rejected_count(error.reason) == before + 1


def test_decode_record_batches_returns_the_validated_batch_zero_copy():
    trajs = example_trajectories(5, seed=2)
    frame = encode_trajectories(trajs)
    (batch,) = decode_record_batches(frame)
    assert batch.equals(to_record_batch(trajs))
    ids = batch.column("steps").values.field("prompt_ids").values.to_numpy()
    base = np.frombuffer(frame, dtype=np.uint8).ctypes.data
    assert base <= ids.ctypes.data < base + len(frame)


def test_rejects_duplicate_metadata_keys():
    batch = to_record_batch(example_trajectories(2, seed=0))
    meta = pa.MapArray.from_arrays(
        pa.array([0, 2, 3], pa.int32()),
        pa.array(["split", "split", "x"]),
        pa.array(["a", "b", "c"]),
        type=S.TRAJECTORY_SCHEMA.field("metadata").type,
    )
    cols = [meta if n == "metadata" else batch.column(n) for n in batch.schema.names]
    frame = _batch_bytes(pa.RecordBatch.from_arrays(cols, schema=S.TRAJECTORY_SCHEMA))
    for decode in (decode_trajectories, decode_record_batches):
        with pytest.raises(SchemaMismatch, match="trajectory 0: duplicate metadata key 'split'"):
            decode(frame)


def test_encode_casts_lists_and_wider_dtypes_like_astype():
    t = example_trajectories(1, seed=0)[0]
    t.steps[0].prompt_ids = [5, 6, 7]
    t.steps[0].parents = []
    t.steps[1].response_ids = t.steps[1].response_ids.astype(np.int64)
    t.steps[1].logprobs = t.steps[1].logprobs.astype(np.float64)
    t.turn_rewards = [0.5, 1.0]
    (out,) = decode_trajectories(encode_trajectories([t]))
    assert out.steps[0].prompt_ids.dtype == np.int32 and out.steps[0].prompt_ids.tolist() == [5, 6, 7]
    assert out.steps[1].response_ids.dtype == np.int32 and out.steps[1].logprobs.dtype == np.float32
    np.testing.assert_array_equal(out.turn_rewards, np.float32([0.5, 1.0]))
    assert decode_trajectories(encode_trajectories([])) == []


def test_agent_step_fields_follow_step_type_order():
    # decode builds AgentStep positionally from the STEP_TYPE columns
    assert [f.name for f in dataclasses.fields(AgentStep)] == S.STEP_TYPE.names


def test_rejects_other_schema_version_and_shape():
    batch = to_record_batch(example_trajectories(1, seed=0))
    other = S.TRAJECTORY_SCHEMA.with_metadata({S.SCHEMA_VERSION_KEY: b"999"})
    with pytest.raises(SchemaMismatch, match="version"):
        decode_trajectories(_batch_bytes(batch.replace_schema_metadata(other.metadata), other))
    narrow = pa.record_batch({"episode_id": pa.array(["x"])}).replace_schema_metadata(
        S.TRAJECTORY_SCHEMA.metadata
    )
    with pytest.raises(SchemaMismatch, match="schema differs"):
        decode_trajectories(_batch_bytes(narrow))


def test_rejects_garbage_truncation_and_oversize(monkeypatch):
    frame = encode_trajectories(example_trajectories(2, seed=0))
    for bad in (b"", b"hello world", frame[: len(frame) // 2], frame[:-9]):
        with pytest.raises(ProtocolError):
            decode_trajectories(bad)
    monkeypatch.setattr(S, "MAX_FRAME_BYTES", 100)
    with pytest.raises(FrameTooLarge):
        decode_trajectories(frame)


def test_rejects_compressed_batches_before_decompressing():
    batch = to_record_batch(example_trajectories(1, seed=0))
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, S.TRAJECTORY_SCHEMA, options=opts) as w:
        w.write_batch(batch)
    with pytest.raises(SchemaMismatch, match="compressed"):
        decode_trajectories(sink.getvalue().to_pybytes())


def test_rejects_nulls():
    batch = to_record_batch(example_trajectories(1, seed=0))
    cols = [pa.array([None], pa.string()) if n == "task_id" else batch.column(n) for n in batch.schema.names]
    frame = _batch_bytes(pa.RecordBatch.from_arrays(cols, schema=S.TRAJECTORY_SCHEMA))
    with pytest.raises((SchemaMismatch, DecodeError), match="null|Null"):
        decode_trajectories(frame)


def test_encode_refuses_invalid_trajectories():
    t = example_trajectories(1, seed=0)[0]
    t.steps[0].logprobs = t.steps[0].logprobs[:-1]
    with pytest.raises(SchemaMismatch):
        encode_trajectories([t])


def test_import_loads_no_torch_or_vllm():
    code = (
        "import sys, teamrl.protocol, teamrl.protocol.control, teamrl.protocol.transport;"
        "heavy = [m for m in ('torch', 'vllm', 'deepspeed', 'transformers') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_decode_batches_routes_without_objects_and_builds_them_on_demand():
    trajs = example_trajectories(6, seed=4)
    trajs[1].steps = []  # a trajectory without steps has versions (default, default)
    frame = encode_trajectories(trajs)
    (batch,) = decode_batches(frame)
    assert len(batch) == 6 and batch._objects is None
    row = batch.rows()[2]
    t = trajs[2]
    versions = [s.policy_version for s in t.steps]
    assert (row.episode_id, row.group_id, row.reward) == (t.episode_id, t.group_id, t.reward)
    assert row.versions(-7) == (min(versions), max(versions))
    assert batch.rows()[1].versions(-7) == (-7, -7)
    assert row.steps_per_agent() == dict(collections.Counter(s.agent_id for s in t.steps))
    assert batch._objects is None  # nothing above built a step object
    assert_same(t, row.trajectory())
    # token views still point into the frame
    ids = row.trajectory().steps[0].prompt_ids
    base = np.frombuffer(frame, dtype=np.uint8).ctypes.data
    assert base <= ids.ctypes.data < base + len(frame)


def test_decode_batches_runs_every_check():
    batch = to_record_batch(example_trajectories(3, seed=5))
    frame = _mutate_column(batch, "parents", _bad_parents)
    before = rejected_count(SchemaMismatch.reason)
    with pytest.raises(SchemaMismatch, match="parent"):
        decode_batches(frame)
    assert rejected_count(SchemaMismatch.reason) == before + 1


def test_encode_rows_picks_rows_of_several_batches_in_order():
    a, b = example_trajectories(4, seed=1), example_trajectories(3, seed=2)
    (ba,) = decode_batches(encode_trajectories(a))
    bb = TrajectoryBatch.from_trajectories(b)
    whole = ba.rows()
    assert rows_record_batch(whole) is ba.record_batch  # a whole frame is kept as it arrived
    pick = [ba.rows()[3], ba.rows()[0], bb.rows()[2], ba.rows()[1]]
    out = decode_trajectories(encode_rows(pick))
    for want, got in zip([a[3], a[0], b[2], a[1]], out, strict=True):
        assert_same(want, got)
    assert decode_trajectories(encode_rows([])) == []
