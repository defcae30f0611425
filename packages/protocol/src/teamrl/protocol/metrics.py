"""Prometheus metrics of the wire, defined once so every service exports the same names.

Counting happens at the fault boundary: ``decode_trajectories``/``unpack_message`` and the
transport's header parsing increment ``REJECTED_FRAMES`` with the error's ``reason`` label right
before raising or dropping, so a rejection is counted exactly once whoever catches it.
"""

from __future__ import annotations

from prometheus_client import Counter

REJECTED_FRAMES = Counter(
    "teamrl_protocol_rejected_frames",
    "Foreign frames refused by a decoder or transport, by reason.",
    ["reason"],
)
DUPLICATE_FRAMES = Counter(
    "teamrl_protocol_duplicate_frames",
    "Data frames received again with an already-seen (incarnation, seq); re-acked, not delivered.",
)
RESENT_FRAMES = Counter(
    "teamrl_protocol_resent_frames",
    "Data frames a sender resent after an ack timeout or a reconnect.",
)
PEER_REJECTED_FRAMES = Counter(
    "teamrl_protocol_peer_rejected_frames",
    "Data frames the receiving application refused (negative ack); the sender drops them.",
)
STALE_REPLIES = Counter(
    "teamrl_protocol_stale_replies",
    "RPC replies or acks that arrived for a request/peer no longer waiting; ignored.",
)
WEIGHT_ANNOUNCE_GAPS = Counter(
    "teamrl_protocol_weight_announce_gaps",
    "Gaps seen in the weights announcement sequence; each triggered a fetch of the latest version.",
)


DEDUP_EVICTIONS = Counter(
    "teamrl_protocol_dedup_evictions",
    "Producer incarnations whose de-duplication state a data receiver dropped, by reason "
    "(count: over max_incarnations; age: silent longer than incarnation_ttl_s).",
    ["reason"],
)
AUTH_REFUSED = Counter(
    "teamrl_protocol_auth_refused",
    "Connections or requests refused by authentication or authorisation, by socket and reason "
    "(unknown_key: CURVE key not allowed; plaintext: a NULL-security peer at a CURVE socket; "
    "bad_handshake: a CURVE peer without the server's key; not_admin: an operator-only request "
    "from another peer; not_authorised: a request outside the rights of its key's role). "
    "Sockets: buffer_data, buffer_rpc, learner_weights, learner_latest.",
    ["socket", "reason"],
)


def count_rejection(reason: str) -> None:
    """Increment the rejected-frames counter for ``reason``."""
    REJECTED_FRAMES.labels(reason=reason).inc()


def rejected_count(reason: str) -> float:
    """Current value of the rejected-frames counter for ``reason`` (for tests and reports)."""
    return REJECTED_FRAMES.labels(reason=reason)._value.get()
