"""Transport interfaces: how frames move between services, independent of ZeroMQ (the ZeroMQ
implementation, and the ``make_data_sender``/``make_data_receiver`` factories used below, are in
:mod:`teamrl.protocol.zmq_transport`).

Data path (rollout -> replay buffer), at-least-once with explicit, application-driven acks::

    sender = make_data_sender(endpoint, incarnation)     # DEALER, connects
    seq = sender.send(encode_trajectories(batch))        # blocks while `window` frames are un-acked
    ...
    sender.flush(timeout_s=10)                           # True when every frame was acked
    sender.close()

    receiver = make_data_receiver(bind_endpoint)         # ROUTER, binds
    receiver.restore(incarnation, durable_seqs)          # after a restart: what the checkpoint holds
    while running:
        frame = receiver.recv(timeout_ms=100)            # None on timeout; duplicates never returned
        if frame is None: continue
        try: trajs = decode_trajectories(frame.payload)
        except ProtocolError as e: receiver.reject(frame, e.reason); continue
        persist(trajs)
        receiver.ack(frame)                              # only now may the sender forget it

Credit-based flow control: the sender holds at most ``window`` un-acked frames; that window is
the credit the receiver grants by acking. A slow consumer therefore blocks the producer instead of
growing a queue: memory is bounded by ``window x max frame size`` on each side. The sender resends
every frame that has waited ``ack_timeout_s`` and everything un-acked after a reconnect; the
receiver de-duplicates by ``(incarnation, seq)``, re-acking duplicates that are already durable.

Control path: ``RpcServer`` / ``RpcClient`` (request/reply of control messages with timeouts, used
by the buffer to serve ``SampleRequest``) and ``WeightsPublisher`` / ``WeightsSubscriber`` (PUB/SUB
announcements with sequence numbers and a "latest" request endpoint to heal gaps).

Objects are single-threaded (ZeroMQ sockets are not thread-safe): use each from one thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from teamrl.protocol.control import _Message

# A protocol error surfaced by the transport's own envelope parsing (not the payload codec).
ENVELOPE_REASON = "bad_envelope"


@dataclass(frozen=True)
class Frame:
    """One delivered data frame. ``payload`` is a zero-copy view of the received message."""

    peer: bytes  # routing id of the connection it came on (acks go back there)
    incarnation: str
    seq: int
    payload: memoryview


@dataclass(frozen=True)
class CurveKeys:
    """CURVE keys (z85-encoded, 40 bytes each). A server needs its pair and the client allow-list;
    a client needs its pair and the server's public key. Empty ``allowed_clients`` admits nobody."""

    public: bytes
    secret: bytes
    server_public: bytes = b""  # client side: whom we expect to talk to
    allowed_clients: frozenset[bytes] = field(default_factory=frozenset)  # server side


class DataSender(Protocol):
    def send(self, payload: bytes | memoryview) -> int:
        """Queue one frame; returns its seq. Blocks while ``window`` frames are un-acked."""
        ...

    def flush(self, timeout_s: float) -> bool:
        """Wait until every frame is acked (True) or the timeout passes (False)."""
        ...

    @property
    def unacked(self) -> int: ...

    def close(self) -> int:
        """Close; returns how many frames were still un-acked (lost to this incarnation)."""
        ...


class DataReceiver(Protocol):
    def recv(self, timeout_ms: int) -> Frame | None: ...

    def ack(self, *frames: Frame) -> None: ...

    def reject(self, frame: Frame, reason: str) -> None: ...

    def restore(self, incarnation: str, seqs: list[int]) -> None: ...

    def close(self) -> None: ...


class Rpc(Protocol):
    def call(self, msg: _Message, timeout_ms: int | None = None) -> _Message: ...

    def close(self) -> None: ...
