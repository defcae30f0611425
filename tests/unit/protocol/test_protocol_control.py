"""Control messages: hypothesis round trip of every message type, typed and counted rejections."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from teamrl.protocol import control as C
from teamrl.protocol.errors import DecodeError, FrameTooLarge, SchemaMismatch
from teamrl.protocol.metrics import rejected_count

ids = st.text(min_size=1, max_size=20)
seq = st.integers(0, 2**63 - 1)
floats = st.floats(allow_nan=False)
token = st.integers(0, 2**31 - 1)


@st.composite
def probes(draw: st.DrawFn) -> C.Probe:
    n = draw(st.integers(1, 6))
    return C.Probe(
        prompt_ids=draw(st.lists(token, min_size=1, max_size=6)),
        completion_ids=draw(st.lists(token, min_size=n, max_size=n)),
        expected_logprobs=draw(st.lists(floats, min_size=n, max_size=n)),
        atol=draw(st.floats(1e-6, 1.0)),
    )


STRATEGIES = {
    C.Hello: st.builds(
        C.Hello,
        service=st.sampled_from(["rollout", "buffer", "learner", "orchestrator"]),
        incarnation=ids,
        capabilities=st.lists(st.text(max_size=10), max_size=3),
    ),
    C.Heartbeat: st.builds(C.Heartbeat, incarnation=ids, seq=seq, time=floats, load=floats),
    C.Ack: st.builds(
        C.Ack,
        incarnation=ids,
        seqs=st.lists(seq, max_size=5),
        rejected=st.lists(seq, max_size=3),
        reason=st.text(),
    ),
    C.WeightsPublished: st.builds(
        C.WeightsPublished,
        announce_seq=seq,
        version=seq,
        adapters=st.dictionaries(ids, ids, max_size=3),
        location=st.one_of(
            st.builds(C.InlineWeights, chunks=st.lists(st.binary(max_size=50), max_size=3)),
            st.builds(C.UriWeights, uri=ids),
        ),
        sha256=st.text("0123456789abcdef", min_size=64, max_size=64),
        probe=probes(),
        base_model=st.text(max_size=20),
    ),
    C.LatestWeightsRequest: st.builds(C.LatestWeightsRequest, have_version=st.integers(-1, 10**9)),
    C.ProfilesPublished: st.builds(
        C.ProfilesPublished,
        version=seq,
        profiles=st.dictionaries(ids, st.text(max_size=60), max_size=3),
        sha256=st.text("0123456789abcdef", min_size=64, max_size=64),
    ),
    C.LatestProfilesRequest: st.builds(C.LatestProfilesRequest, have_version=st.integers(-1, 10**9)),
    C.Drain: st.builds(C.Drain, reason=st.text(), deadline_s=st.floats(0, 1e6)),
    C.Shutdown: st.builds(C.Shutdown, reason=st.text()),
    C.BufferStatsRequest: st.just(C.BufferStatsRequest()),
    C.BufferStats: st.builds(
        C.BufferStats,
        size=seq,
        per_agent=st.dictionaries(ids, seq, max_size=3),
        inserted=seq,
        sampled=seq,
        rejected=seq,
        evicted=seq,
        min_policy_version=st.integers(-1, 10**6),
        max_policy_version=st.integers(-1, 10**6),
    ),
    C.SampleRequest: st.builds(
        C.SampleRequest,
        request_id=seq,
        agent_id=st.one_of(st.none(), ids),
        batch_size=st.integers(1, 65_536),
        rank=st.integers(0, 1024),
        min_policy_version=st.integers(-1, 10**6),
    ),
    C.VersionAnnounce: st.builds(
        C.VersionAnnounce,
        model_id=st.one_of(st.none(), ids),
        version=seq,
        agent_ids=st.lists(ids, max_size=4),
    ),
    C.SampleReply: st.builds(
        C.SampleReply,
        request_id=seq,
        nbytes=seq,
        count=seq,
        weights=st.lists(floats, max_size=4),
    ),
    C.ErrorReply: st.builds(
        C.ErrorReply, request_id=st.integers(-1, 2**40), reason=st.text(), message=st.text()
    ),
}


def test_every_message_type_has_a_strategy():
    assert set(STRATEGIES) == set(C.MESSAGE_TYPES)


@settings(max_examples=60, deadline=None)
@given(st.one_of(*STRATEGIES.values()))
def test_round_trip_property(msg):
    assert C.unpack_message(C.pack_message(msg)) == msg


@pytest.mark.parametrize("cls", C.MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_round_trip_each_type(cls):
    @settings(max_examples=25, deadline=None)
    @given(STRATEGIES[cls])
    def check(msg):
        back = C.unpack_message(C.pack_message(msg))
        assert type(back) is cls and back == msg

    check()


def _raw(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", DecodeError),
        (b"\xc1", DecodeError),
        (b"\x91" * 100_000, DecodeError),  # nesting bomb: msgpack's stack limit, not a recursion crash
        (_raw([1, 2]), SchemaMismatch),
        (_raw({1: 2}), DecodeError),  # strict_map_key
        (_raw({"type": "nope"}), SchemaMismatch),
        (_raw({"type": "heartbeat", "incarnation": "a", "seq": "1", "time": 0.0}), SchemaMismatch),  # strict
        (_raw({"type": "heartbeat", "incarnation": "a", "seq": -1, "time": 0.0}), SchemaMismatch),
        (_raw({"type": "drain", "surprise": 1}), SchemaMismatch),  # extra fields forbidden
        (_raw({"type": "hello", "service": "rollout", "incarnation": b"\xff"}), SchemaMismatch),
        (msgpack.packb({"type": "ack"}) + b"\x00", DecodeError),  # trailing bytes
    ],
)
def test_rejections_are_typed_and_counted(data, error):
    before = rejected_count(error.reason)
    with pytest.raises(error):
        C.unpack_message(data)
    assert rejected_count(error.reason) == before + 1


def test_probe_lengths_must_agree():
    bad = {"prompt_ids": [1], "completion_ids": [2, 3], "expected_logprobs": [-1.0], "atol": 0.1}
    msg = {
        "type": "weights_published",
        "announce_seq": 0,
        "version": 0,
        "adapters": {},
        "location": {"kind": "uri", "uri": "x"},
        "sha256": "0" * 64,
        "probe": bad,
        "base_model": "",
    }
    with pytest.raises(SchemaMismatch, match="probe"):
        C.unpack_message(_raw(msg))


def test_oversize_refused_before_unpacking(monkeypatch):
    monkeypatch.setattr(C, "MAX_CONTROL_BYTES", 10)
    with pytest.raises(FrameTooLarge):
        C.unpack_message(C.pack_message(C.Drain(reason="a long enough reason")))


def test_pack_refuses_non_messages():
    with pytest.raises(TypeError):
        C.pack_message({"type": "drain"})  # type: ignore[arg-type]


def test_a_sample_reply_carries_its_arrow_stream_as_a_frame_of_its_own():
    data = bytes(range(40))
    reply = C.SampleReply.carrying(data, request_id=3, count=1, weights=[0.5])
    header, *frames = C.frames_of(reply)
    assert data not in header and len(frames) == 1 and frames[0] is data  # not inside msgpack
    back = C.unpack_message(header, [memoryview(data)])
    assert isinstance(back, C.SampleReply) and back.nbytes == 40 and bytes(back.trajectories) == data
    assert C.unpack_message(C.pack_message(C.Drain()), []) == C.Drain()  # no frames declared, none came


@pytest.mark.parametrize(
    ("frames", "match"),
    [([], "1 attached frame"), ([b"x" * 39], r"\[40\] bytes"), ([b"x" * 40, b"y"], "2 came")],
)
def test_attached_frames_must_be_exactly_the_declared_ones(frames, match):
    header = C.pack_message(C.SampleReply(request_id=1, nbytes=40, count=1))
    before = rejected_count("decode_error")
    with pytest.raises(DecodeError, match=match):
        C.unpack_message(header, frames)
    assert rejected_count("decode_error") == before + 1
    with pytest.raises(DecodeError, match="declares 0"):
        C.unpack_message(C.pack_message(C.Drain()), [b"extra"])
    with pytest.raises(DecodeError, match="without its Arrow frame"):
        _ = C.unpack_message(header).trajectories  # the header alone hands out no stream
