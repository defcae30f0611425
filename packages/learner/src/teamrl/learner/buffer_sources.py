"""Which (incarnation, seq) frames the replay buffer has taken in: the de-duplication table that a
checkpoint keeps, so a producer's resend after a buffer crash is recognised (``teamrl.learner.buffer``'s
module docstring, "Persistence"; docs/reliability.md R-kill-buffer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class SeqSet:
    """Seqs seen from one producer incarnation: a low watermark plus the sparse set above it."""

    def __init__(self, low: int = 0, above: Iterable[int] = ()) -> None:
        self.low = low
        self.above = set(above)

    def __contains__(self, seq: int) -> bool:
        return seq < self.low or seq in self.above

    def add(self, seq: int) -> None:
        self.above.add(seq)
        while self.low in self.above:
            self.above.discard(self.low)
            self.low += 1

    def seqs(self) -> list[int]:
        return list(range(self.low)) + sorted(self.above)


class Sources:
    """The (incarnation, seq) of every frame delivered to ``insert``, per producer incarnation."""

    def __init__(self) -> None:
        self.seen: dict[str, SeqSet] = {}

    def first_delivery(self, incarnation: str, seq: int) -> bool:
        """Record (incarnation, seq) as seen; False when it was already."""
        seen = self.seen.get(incarnation)
        if seen is None:  # the receiver's rule: the first seq of an incarnation is its low mark
            seen = self.seen[incarnation] = SeqSet(low=seq)
        if seq in seen:
            return False
        seen.add(seq)
        return True

    def state(self) -> dict[str, list[Any]]:
        return {inc: [s.low, sorted(s.above)] for inc, s in self.seen.items()}

    def load(self, state: Mapping[str, list[Any]]) -> None:
        self.seen = {inc: SeqSet(int(low), above) for inc, (low, above) in state.items()}
