"""TransportConfig: defaults valid, disagreeing values refused, CURVE key files loaded."""

from __future__ import annotations

import pytest
import zmq.auth
from pydantic import ValidationError

from teamrl.protocol.config import TransportConfig


def test_defaults_are_valid_and_build_kwargs():
    cfg = TransportConfig()
    assert cfg.sender_kwargs()["window"] == 16
    assert cfg.receiver_kwargs()["hwm"] == 64
    assert cfg.curve_keys() is None


@pytest.mark.parametrize(
    "bad",
    [
        {"heartbeat_ivl_ms": 1000, "heartbeat_timeout_ms": 500},
        {"window": 100, "hwm": 10},
        {"curve": True},
        {"typo_field": 1},
    ],
)
def test_disagreeing_values_are_refused(bad):
    with pytest.raises(ValidationError):
        TransportConfig(**bad)


def test_curve_keys_load_from_certificates(tmp_path):
    server_pub, server_sec = zmq.auth.create_certificates(tmp_path, "server")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    client_pub, _ = zmq.auth.create_certificates(allowed, "client")
    keys = TransportConfig(
        curve=True,
        curve_secret_key=server_sec,
        curve_server_public_key=server_pub,
        curve_allowed_clients_dir=allowed,
    ).curve_keys()
    assert keys is not None and len(keys.secret) == 40
    assert keys.allowed_clients == frozenset({zmq.auth.load_certificate(client_pub)[0]})
