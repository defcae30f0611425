"""Typed errors of the wire. Every decode of foreign bytes raises one of these, never a bare
pyarrow/msgpack exception, so a receiver can count the rejection by ``reason`` and go on."""


class ProtocolError(Exception):
    """Base class. ``reason`` is a short, stable label used in the rejected-frames counter."""

    reason = "protocol_error"


class DecodeError(ProtocolError):
    """The bytes are not a well-formed frame (bad Arrow IPC, bad msgpack, failed validation)."""

    reason = "decode_error"


class SchemaMismatch(ProtocolError):
    """Well-formed, but with another schema or SCHEMA_VERSION, or a field fails its check."""

    reason = "schema_mismatch"


class FrameTooLarge(ProtocolError):
    """The frame, or a field inside it, is over its size cap."""

    reason = "frame_too_large"


class PeerTimeout(ProtocolError):
    """A peer did not answer (ack, heartbeat) within its deadline."""

    reason = "peer_timeout"
