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


class VersionUnpublished(VersionOutOfRange):
    """A frame's step, or a sample's ``min_policy_version``, claims a policy version above the one its
    base's learner announced: no honest rollout samples from weights not yet published (the learner
    announces before it publishes). Refused, counted, nothing changes (docs/security.md)."""

    reason = "policy_version_unpublished"


class UnknownId(ReplayBufferError):
    """A frame, request or announcement names a model id or agent id the run's plan does not (or,
    without a plan, no learner announced): refused and counted under ``reason``
    (``unknown_model_id`` or ``unknown_agent_id``), nothing changes, nothing keyed by it is kept."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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


class ViewLimit(InvalidView):
    """A sample request would open a view past ``MAX_VIEWS`` or a rank past ``MAX_RANKS``: the rank
    rounds are kept per (view, rank), keyed by what requests say, so both are bounded."""

    reason = "view_limit"
