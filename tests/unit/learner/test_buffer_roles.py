"""Authorisation by role on the buffer's RPC socket (docs/transport-security.md; the rights are
``teamrl.protocol.curve.BUFFER_RPC_RIGHTS``): with the run's CURVE keys, every (role, message) pair
outside the role's rights is refused with a typed ``ErrorReply`` (``not_authorised``, or
``not_admin`` for Drain/Shutdown), counted in ``teamrl_protocol_auth_refused_total``, logged once per
role and type per interval, and the buffer keeps serving; the allowed pairs still work. Without CURVE
roles cannot be told apart: everything but Drain/Shutdown gets through from any peer."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from test_buffer_bounds import _pump

from teamrl.learner.buffer_config import BufferConfig
from teamrl.learner.buffer_service import BufferService
from teamrl.protocol import metrics
from teamrl.protocol.codec import encode_trajectories
from teamrl.protocol.config import TransportConfig
from teamrl.protocol.control import (
    BufferStatsRequest,
    Drain,
    ErrorReply,
    Heartbeat,
    Hello,
    LatestWeightsRequest,
    SampleRequest,
    Shutdown,
    VersionAnnounce,
)
from teamrl.protocol.curve import BUFFER_RPC_RIGHTS, generate_run_keys
from teamrl.protocol.examples import example_trajectories
from teamrl.protocol.zmq_transport import RpcClient, ZmqDataSender

AUTH_REASONS = ("not_authorised", "not_admin")

MESSAGES = {
    "hello_rollout": Hello(service="rollout", incarnation="r-1"),
    "hello_learner": Hello(service="learner", incarnation="l-1"),
    "heartbeat": Heartbeat(incarnation="r-1", seq=0, time=0.0),
    "sample": SampleRequest(request_id=5, batch_size=1, rank=0),
    "stats": BufferStatsRequest(),
    "latest_weights": LatestWeightsRequest(),  # not a buffer request at all
    "drain": Drain(reason="test"),
    "shutdown": Shutdown(reason="test"),
    "announce": VersionAnnounce(version=0),
}
ALLOWED = {
    "rollout": {"hello_rollout", "heartbeat"},
    "learner": {"sample", "stats", "announce"},
    "admin": {"stats", "drain", "shutdown"},
}


def _count(reason: str) -> float:
    return metrics.AUTH_REFUSED.labels(socket="buffer_rpc", reason=reason)._value.get()


def _service(tmp_path: Path, transport: TransportConfig) -> BufferService:
    cfg = BufferConfig(
        bind="tcp://127.0.0.1:*",
        sample_bind="tcp://127.0.0.1:*",
        dir=tmp_path / "buffer",
        max_policy_lag=1000,
        checkpoint_interval_s=0.01,
        fsync=False,
    )
    return BufferService(cfg, transport)


def _serve_calls(svc: BufferService, calls: list) -> list:
    """Make ``calls`` (client, msg) one after another in a thread while this thread turns the loop."""
    out: list = []
    done = threading.Event()

    def run() -> None:
        try:
            for client, msg in calls:
                out.append(client.call(msg))
        except BaseException as e:  # reported below
            out.append(e)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    _pump(svc, done.is_set, timeout_s=60)
    assert not any(isinstance(r, BaseException) for r in out), out
    return out


def _fill(svc: BufferService, curve) -> None:
    sender = ZmqDataSender(svc.receiver.endpoint, "rollout-data", window=2, ack_timeout_s=5, curve=curve)
    try:
        sender.send(encode_trajectories(example_trajectories(4, seed=3, tokens=8)))
        _pump(svc, lambda: sender._pump(0) or sender.unacked == 0)
    finally:
        sender.close()
    assert svc.buffer.size == 4


def test_rights_table_matches_this_test() -> None:
    assert {r: {MESSAGES[m].type for m in ms} for r, ms in ALLOWED.items()} == {
        r: set(t) for r, t in BUFFER_RPC_RIGHTS.items()
    }


def test_each_role_may_send_only_its_messages(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = generate_run_keys(tmp_path / "curve")
    transport = TransportConfig(curve=True, curve_dir=keys)
    svc = _service(tmp_path, transport)
    clients = {
        role: RpcClient(svc.rpc.endpoint, timeout_ms=10_000, curve=transport.client_curve(role, "buffer_rpc"))
        for role in ALLOWED
    }
    try:
        _fill(svc, transport.client_curve("rollout", "buffer_data"))
        pairs = [
            (role, name)
            for role in ALLOWED
            for name in MESSAGES
            if not (role == "admin" and name in ("drain", "shutdown"))  # those stop it: last
        ]
        before = {r: _count(r) for r in AUTH_REASONS}
        with caplog.at_level(logging.WARNING, logger="teamrl.buffer"):
            replies = _serve_calls(svc, [(clients[role], MESSAGES[name]) for role, name in pairs])
            # the same refusal again: counted again, not logged again (rate-limited)
            again = _serve_calls(svc, [(clients["rollout"], MESSAGES["sample"])] * 5)
        expected = dict.fromkeys(AUTH_REASONS, 0)
        for (role, name), reply in zip(pairs, replies, strict=True):
            refused = isinstance(reply, ErrorReply) and reply.reason in AUTH_REASONS
            if name in ALLOWED[role]:
                assert not refused, (role, name, reply)
                assert reply.type in ("buffer_stats", "sample_reply"), (role, name, reply)
            else:
                want = "not_admin" if name in ("drain", "shutdown") else "not_authorised"
                assert refused and reply.reason == want, (role, name, reply)
                assert reply.message.startswith(MESSAGES[name].type)
                expected[want] += 1
        assert all(isinstance(r, ErrorReply) and r.reason == "not_authorised" for r in again)
        expected["not_authorised"] += 5
        assert {r: _count(r) - before[r] for r in AUTH_REASONS} == expected
        lines = [r for r in caplog.records if "sample_request from the rollout key refused" in r.getMessage()]
        assert len(lines) == 1
        # refused requests changed nothing: the learner's sample got data, nobody stopped the buffer
        sample = replies[pairs.index(("learner", "sample"))]
        assert sample.type == "sample_reply" and sample.request_id == 5 and sample.count >= 1
        assert svc.stop_reason is None
        assert "r-1" in svc.producers and "l-1" not in svc.producers  # Hello(service=learner) refused

        out = _serve_calls(svc, [(clients["admin"], Drain(reason="operator"))])
        assert out[0].type == "buffer_stats" and svc.stop_reason == "drain"
    finally:
        for c in clients.values():
            c.close()
        svc.close()


def test_without_curve_roles_cannot_be_told_apart(tmp_path: Path) -> None:
    svc = _service(tmp_path, TransportConfig())
    client = RpcClient(svc.rpc.endpoint, timeout_ms=10_000)
    try:
        _fill(svc, None)
        names = ["hello_rollout", "hello_learner", "heartbeat", "sample", "stats", "drain", "shutdown"]
        before = _count("not_admin")
        replies = dict(zip(names, _serve_calls(svc, [(client, MESSAGES[n]) for n in names]), strict=True))
        for name in ("hello_rollout", "hello_learner", "heartbeat", "sample", "stats"):
            assert replies[name].type in ("buffer_stats", "sample_reply"), (name, replies[name])
        for name in ("drain", "shutdown"):
            assert isinstance(replies[name], ErrorReply) and replies[name].reason == "not_admin"
        assert _count("not_admin") == before + 2 and svc.stop_reason is None
    finally:
        client.close()
        svc.close()
