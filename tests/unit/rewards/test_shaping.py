"""Format bonus and length penalty."""

from __future__ import annotations

import pytest

from teamrl.rewards.base import WeightedSum, get_reward
from teamrl.rewards.shaping import FormatReward, LengthReward


def test_format_default_boxed() -> None:
    fmt = get_reward("format")
    assert fmt("so the answer is \\boxed{42}.", {}).score == 1.0
    res = fmt("the answer is 42", {})
    assert (res.score, res.reason) == (0.0, "no_match")
    assert fmt("\\boxed{}", {}).score == 0.0


def test_format_fullmatch_flags_and_scores() -> None:
    fmt = FormatReward(r"<answer>.*</answer>", fullmatch=True, miss_score=-0.5)
    assert fmt("  <answer>\n7\n</answer>\n", {}).score == 1.0
    assert fmt("junk <answer>7</answer>", {}).score == -0.5
    assert FormatReward(r"answer:", flags="i")("ANSWER: 3", {}).score == 1.0


def test_format_truncates_long_completions() -> None:
    fmt = FormatReward(r"END", max_chars=10)
    res = fmt("x" * 20 + "END", {})
    assert res.score == 0.0 and res.details["truncated"] is True


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"pattern": "("}, "does not compile"), ({"flags": "q"}, "unknown")]
)
def test_format_bad_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FormatReward(**kwargs)


def test_length_linear_and_clipped() -> None:
    length = LengthReward(target=10, limit=20, max_penalty=0.5)
    assert length("x" * 10, {}).score == 0.0
    assert length("x" * 10, {}).reason == "ok"
    assert length("x" * 15, {}).score == pytest.approx(-0.25)
    res = length("x" * 1000, {})
    assert (res.score, res.reason, res.details["length"]) == (-0.5, "too_long", 1000)


def test_length_words_and_custom_counter() -> None:
    assert LengthReward(target=2, limit=4, unit="words")("a b c", {}).score == pytest.approx(-0.5)
    by_token = LengthReward(target=1, limit=3, count=lambda s: len(s.split(",")))
    assert by_token("a,b,c", {}).score == -1.0
    assert by_token("a,b,c", {}).details["unit"] == "custom"


@pytest.mark.parametrize(
    "kwargs", [{"target": 5, "limit": 5}, {"target": -1}, {"unit": "tokens"}, {"max_penalty": -1}]
)
def test_length_bad_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LengthReward(**kwargs)


def test_weighted_sum_with_shaping() -> None:
    total = WeightedSum([(1.0, FormatReward()), (1.0, LengthReward(target=5, limit=10))])
    res = total("\\boxed{1234567}", {})
    assert res.score == pytest.approx(1.0 - 1.0)
    assert res.reason == "length:too_long"
