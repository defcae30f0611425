"""teamrl.protocol: the wire between rollouts, the replay buffer and learners (no torch, no vllm).

Data: ``encode_trajectories`` / ``decode_trajectories`` (Arrow IPC, ``schema.py``, ``codec.py``).
Control: ``pack_message`` / ``unpack_message`` (msgpack, ``control.py``).
Transport: ``transport.py`` (interfaces, factory) over ZeroMQ (``zmq_transport.py``).
"""

from teamrl.protocol.codec import decode_trajectories, encode_trajectories, encode_trajectories_buffer
from teamrl.protocol.errors import DecodeError, FrameTooLarge, PeerTimeout, ProtocolError, SchemaMismatch
from teamrl.protocol.examples import example_trajectories
from teamrl.protocol.schema import SCHEMA_VERSION, TRAJECTORY_SCHEMA
from teamrl.protocol.trajectory import AgentStep, GraphTrajectory, ToolCall

__all__ = [
    "SCHEMA_VERSION",
    "TRAJECTORY_SCHEMA",
    "AgentStep",
    "DecodeError",
    "FrameTooLarge",
    "GraphTrajectory",
    "PeerTimeout",
    "ProtocolError",
    "SchemaMismatch",
    "ToolCall",
    "decode_trajectories",
    "encode_trajectories",
    "encode_trajectories_buffer",
    "example_trajectories",
]
