"""Typed transport configuration (read from the run's TOML by the CLI).

Transport classes take plain keyword arguments, not this model, so a test builds them without a config
file; ``sender_kwargs`` / ``receiver_kwargs`` / ``curve_keys`` turn this model into them. Validators only
check that values agree and raise; nothing is copied between fields.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import zmq.auth
from pydantic import BaseModel, ConfigDict, Field, model_validator

from teamrl.protocol.transport import CurveKeys


class TransportConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data_endpoint: str = Field(
        "tcp://127.0.0.1:5555",
        description="Replay buffer's data ROUTER: rollouts connect here, the buffer binds it.",
    )
    rpc_endpoint: str = Field(
        "tcp://127.0.0.1:5556", description="Replay buffer's RPC ROUTER (SampleRequest, BufferStatsRequest)."
    )
    weights_pub_endpoint: str = Field(
        "tcp://127.0.0.1:5557", description="Learner's PUB socket for WeightsPublished announcements."
    )
    weights_latest_endpoint: str = Field(
        "tcp://127.0.0.1:5558", description="Learner's ROUTER answering LatestWeightsRequest (gap healing)."
    )
    hwm: int = Field(64, ge=1, le=100_000, description="ZMQ send/receive high-water mark, in messages.")
    max_msg_size: int = Field(
        256 * 1024 * 1024,
        ge=1024,
        description="ZMQ_MAXMSGSIZE in bytes; a larger inbound message drops its connection.",
    )
    window: int = Field(
        16, ge=1, description="Un-acked data frames a sender may have in flight (its credit)."
    )
    ack_timeout_s: float = Field(5.0, gt=0, description="Resend a data frame not acked within this time.")
    heartbeat_ivl_ms: int = Field(1000, ge=0, description="ZMTP heartbeat interval (0 disables heartbeats).")
    heartbeat_timeout_ms: int = Field(
        5000, ge=0, description="ZMTP heartbeat timeout/TTL: a silent peer is disconnected after this."
    )
    rpc_timeout_ms: int = Field(5000, ge=1, description="RPC call deadline; PeerTimeout after it.")
    curve: bool = Field(False, description="Encrypt and authenticate every socket with CURVE.")
    curve_dir: Path | None = Field(
        None,
        description="Folder of per-role keys (<role>.pub, <role>.key for buffer, learner, rollout, admin), "
        "as written by teamrl.protocol.curve.generate_run_keys or mounted from the teamrl-curve Secret; "
        "each server socket admits only the roles teamrl.protocol.curve.ALLOWED lists for it.",
    )
    curve_secret_key: Path | None = Field(
        None, description="This service's secret-key certificate (zmq.auth format, *.key_secret)."
    )
    curve_server_public_key: Path | None = Field(
        None, description="Clients: the server's public certificate (*.key)."
    )
    curve_allowed_clients_dir: Path | None = Field(
        None, description="Servers: folder of allowed client public certificates (*.key); the ZAP allow-list."
    )

    @model_validator(mode="after")
    def _agree(self) -> TransportConfig:
        if self.heartbeat_ivl_ms and self.heartbeat_timeout_ms <= self.heartbeat_ivl_ms:
            raise ValueError(
                f"heartbeat_timeout_ms ({self.heartbeat_timeout_ms}) must exceed heartbeat_ivl_ms "
                f"({self.heartbeat_ivl_ms})"
            )
        if self.window > self.hwm:
            raise ValueError(
                f"window ({self.window}) must not exceed hwm ({self.hwm}): the pipe holds the window"
            )
        if self.curve and self.curve_secret_key is None and self.curve_dir is None:
            raise ValueError("curve = true needs curve_dir (or curve_secret_key)")
        return self

    def sender_kwargs(self) -> dict[str, object]:
        return {
            "window": self.window,
            "ack_timeout_s": self.ack_timeout_s,
            "heartbeat_ivl_ms": self.heartbeat_ivl_ms,
            "heartbeat_timeout_ms": self.heartbeat_timeout_ms,
        }

    def receiver_kwargs(self) -> dict[str, object]:
        return {
            "hwm": self.hwm,
            "max_msg_size": self.max_msg_size,
            "heartbeat_ivl_ms": self.heartbeat_ivl_ms,
            "heartbeat_timeout_ms": self.heartbeat_timeout_ms,
        }

    def server_curve(self, socket: str) -> CurveKeys | None:
        """Server keys of ``socket`` (``buffer_data``, ``buffer_rpc``, ``learner_weights``) from
        ``curve_dir``; None when CURVE is off."""
        from teamrl.protocol.curve import server_keys

        if not self.curve:
            return None
        if self.curve_dir is None:
            return self.curve_keys()
        return server_keys(self.curve_dir, socket)

    def client_curve(self, role: str, socket: str) -> CurveKeys | None:
        """Keys for ``role`` (``learner``, ``rollout``, ``admin``) dialling ``socket``; None when off."""
        from teamrl.protocol.curve import client_keys

        if not self.curve:
            return None
        if self.curve_dir is None:
            return self.curve_keys()
        return client_keys(self.curve_dir, role, socket)

    def curve_keys(self) -> CurveKeys | None:
        """Load the single-pair key files (``curve_secret_key`` ...); None when CURVE is off."""
        if not self.curve:
            return None
        assert self.curve_secret_key is not None  # checked by the validator
        public, secret = zmq.auth.load_certificate(self.curve_secret_key)
        server_public = b""
        if self.curve_server_public_key is not None:
            server_public, _ = zmq.auth.load_certificate(self.curve_server_public_key)
        allowed: set[bytes] = set()
        if self.curve_allowed_clients_dir is not None:
            for cert in sorted(self.curve_allowed_clients_dir.glob("*.key")):
                allowed.add(zmq.auth.load_certificate(cert)[0])
        return CurveKeys(
            public=public,
            secret=secret or b"",
            server_public=server_public,
            allowed_clients=frozenset(allowed),
        )


# --- secure by default (docs/security.md) -----------------------------------------------------------

TRANSPORT_EPILOG = (
    "Security (docs/security.md): CURVE encryption and per-role keys come from the [transport] table of "
    "--config (curve = true, curve_dir = DIR of <role>.pub/<role>.key). Make the keys with `teamrl keys DIR` "
    "(a folder; prints the table to paste) or deploy/scripts/curve_secret.py (a Kubernetes Secret). "
    "Without keys the service refuses to start unless --insecure is given."
)


class NoKeys(ValueError):
    """A service was started without CURVE keys and without ``--insecure``."""


def add_insecure_flag(parser: argparse.ArgumentParser) -> None:
    """``--insecure``: the one way a service starts without CURVE keys."""
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="start without CURVE keys: every link plaintext, any peer that reaches the ports may send "
        "data and requests (a trusted network only; docs/security.md)",
    )


def transport_mode(prog: str, transport: TransportConfig, insecure: bool) -> str:
    """The one line a service says at start about its links. Without keys and without ``insecure`` it
    raises ``NoKeys`` with the line that says why it will not start and what to do."""
    if transport.curve:
        keys = transport.curve_dir or transport.curve_secret_key
        return f"{prog}: CURVE on every link, keys from {keys}"
    if not insecure:
        raise NoKeys(
            f"{prog}: refusing to start without CURVE keys: set [transport] curve = true and curve_dir in "
            "--config (make keys with `teamrl keys DIR`), or pass --insecure for plaintext links"
        )
    return (
        f"{prog}: --insecure: plaintext links, no CURVE: any peer that reaches its ports may send data "
        "and requests (docs/security.md)"
    )
