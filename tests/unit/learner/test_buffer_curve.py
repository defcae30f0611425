"""The buffer with CURVE from its [transport] table: the run's keys admit the rollout (data), the
learner (RPC) and the operator (RPC, the only one allowed to stop it); a client with an unknown key
and a plaintext (NULL) client get nothing through, and the unknown key is counted."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
from test_buffer_bounds import _call_while_serving, _pump

from teamrl.learner.buffer_config import BufferConfig
from teamrl.learner.buffer_service import BufferService
from teamrl.protocol import metrics
from teamrl.protocol.codec import encode_trajectories
from teamrl.protocol.config import TransportConfig
from teamrl.protocol.control import BufferStatsRequest, Shutdown
from teamrl.protocol.curve import generate_run_keys
from teamrl.protocol.errors import PeerTimeout
from teamrl.protocol.examples import example_trajectories
from teamrl.protocol.transport import CurveKeys
from teamrl.protocol.zmq_transport import RpcClient, ZmqDataSender


def _refused(socket: str) -> float:
    return metrics.AUTH_REFUSED.labels(socket=socket, reason="unknown_key")._value.get()


def test_buffer_with_curve(tmp_path: Path) -> None:
    keys = generate_run_keys(tmp_path / "curve")
    assert (keys / "buffer.key").stat().st_mode & 0o077 == 0
    transport = TransportConfig(curve=True, curve_dir=keys)
    cfg = BufferConfig(
        bind="tcp://127.0.0.1:*",
        sample_bind="tcp://127.0.0.1:*",
        dir=tmp_path / "buffer",
        max_policy_lag=1000,
        checkpoint_interval_s=0.01,
        fsync=False,
    )
    svc = BufferService(cfg, transport)
    clients = []
    try:
        rollout = ZmqDataSender(
            svc.receiver.endpoint,
            "rollout-1",
            window=2,
            ack_timeout_s=5,
            curve=transport.client_curve("rollout", "buffer_data"),
        )
        clients.append(rollout)
        rollout.send(encode_trajectories(example_trajectories(2, seed=1, tokens=8)))
        _pump(svc, lambda: rollout._pump(0) or rollout.unacked == 0)
        assert svc.buffer.size == 2

        learner = RpcClient(
            svc.rpc.endpoint, timeout_ms=5000, curve=transport.client_curve("learner", "buffer_rpc")
        )
        clients.append(learner)
        out = {}
        _call_while_serving(svc, lambda: out.setdefault("stats", learner.call(BufferStatsRequest())))
        assert out["stats"].size == 2

        stranger_pub, stranger_secret = zmq.curve_keypair()
        server_pub = (keys / "buffer.pub").read_bytes().strip()
        before = _refused("buffer_rpc")
        stranger = RpcClient(
            svc.rpc.endpoint,
            timeout_ms=800,
            curve=CurveKeys(public=stranger_pub, secret=stranger_secret, server_public=server_pub),
        )
        plain = RpcClient(svc.rpc.endpoint, timeout_ms=800)
        clients += [stranger, plain]
        for client in (stranger, plain):

            def call(client=client) -> None:
                with pytest.raises(PeerTimeout):
                    client.call(Shutdown(reason="intruder"))

            _call_while_serving(svc, call)
        assert svc.stop_reason is None and svc.rpc.served == 1
        assert _refused("buffer_rpc") >= before + 1

        admin = RpcClient(
            svc.rpc.endpoint, timeout_ms=5000, curve=transport.client_curve("admin", "buffer_rpc")
        )
        clients.append(admin)
        _call_while_serving(svc, lambda: out.setdefault("stop", admin.call(Shutdown(reason="operator"))))
        assert out["stop"].type == "buffer_stats" and svc.stop_reason == "shutdown"
    finally:
        for c in clients:
            c.close()
        svc.close()
