"""ZeroMQ transport on loopback: credit backpressure, at-least-once across a receiver restart with
de-duplication, CURVE allow-list, RPC with timeouts, weights announcements with gap healing."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from teamrl.protocol.control import (
    BufferStats,
    BufferStatsRequest,
    ErrorReply,
    Probe,
    ProfilesPublished,
    SampleReply,
    SampleRequest,
    UriWeights,
    WeightsPublished,
)
from teamrl.protocol.errors import PeerTimeout
from teamrl.protocol.metrics import rejected_count
from teamrl.protocol.ports import free_port
from teamrl.protocol.transport import CurveKeys
from teamrl.protocol.zmq_transport import (
    RpcClient,
    RpcServer,
    WeightsPublisher,
    WeightsSubscriber,
    ZmqDataReceiver,
    ZmqDataSender,
)

FAST_HB = {"heartbeat_ivl_ms": 200, "heartbeat_timeout_ms": 1000}


def test_backpressure_blocks_the_fast_producer():
    n, window = 120, 8
    recv = ZmqDataReceiver("tcp://127.0.0.1:0", hwm=16, **FAST_HB)
    outstanding: list[int] = []
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            sender = ZmqDataSender(recv.endpoint, "fast", window=window, ack_timeout_s=30, **FAST_HB)
            for i in range(n):
                sender.send(i.to_bytes(4, "little") * 25_000)  # 100 kB
                outstanding.append(sender.unacked)
            assert sender.flush(20)
            assert sender.close() == 0
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    t = threading.Thread(target=produce)
    t.start()
    got = []
    while len(got) < n:
        frame = recv.recv(5000)
        assert frame is not None, "receiver starved"
        time.sleep(0.002)  # a consumer ~10x slower than the producer
        got.append(int.from_bytes(frame.payload[:4], "little"))
        recv.ack(frame)
    t.join(30)
    recv.close()
    assert not errors, errors
    assert got == list(range(n))  # sent == received, in order, nothing duplicated
    assert max(outstanding) <= window  # the producer never ran ahead of its credit


def test_receiver_restart_loses_nothing_and_dedups():
    n = 80
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    persisted: list[int] = []
    done = threading.Event()
    result: dict[str, object] = {}

    def produce() -> None:
        sender = ZmqDataSender(endpoint, "inc-A", window=10, ack_timeout_s=0.3, **FAST_HB)
        for i in range(n):
            sender.send(i.to_bytes(4, "little"))
        result["flushed"] = sender.flush(30)
        result["resent"] = sender.resent
        sender.close()
        done.set()

    recv = ZmqDataReceiver(endpoint, **FAST_HB)
    t = threading.Thread(target=produce)
    t.start()
    delivered = 0
    while delivered < 25:
        frame = recv.recv(5000)
        assert frame is not None
        delivered += 1
        if delivered <= 20:  # the last 5 are received but never persisted: lost in the crash
            persisted.append(frame.seq)
            recv.ack(frame)
    recv.close()  # "crash"

    recv = ZmqDataReceiver(endpoint, **FAST_HB)
    recv.restore("inc-A", persisted)  # what the checkpoint says is durable
    while not done.is_set() or len(set(persisted)) < n:
        frame = recv.recv(200)
        if frame is None:
            if done.is_set():
                break
            continue
        persisted.append(frame.seq)
        recv.ack(frame)
    t.join(30)
    recv.close()
    assert result["flushed"] is True
    assert sorted(persisted) == list(range(n))  # nothing lost, nothing duplicated
    assert result["resent"] > 0


def test_duplicate_of_durable_frame_is_reacked_not_delivered():
    recv = ZmqDataReceiver("tcp://127.0.0.1:0")
    recv.restore("inc-B", [0, 1])
    sender = ZmqDataSender(recv.endpoint, "inc-B", window=4, ack_timeout_s=30)
    sender.send(b"seq 0 again")  # e.g. resent because the ack was lost in a receiver crash
    assert recv.recv(300) is None  # duplicate: counted, not returned
    assert recv.duplicates == 1
    assert sender.flush(3)  # re-acked, so the sender forgets it
    sender.close()
    recv.close()


@pytest.fixture()
def keys():
    server_pub, server_sec = zmq.curve_keypair()
    good_pub, good_sec = zmq.curve_keypair()
    bad_pub, bad_sec = zmq.curve_keypair()
    return {
        "server": CurveKeys(public=server_pub, secret=server_sec, allowed_clients=frozenset({good_pub})),
        "good": CurveKeys(public=good_pub, secret=good_sec, server_public=server_pub),
        "bad": CurveKeys(public=bad_pub, secret=bad_sec, server_public=server_pub),
    }


def test_curve_admits_only_the_allow_list(keys):
    recv = ZmqDataReceiver("tcp://127.0.0.1:0", curve=keys["server"])
    denied_before = rejected_count("auth_denied")
    intruders = [
        ZmqDataSender(recv.endpoint, "unknown-key", curve=keys["bad"], ack_timeout_s=30),
        ZmqDataSender(recv.endpoint, "null-client", ack_timeout_s=30),
    ]
    for s in intruders:
        s.send(b"let me in")
    assert recv.recv(700) is None  # nothing from them reaches the application
    friend = ZmqDataSender(recv.endpoint, "friend", curve=keys["good"], ack_timeout_s=30)
    friend.send(b"hello")
    frame = recv.recv(3000)
    assert frame is not None and frame.incarnation == "friend" and bytes(frame.payload) == b"hello"
    recv.ack(frame)
    assert friend.flush(3)
    assert recv.recv(300) is None
    assert rejected_count("auth_denied") > denied_before
    for s in [*intruders, friend]:
        s.close()
    recv.close()


def test_curve_client_needs_server_key(keys):
    with pytest.raises(ValueError, match="server's public key"):
        ZmqDataSender(
            "tcp://127.0.0.1:1", "x", curve=CurveKeys(public=keys["good"].public, secret=keys["good"].secret)
        )


def test_rpc_round_trip_errors_and_timeout():
    def handler(msg):
        if isinstance(msg, SampleRequest) and msg.batch_size == 13:
            raise RuntimeError("unlucky")
        return BufferStats(size=7)

    server = RpcServer("tcp://127.0.0.1:0", handler)
    stop = threading.Event()
    t = threading.Thread(target=server.serve_forever, args=(stop, 20))
    t.start()
    client = RpcClient(server.endpoint, timeout_ms=3000)
    assert client.call(BufferStatsRequest()) == BufferStats(size=7)
    err = client.call(SampleRequest(request_id=1, batch_size=13, rank=0))
    assert isinstance(err, ErrorReply) and err.reason == "handler_error"
    assert client.call(BufferStatsRequest()).size == 7  # still serving
    stop.set()
    t.join(5)
    server.close()
    client.close()
    lonely = RpcClient(f"tcp://127.0.0.1:{free_port()}", timeout_ms=200)
    with pytest.raises(PeerTimeout):
        lonely.call(BufferStatsRequest())
    lonely.close()


def test_a_sample_reply_crosses_rpc_with_its_arrow_frame_uncopied():
    from teamrl.protocol.codec import decode_batches, encode_trajectories_buffer
    from teamrl.protocol.examples import example_trajectories

    trajs = example_trajectories(3, seed=1, tokens=8)
    frame = encode_trajectories_buffer(trajs)
    server = RpcServer("tcp://127.0.0.1:0", lambda m: SampleReply.carrying(frame, request_id=9, count=3))
    stop = threading.Event()
    t = threading.Thread(target=server.serve_forever, args=(stop, 20))
    t.start()
    client = RpcClient(server.endpoint, timeout_ms=3000)
    try:
        reply = client.call(SampleRequest(request_id=9, batch_size=3, rank=0))
        assert isinstance(reply, SampleReply) and reply.nbytes == frame.size
        assert isinstance(reply.trajectories, memoryview)  # the received frame's memory, not bytes
        (batch,) = decode_batches(reply.trajectories)
        assert [t.episode_id for t in batch.trajectories()] == [t.episode_id for t in trajs]
    finally:
        stop.set()
        t.join(5)
        server.close()
        client.close()


def _weights(version: int) -> WeightsPublished:
    return WeightsPublished(
        announce_seq=0,
        version=version,
        adapters={"solver": f"solver-v{version}"},
        location=UriWeights(uri=f"file:///shared/adapters/v{version}"),
        sha256="0" * 64,
        probe=Probe(prompt_ids=[1, 2], completion_ids=[3], expected_logprobs=[-0.5]),
    )


def test_weights_gap_is_healed_from_latest_endpoint():
    pub = WeightsPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    pub.publish(_weights(1))  # nobody listens: PUB drops it
    sub = WeightsSubscriber(pub.pub_endpoint, pub.latest_endpoint)
    assert sub.latest().version == 1  # start-up: ask explicitly
    time.sleep(0.3)  # SUB joins
    pub.publish(_weights(2))
    got = sub.poll(3000)
    assert got is not None and got.version == 2 and got.announce_seq == 1
    assert sub.gaps == 1  # seq 1 seen before seq 0: a gap, healed via the latest endpoint
    pub.publish(_weights(3))
    got = sub.poll(3000)
    assert got.version == 3 and sub.gaps == 1
    sub.close()
    pub.close()


def test_a_gap_whose_latest_endpoint_does_not_answer_yields_the_announcement():
    """A just-restarted learner may not answer its latest endpoint in time: the subscriber takes the
    announcement it has (counted as a gap) instead of raising out of ``poll`` (a rollout's weights
    loop would end there)."""
    from teamrl.protocol.control import pack_message

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = WeightsSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_port()}", timeout_ms=300)
    try:
        time.sleep(0.3)  # SUB joins
        late = _weights(4).model_copy(update={"announce_seq": 5})  # seq 0-4 never seen: a gap
        pub.send_multipart([WeightsPublisher.TOPIC, pack_message(late)])
        got = sub.poll(3000)
        assert got is not None and got.version == 4 and sub.gaps == 1
    finally:
        sub.close()
        pub.close(0)
        ctx.term()


def test_a_restarted_publisher_is_followed_from_its_first_newer_version():
    """A learner that restarts counts ``announce_seq`` from 0 again: its announcements must not be
    taken for replays of the old process's (they were, and each new version then waited for the
    rollout's latest-endpoint poll); the restart is counted once (the rollout's version budget
    refills on it). The new PUB's first announcements are lost while SUB reconnects."""
    pub_ep, latest_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = WeightsPublisher(pub_ep, latest_ep)
    sub = WeightsSubscriber(pub_ep, latest_ep)
    time.sleep(0.3)  # SUB joins
    for v in (1, 2, 3):
        pub.publish(_weights(v))
    got = [sub.poll(2000) for _ in range(3)]
    assert [m.version for m in got] == [1, 2, 3] and sub.publisher_restarts == 0
    pub.close()
    pub = WeightsPublisher(pub_ep, latest_ep)  # the restarted learner, resumed at v3
    pub.publish(_weights(3))  # its re-announcement of the version it resumed: nothing new
    version, got = 3, None
    while got is None and version < 40:
        version += 1
        pub.publish(_weights(version))
        got = sub.poll(300)
    assert got is not None and got.version == version and sub.publisher_restarts == 1
    assert sub.accept(got) is None  # the same announcement again is a replay
    pub.publish(_weights(version + 1))
    got = sub.poll(2000)
    assert got.version == version + 1 and sub.publisher_restarts == 1
    sub.close()
    pub.close()


