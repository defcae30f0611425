"""The replay buffer's rate limiter: Reverb's ``SampleToInsertRatio`` plus its ``MinSize``
(``teamrl.learner.buffer``'s module docstring, "Rate limiting"; docs/reliability.md R9).
"""

from __future__ import annotations


class RateLimiter:
    """Reverb's ``SampleToInsertRatio`` (plus its ``MinSize``) over trajectory counts.

    ``inserts``/``samples`` only grow; ``size`` is what is held now. Invariant kept (once
    ``min_size`` is reached): ``min_diff <= inserts * spi - samples <= max_diff`` up to one
    insert's overshoot, which ``error_buffer >= max(1, spi) * group_size`` absorbs.
    """

    def __init__(self, min_size: int, samples_per_insert: float | None, error_buffer: float) -> None:
        self.min_size = min_size
        self.spi = samples_per_insert
        self.error_buffer = error_buffer
        self.inserts = 0
        self.samples = 0
        if samples_per_insert is not None:
            self.min_diff = min_size * samples_per_insert - error_buffer
            self.max_diff = min_size * samples_per_insert + error_buffer

    @property
    def diff(self) -> float:
        return self.inserts * (self.spi or 0.0) - self.samples

    def can_insert(self, n: int, size: int) -> bool:
        if self.spi is None or size + n <= self.min_size:
            return True
        return (self.inserts + n) * self.spi - self.samples <= self.max_diff

    def refuse_sample(self, n: int, size: int) -> str | None:
        """None when ``n`` samples may go out now, else the refusal reason."""
        if size < self.min_size:
            return "not_enough_data"
        if self.spi is not None and self.diff - n < self.min_diff:
            return "rate_limited"
        return None
