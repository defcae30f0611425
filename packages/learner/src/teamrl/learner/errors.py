"""The learner's typed errors (the engine, its rows and its services raise these)."""

from __future__ import annotations


class LearnerError(RuntimeError):
    """The learner cannot continue (bad data, bad checkpoint, inconsistent ranks)."""


class LogprobMismatch(LearnerError):
    """Recomputed log-probs disagree with the behaviour log-probs on fresh rows (positions/padding bug)."""
