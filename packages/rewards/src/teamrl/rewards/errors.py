"""Typed errors of teamrl.rewards.

A reward never raises on a bad *completion* (that is a score of 0 with a reason); these errors are
for bad *inputs from the operator*: an unknown reward name, a task record missing the fields a
reward needs, a config that does not validate.
"""

from __future__ import annotations


class RewardError(Exception):
    """Base class of every error raised by teamrl.rewards."""


class UnknownReward(RewardError, KeyError):
    """``get_reward`` was asked for a name that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown reward"


class TaskFormatError(RewardError, ValueError):
    """A task record lacks a field the reward needs, or the field has the wrong type."""


class DatasetError(RewardError, ValueError):
    """A dataset file could not be read or a record in it is malformed (line number in the message)."""


class SandboxUnavailable(RewardError, RuntimeError):
    """The sandbox could not start the interpreter at all (not: the candidate failed)."""
