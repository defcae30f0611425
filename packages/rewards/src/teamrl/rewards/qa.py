"""Extractive-QA rewards: exact match and token F1 after SQuAD-style normalisation.

Normalisation (the convention of the SQuAD v1.1 evaluation, re-implemented here): lowercase, drop
punctuation, drop the articles "a", "an", "the" as whole words, collapse whitespace. Token F1 is the
harmonic mean of precision and recall over the multiset of normalised tokens; when either side has
no tokens, F1 is 1 if both are empty and 0 otherwise. With several gold answers the score is the
maximum over them.

Task fields: ``"answers"`` (a list of strings, or a SQuAD ``{"text": [...]}`` object) or, failing
that, ``"answer"`` (a string). Call sequence::

    em = ExactMatchReward()                       # or F1Reward()
    em("The Eiffel Tower.", {"answers": ["Eiffel Tower"]}).score   # 1.0
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from teamrl.rewards.base import ActView, EpisodeRewards, RewardResult, team_outcome
from teamrl.rewards.errors import TaskFormatError

_PUNCT = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lowercase, strip punctuation, drop articles, collapse whitespace."""
    text = text.lower().translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    """Token-level F1 between the normalised prediction and the normalised gold answer."""
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred)
    recall = common / len(ref)
    return 2 * precision * recall / (precision + recall)


def gold_answers(task: Mapping[str, Any], reward: str) -> list[str]:
    """The task's gold answers as a non-empty list of strings (raises ``TaskFormatError``)."""
    if "answers" in task:
        value = task["answers"]
        if isinstance(value, Mapping) and "text" in value:
            value = value["text"]
        if isinstance(value, str):
            value = [value]
    elif "answer" in task:
        value = [task["answer"]]
    else:
        raise TaskFormatError(
            f"{reward} reward: task record has neither 'answers' nor 'answer' (fields: {sorted(task)})"
        )
    if not isinstance(value, Sequence) or not value or not all(isinstance(v, str) for v in value):
        raise TaskFormatError(
            f"{reward} reward: gold answers should be a non-empty list of strings, got {value!r}"
        )
    return list(value)


def _compile_pattern(answer_pattern: str | None) -> re.Pattern[str] | None:
    # answer_pattern: a regex whose group 1 is the answer (e.g. r"Answer:\s*(.+)"); the last match
    # is used, and the whole completion when nothing matches.
    if not answer_pattern:
        return None
    pattern = re.compile(answer_pattern)
    if pattern.groups < 1:
        raise ValueError(f"answer_pattern {answer_pattern!r} needs a capturing group for the answer")
    return pattern


def _extract(pattern: re.Pattern[str] | None, completion: str) -> str:
    if pattern is None:
        return completion
    last = None
    for last in pattern.finditer(completion):  # noqa: B007 - only the last match is wanted
        pass
    return last.group(1) if last is not None else completion


def _best_result(prediction: str, golds: list[str], scorer: Callable[[str, str], float]) -> RewardResult:
    scores = [scorer(prediction, g) for g in golds]
    best = max(range(len(golds)), key=scores.__getitem__)
    score = scores[best]
    normalised = normalize_answer(prediction)
    if not normalised:
        reason = "empty"
    elif score == 1.0:
        reason = "ok"
    elif score > 0.0:
        reason = "partial"
    else:
        reason = "wrong_answer"
    return RewardResult(score, reason, {"prediction": normalised, "best_gold": golds[best]})


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


class ExactMatchReward:
    """1 if the normalised completion equals a normalised gold answer, else 0."""

    name = "qa_em"

    def __init__(self, answer_pattern: str | None = None) -> None:
        self.answer_pattern = _compile_pattern(answer_pattern)

    def __call__(self, completion: str, task: Mapping[str, Any]) -> RewardResult:
        golds = gold_answers(task, self.name)
        return _best_result(_extract(self.answer_pattern, completion), golds, exact_match)

    def episode(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards:
        return team_outcome(self, task, acts)


class F1Reward:
    """Token F1 against the best-matching gold answer, in [0, 1]."""

    name = "qa_f1"

    def __init__(self, answer_pattern: str | None = None) -> None:
        self.answer_pattern = _compile_pattern(answer_pattern)

    def __call__(self, completion: str, task: Mapping[str, Any]) -> RewardResult:
        golds = gold_answers(task, self.name)
        return _best_result(_extract(self.answer_pattern, completion), golds, token_f1)

    def episode(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards:
        return team_outcome(self, task, acts)
