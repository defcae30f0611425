"""Shaping terms: a format bonus and an over-length penalty, meant to be mixed into a
``WeightedSum`` with a verifiable reward (e.g. ``WeightedSum([(1.0, math), (0.1, fmt), (1.0, length)])``).

Neither reads task fields. ``FormatReward`` searches a regex in the completion; because Python's
``re`` has no timeout, a pathological pattern could backtrack for a long time on adversarial text,
so the pattern is the operator's responsibility and the completion is cut to ``max_chars`` first.
``LengthReward`` is 0 up to ``target`` and falls linearly to ``-max_penalty`` at ``limit``, then
stays there (clipped), so a runaway generation costs a bounded amount.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from teamrl.rewards.base import ActView, EpisodeRewards, RewardResult, team_outcome

_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


class FormatReward:
    """``match_score`` if ``pattern`` is found in the completion (``re.search``), else ``miss_score``.

    ``flags`` is a string of letters from "imsx" (default "s": ``.`` also matches newlines);
    ``fullmatch=True`` requires the whole (stripped) completion to match.
    """

    name = "format"

    def __init__(
        self,
        pattern: str = r"\\boxed\{.+\}",
        flags: str = "s",
        fullmatch: bool = False,
        match_score: float = 1.0,
        miss_score: float = 0.0,
        max_chars: int = 100_000,
    ) -> None:
        unknown = set(flags) - set(_FLAGS)
        if unknown:
            raise ValueError(
                f"FormatReward flags {flags!r}: unknown letters {sorted(unknown)}; use any of 'imsx'"
            )
        bits = 0
        for letter in flags:
            bits |= _FLAGS[letter]
        try:
            self.pattern = re.compile(pattern, bits)
        except re.error as exc:
            raise ValueError(f"FormatReward pattern {pattern!r} does not compile: {exc}") from exc
        if max_chars < 1:
            raise ValueError(f"FormatReward max_chars must be >= 1, got {max_chars}")
        self.fullmatch = fullmatch
        self.match_score = float(match_score)
        self.miss_score = float(miss_score)
        self.max_chars = max_chars

    def __call__(self, completion: str, task: Mapping[str, Any]) -> RewardResult:
        text = completion[: self.max_chars]
        if self.fullmatch:
            found = self.pattern.fullmatch(text.strip())
        else:
            found = self.pattern.search(text)
        details: dict[str, Any] = {"truncated": len(completion) > self.max_chars}
        if found is None:
            return RewardResult(self.miss_score, "no_match", details)
        details["match"] = found.group(0)[:200]
        return RewardResult(self.match_score, "ok", details)

    def episode(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards:
        return team_outcome(self, task, acts)


def _count_chars(text: str) -> int:
    return len(text)


def _count_words(text: str) -> int:
    return len(text.split())


class LengthReward:
    """A length penalty: ``-max_penalty * clip((n - target) / (limit - target), 0, 1)``.

    ``n`` is the completion's length in ``unit`` ("chars" or "words"), or whatever ``count``
    returns (pass a tokenizer's ``lambda s: len(tok.encode(s))`` to count tokens). ``limit``
    defaults to twice ``target``.
    """

    name = "length"

    def __init__(
        self,
        target: int = 1024,
        limit: int | None = None,
        max_penalty: float = 1.0,
        unit: str = "chars",
        count: Callable[[str], int] | None = None,
    ) -> None:
        if target < 0:
            raise ValueError(f"LengthReward target must be >= 0, got {target}")
        limit = 2 * target if limit is None else limit
        if limit <= target:
            raise ValueError(f"LengthReward limit ({limit}) must be greater than target ({target})")
        if max_penalty < 0:
            raise ValueError(f"LengthReward max_penalty must be >= 0 (it is subtracted), got {max_penalty}")
        counters = {"chars": _count_chars, "words": _count_words}
        if count is None and unit not in counters:
            raise ValueError(f"LengthReward unit {unit!r}: expected 'chars' or 'words' (or pass count=)")
        self.target = target
        self.limit = limit
        self.max_penalty = float(max_penalty)
        self.unit = unit if count is None else "custom"
        self.count = count if count is not None else counters[unit]

    def __call__(self, completion: str, task: Mapping[str, Any]) -> RewardResult:
        n = int(self.count(completion))
        over = (n - self.target) / (self.limit - self.target)
        fraction = min(1.0, max(0.0, over))
        score = -self.max_penalty * fraction if fraction > 0 else 0.0
        details = {"length": n, "unit": self.unit, "target": self.target, "limit": self.limit}
        return RewardResult(score, "ok" if fraction == 0 else "too_long", details)

    def episode(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards:
        return team_outcome(self, task, acts)
