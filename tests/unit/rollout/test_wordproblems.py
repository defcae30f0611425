"""The word-problem generator: seeded, right answers, and a held-out split that shares nothing with train."""

from __future__ import annotations

import pytest

from teamrl.rollout.workflows import TASK_SETS, WorkflowError, load_tasks, wordproblems


def test_generator_is_seeded_unique_and_its_answers_are_right() -> None:
    a, b = wordproblems.generate(300, seed=3), wordproblems.generate(300, seed=3)
    assert a == b and a != wordproblems.generate(300, seed=4)
    assert (
        len({t["id"] for t in a}) == len({t["question"] for t in a}) == len({t["skeleton"] for t in a}) == 300
    )
    for t in a:
        assert wordproblems.check(t), t
        steps = t["solution"].splitlines()
        assert 2 <= len(steps) <= 3 and len(t["plan"].splitlines()) == len(steps)
        assert 0 < int(t["answer"]) < wordproblems.MAX_VALUE
        assert t["question"].endswith("?")


def test_held_out_split_is_disjoint_from_train() -> None:
    train = load_tasks("math-word")
    held = load_tasks("math-word-held-out")
    assert len(train) == 5000 and len(held) == 500
    assert {"math-word", "math-word-held-out"} <= set(TASK_SETS)
    assert not {t["skeleton"] for t in train} & {t["skeleton"] for t in held}
    assert not {t["question"] for t in train} & {t["question"] for t in held}
    assert all(wordproblems.split_of(t["skeleton"]) == "held-out" for t in held)
    # another seed draws other problems, but the split of an arithmetic skeleton never changes
    other = wordproblems.generate(2000, seed=1)
    assert not {t["skeleton"] for t in other} & {t["skeleton"] for t in held}
    with pytest.raises(ValueError, match="unknown split"):
        wordproblems.generate(3, split="test")  # type: ignore[arg-type]


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_difficulty_fixes_the_number_of_steps(difficulty: int) -> None:
    tasks = wordproblems.generate(100, seed=0, difficulty=difficulty)
    assert tasks == wordproblems.generate(100, seed=0, difficulty=difficulty)
    for t in tasks:
        assert wordproblems.check(t), t
        assert len(t["solution"].splitlines()) == difficulty == len(t["plan"].splitlines())


def test_difficulty_one_sets_and_refusals() -> None:
    train = load_tasks("math-word", difficulty=1)
    held = load_tasks("math-word-held-out", difficulty=1)
    assert (len(train), len(held)) == (1000, 100)
    assert not {t["skeleton"] for t in train} & {t["skeleton"] for t in held}
    with pytest.raises(ValueError, match="difficulty must be one of"):
        wordproblems.generate(3, difficulty=4)
    from teamrl.rollout.spec import WorkflowError

    with pytest.raises(WorkflowError, match="math-word task set only"):
        load_tasks("search-qa", difficulty=1)


def test_max_number_bounds_every_written_number_and_leaves_the_default_sets_alone() -> None:
    import re

    train = load_tasks("math-word", difficulty=1, max_number=20)
    held = load_tasks("math-word-held-out", difficulty=1, max_number=20)
    assert (len(train), len(held)) == (525, 60)  # every one-step skeleton there is under 20
    assert train == load_tasks("math-word", difficulty=1, max_number=20)
    for t in train + held:
        assert max(int(x) for x in re.findall(r"\d+", t["question"])) <= 20
        assert len(t["solution"].splitlines()) == 1
    assert not {t["skeleton"] for t in train} & {t["skeleton"] for t in held}
    assert load_tasks("math-word", difficulty=1) == wordproblems.generate(1000, difficulty=1)
    with pytest.raises(ValueError, match="max_number must be at least"):
        wordproblems.generate(3, max_number=5)
    with pytest.raises(WorkflowError, match="max_number applies to the math-word"):
        load_tasks("addition", max_number=20)