def _profiles(version: int) -> ProfilesPublished:
    from teamrl.rewards.profiles import profiles_sha256

    profiles = {"solver": f"You solve. Revision {version}."}
    return ProfilesPublished(version=version, profiles=profiles, sha256=profiles_sha256(version, profiles))


def test_profiles_travel_beside_weights_and_a_gap_is_healed():
    pub = WeightsPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    sub = WeightsSubscriber(pub.pub_endpoint, pub.latest_endpoint)
    assert sub.latest_profiles() is None  # nothing yet: an ErrorReply, read as None
    pub.publish_profiles(_profiles(0))
    assert sub.latest_profiles().version == 0  # start-up: ask explicitly
    time.sleep(0.3)  # SUB joins
    pub.publish_profiles(_profiles(1))
    pub.publish(_weights(1))
    got = sub.poll(3000)  # the profile announcement comes first and is kept aside
    deadline = time.time() + 3
    while got is None and time.time() < deadline:
        got = sub.poll(200)
    assert got is not None and got.version == 1  # poll still returns weights only
    taken = sub.take_profiles()
    assert taken is not None and taken.version == 1 and sub.take_profiles() is None
    pub._latest_profiles = _profiles(2)  # v2 "lost" on PUB; v3 arrives: a gap, healed via latest
    pub.publish_profiles(_profiles(3))
    deadline = time.time() + 3
    while (taken := sub.take_profiles()) is None and time.time() < deadline:
        sub.poll(200)
    assert taken.version == 3 and sub.gaps == 1
    with pytest.raises(ValueError, match="only go up"):
        pub.publish_profiles(_profiles(3))
    sub.close()
    pub.close()
