"""SQuAD-style normalisation, exact match and token F1."""

from __future__ import annotations

import pytest

from teamrl.rewards.base import get_reward
from teamrl.rewards.errors import TaskFormatError
from teamrl.rewards.qa import ExactMatchReward, F1Reward, normalize_answer, token_f1


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("The Eiffel Tower.", "eiffel tower"),
        ("  an   Apple, a day!  ", "apple day"),
        ("Theatre", "theatre"),  # an article only as a whole word
        ("", ""),
        ("A", ""),
    ],
)
def test_normalize_answer(raw: str, normalised: str) -> None:
    assert normalize_answer(raw) == normalised


def test_exact_match_over_answers_list() -> None:
    em = ExactMatchReward()
    res = em("the  Eiffel tower!", {"answers": ["Louvre", "Eiffel Tower"]})
    assert (res.score, res.reason, res.details["best_gold"]) == (1.0, "ok", "Eiffel Tower")
    assert em("Paris", {"answer": "Eiffel Tower"}).reason == "wrong_answer"
    assert em("the", {"answer": "x"}).reason == "empty"


def test_squad_answers_object_and_registry() -> None:
    em = get_reward("qa_em")
    assert em("Denver Broncos", {"answers": {"text": ["Denver Broncos"], "answer_start": [0]}}).score == 1.0


def test_f1_partial_and_max_over_golds() -> None:
    assert token_f1("the cat sat", "cat sat down") == pytest.approx(2 * (2 / 2) * (2 / 3) / (2 / 2 + 2 / 3))
    assert token_f1("", "") == 1.0
    assert token_f1("a", "cat") == 0.0
    f1 = F1Reward()
    res = f1("cat sat", {"answers": ["dog", "cat sat down"]})
    assert res.reason == "partial"
    assert res.score == pytest.approx(0.8)
    assert get_reward("qa_f1")("dog", {"answers": ["dog", "cat sat down"]}).score == 1.0


def test_answer_pattern_takes_last_match() -> None:
    em = ExactMatchReward(answer_pattern=r"Answer:\s*(.+)")
    assert em("Answer: Rome\nno wait\nAnswer: Paris", {"answer": "Paris"}).score == 1.0
    assert em("Paris", {"answer": "Paris"}).score == 1.0  # no match: whole completion
    with pytest.raises(ValueError, match="capturing group"):
        ExactMatchReward(answer_pattern=r"Answer:")


@pytest.mark.parametrize("task", [{}, {"answers": []}, {"answers": [1]}, {"answer": 3}])
def test_bad_task_raises_task_format_error(task: dict) -> None:
    with pytest.raises(TaskFormatError):
        F1Reward()("x", task)
