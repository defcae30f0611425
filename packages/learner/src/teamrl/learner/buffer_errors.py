"""The replay buffer's errors (``teamrl.learner.buffer`` re-exports them).

A refusal's ``reason`` is what it is counted under (``teamrl_buffer_rejected``) and what the buffer
service answers with (``ErrorReply.reason``); a refused frame or request changes nothing.
"""

from __future__ import annotations


class ReplayBufferError(Exception):
    """Base of the buffer's errors."""


class CorruptStore(ReplayBufferError):
    """The buffer folder holds a complete checkpoint whose data cannot be read back."""


class VersionOutOfRange(ReplayBufferError):
    """A policy version (in a frame, or a sample's ``min_policy_version``) lies more than
    ``version_window`` above the current version: refused, counted, nothing changes."""

    reason = "policy_version_out_of_range"


class InvalidAgentId(ReplayBufferError):
    """A step's agent id is empty, longer than ``MAX_AGENT_ID_CHARS``, or holds ``VIEW_SEP``: no
    control message could name it (one such frame made every later BufferStats reply fail its
    schema), or its name could be taken for a view of several agents, so the frame is refused,
    counted, and nothing changes."""

    reason = "invalid_agent_id"


class InvalidView(ReplayBufferError):
    """A sample request names its agents wrongly: both ``agent_id`` and ``agent_ids``, an empty
    list, more than ``MAX_VIEW_AGENTS`` ids, or an id no admitted step can carry. Refused and
    counted before anything changes."""

    reason = "invalid_agent_ids"
