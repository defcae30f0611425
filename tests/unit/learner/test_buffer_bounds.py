"""The attacks of an unauthenticated peer on loopback against the buffer, each with a bounded effect:
a sample hint of 2**62, a frame of policy version 2**62, an ordinary peer's Shutdown, tens of
thousands of fresh incarnations, an oversize frame. The service runs in this process and is driven
turn by turn, so each effect is measured exactly."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
import zmq

from teamrl.learner.buffer_config import BufferConfig
from teamrl.learner.buffer_service import BufferService
from teamrl.protocol import metrics
from teamrl.protocol.codec import encode_trajectories
from teamrl.protocol.control import BufferStatsRequest, ErrorReply, SampleRequest, Shutdown
from teamrl.protocol.examples import example_trajectories
from teamrl.protocol.zmq_transport import MAGIC, RpcClient, ZmqDataReceiver, ZmqDataSender


def _service(tmp_path: Path, **extra: object) -> BufferService:
    cfg = BufferConfig(
        bind="tcp://127.0.0.1:*",
        sample_bind="tcp://127.0.0.1:*",
        dir=tmp_path / "buffer",
        max_policy_lag=1000,
        checkpoint_interval_s=0.01,
        fsync=False,
        **extra,
    )
    return BufferService(cfg)


def _pump(svc: BufferService, until, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline
        svc.turn()


def _refused(reason: str) -> float:
    return metrics.REJECTED_FRAMES.labels(reason=reason)._value.get()


def _not_admin() -> float:
    return metrics.AUTH_REFUSED.labels(socket="buffer_rpc", reason="not_admin")._value.get()


def _versioned(version: int, seed: int) -> bytes:
    batch = example_trajectories(2, seed=seed, tokens=8)
    for t in batch:
        for s in t.steps:
            s.policy_version = version
    return encode_trajectories(batch)


def test_version_bounds_refuse_and_change_nothing(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    sender = ZmqDataSender(svc.receiver.endpoint, "rollout-good", window=4, ack_timeout_s=5)
    rpc = RpcClient(svc.rpc.endpoint, timeout_ms=5000)
    try:
        svc.buffer.announce(None, 3)  # the learner's version: the only source of the buffer's
        sender.send(_versioned(3, seed=1))
        _pump(svc, lambda: sender._pump(0) or sender.unacked == 0)
        held, version = svc.buffer.size, svc.buffer.current_version
        assert held == 2 and version == 3

        before = svc.buffer.rejected["policy_version_out_of_range"]
        for bad in (2**62, 2**31 - 1):
            evil = ZmqDataSender(svc.receiver.endpoint, f"rollout-evil-{bad}", window=4, ack_timeout_s=5)
            evil.send(_versioned(bad, seed=2))
            _pump(svc, lambda evil=evil: evil._pump(0) or evil.unacked == 0)  # negatively acked
            evil.close()
        reply = {}

        def ask() -> bool:
            reply["r"] = rpc.call(
                SampleRequest(request_id=1, batch_size=1, rank=0, min_policy_version=2**62), 50
            )
            return True

        _call_while_serving(svc, ask)
        assert isinstance(reply["r"], ErrorReply) and reply["r"].reason == "policy_version_out_of_range"
        assert svc.buffer.rejected["policy_version_out_of_range"] == before + 3
        svc.checkpoint(time.monotonic())
        state = svc.store.load()[0]
        assert (svc.buffer.size, svc.buffer.current_version, state["current_version"]) == (held, 3, 3)
    finally:
        sender.close()
        rpc.close()
        svc.close()


def _call_while_serving(svc: BufferService, call) -> None:
    """Run a blocking RPC call in a thread while this thread turns the service loop."""
    import threading

    done = threading.Event()
    err: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # reported below
            err.append(e)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    _pump(svc, done.is_set)
    assert not err, err


def test_shutdown_only_from_the_operator(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    rpc = RpcClient(svc.rpc.endpoint, timeout_ms=5000)
    admin = RpcClient(f"ipc://{(tmp_path / 'buffer').resolve() / 'admin.sock'}", timeout_ms=5000)
    try:
        refused_before = _not_admin()
        out = {}
        _call_while_serving(svc, lambda: out.setdefault("r", rpc.call(Shutdown(reason="evil"))))
        assert isinstance(out["r"], ErrorReply) and out["r"].reason == "not_admin"
        assert svc.stop_reason is None and _not_admin() == refused_before + 1
        _call_while_serving(svc, lambda: out.setdefault("a", admin.call(Shutdown(reason="operator"))))
        assert out["a"].type == "buffer_stats" and svc.stop_reason == "shutdown"
    finally:
        rpc.close()
        admin.close()
        svc.close()


def test_incarnations_are_bounded_and_evictions_counted() -> None:
    rx = ZmqDataReceiver("tcp://127.0.0.1:*", max_incarnations=100)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(rx.endpoint)
    evicted = metrics.DEDUP_EVICTIONS.labels(reason="count")._value.get()
    try:
        n = 3000  # the attack used 74,955; the bound does not depend on the number
        for i in range(n):
            dealer.send_multipart([struct.pack("<4sQ", MAGIC, 0) + f"inc-{i}".encode(), b"payload"])
        got = 0
        while got < n:
            frame = rx.recv(2000)
            assert frame is not None, got
            rx.reject(frame, "test")  # what the buffer does with an undecodable payload
            got += 1
        assert len(rx._seen) <= 100 and len(rx._peer) <= 100 and len(rx._pending) <= 100
        assert rx.evictions == n - 100
        assert metrics.DEDUP_EVICTIONS.labels(reason="count")._value.get() == evicted + n - 100
        assert len(rx.take_evicted()) == n - 100
        # Seqs far ahead of an incarnation's low watermark are refused, not tracked.
        far = _refused("seq_out_of_window")
        dealer.send_multipart([struct.pack("<4sQ", MAGIC, 2**40) + f"inc-{n - 1}".encode(), b"x"])
        assert rx.recv(500) is None and _refused("seq_out_of_window") == far + 1
    finally:
        dealer.close(0)
        ctx.term()
        rx.close()


def test_oversize_frame_is_counted_and_refused() -> None:
    rx = ZmqDataReceiver("tcp://127.0.0.1:*", max_msg_size=4096)
    sender = ZmqDataSender(rx.endpoint, "rollout-big", window=2, ack_timeout_s=5)
    before = _refused("frame_too_large")
    try:
        sender.send(b"x" * 100_000)  # above the receiver's cap, below libzmq's (cap + 1 MiB)
        assert rx.recv(1000) is None
        assert _refused("frame_too_large") == before + 1
        deadline = time.monotonic() + 5
        while sender.unacked and time.monotonic() < deadline:
            sender._pump(50)
        assert sender.unacked == 0  # negatively acked: the sender drops it instead of resending forever
    finally:
        sender.close()
        rx.close()


@pytest.mark.parametrize("kind", ["arrays", "maps"])
def test_nested_msgpack_bomb_on_the_rpc_socket(tmp_path: Path, kind: str) -> None:
    svc = _service(tmp_path)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(svc.rpc.endpoint)
    empty = b"\x90" if kind == "arrays" else b"\x80"
    inner = b"\xdd" + (65535).to_bytes(4, "big") + empty * 65535
    n = (15 * 1024 * 1024) // len(inner)  # 15 MB: under the RPC socket's 16 MiB cap
    bomb = b"\xdd" + n.to_bytes(4, "big") + inner * n
    try:
        dealer.send_multipart([b"", struct.pack("<Q", 7), bomb])
        t0 = time.monotonic()
        _pump(svc, lambda: dealer.poll(0))
        stalled = time.monotonic() - t0
        reply = dealer.recv_multipart()
        assert b"decode_error" in reply[2] or b"error" in reply[2]
        assert stalled < 2.0  # was 7.8 s (arrays) and 1.2 s (maps) with 1.2 GB built
        ok = {}
        client = RpcClient(svc.rpc.endpoint, timeout_ms=5000)
        _call_while_serving(svc, lambda: ok.setdefault("r", client.call(BufferStatsRequest())))
        client.close()
        assert ok["r"].type == "buffer_stats"
    finally:
        dealer.close(0)
        ctx.term()
        svc.close()


@pytest.mark.parametrize("agent_id", ["", "a" * 257])
def test_frame_with_an_unnameable_agent_id_is_refused(tmp_path: Path, agent_id: str) -> None:
    """Found by tests/unit/protocol/test_service_fuzz.py: one stored step with agent id "" made every
    later BufferStats reply (stats, Hello, Heartbeat) fail its schema (handler_error)."""
    svc = _service(tmp_path)
    sender = ZmqDataSender(svc.receiver.endpoint, "rollout-ids", window=4, ack_timeout_s=5)
    rpc = RpcClient(svc.rpc.endpoint, timeout_ms=5000)
    try:
        batch = example_trajectories(2, seed=4, tokens=8)
        batch[1].steps[0].agent_id = agent_id
        before = svc.buffer.rejected["invalid_agent_id"]
        sender.send(encode_trajectories(batch))
        _pump(svc, lambda: sender._pump(0) or sender.unacked == 0)
        assert sender.peer_rejected == 1 and svc.buffer.size == 0
        assert svc.buffer.rejected["invalid_agent_id"] == before + 1
        out = {}
        _call_while_serving(svc, lambda: out.setdefault("r", rpc.call(BufferStatsRequest())))
        assert out["r"].type == "buffer_stats"
    finally:
        sender.close()
        rpc.close()
        svc.close()
