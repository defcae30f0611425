"""Math answers: extraction, string/numeric/math-verify equivalence, and the killable worker."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from fractions import Fraction

import pytest

from teamrl.rewards.base import get_reward
from teamrl.rewards.errors import TaskFormatError
from teamrl.rewards.math_reward import MathReward, extract_answer, normalize_math, to_number

TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def math_reward() -> Iterator[MathReward]:
    reward = MathReward(timeout_s=TIMEOUT_S)
    yield reward
    reward.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("first \\boxed{1} then \\boxed{\\frac{a}{\\sqrt{b^{2}}}}.", ("\\frac{a}{\\sqrt{b^{2}}}", "boxed")),
        ("\\boxed 7 is it", ("7", "boxed")),
        ("truncated \\boxed{\\frac{1}{2} ... Answer: 3", ("3", "answer_line")),
        (
            "Final Answer: The final answer is $\\frac{3}{4}$. I hope it is correct.",
            ("\\frac{3}{4}", "answer_line"),
        ),
        ("The answer is 3.5.", ("3.5", "answer_line")),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", ("72", "hashes")),
        ("we get 12 apples, then 1,250 pears and -3/4", ("-3/4", "last_number")),
        ("no digits here", None),
    ],
)
def test_extract_answer(text: str, expected: tuple[str, str] | None) -> None:
    assert extract_answer(text) == expected


def test_normalize_and_numbers() -> None:
    assert normalize_math(" $x = \\dfrac{1}{2}$. ") == "\\frac{1}{2}"
    assert normalize_math("90^\\circ") == "90"
    assert normalize_math("\\text{(B)}") == "(B)"
    assert to_number("1,234.5") == (Fraction(2469, 2), False)
    assert to_number("-\\frac{3}{4}") == (Fraction(-3, 4), False)
    assert to_number("12.5%") == (Fraction(25, 2), True)
    assert to_number("2e3") == (Fraction(2000), False)
    assert to_number("1/0") is None
    assert to_number("1e99999") is None  # exponent too large to expand in-process
    assert to_number("x+1") is None


@pytest.mark.parametrize(
    ("completion", "gold", "match"),
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", "numeric"),
        ("\\boxed{50\\%}", "0.5", "numeric"),
        ("\\boxed{50\\%}", "50", "numeric"),
        ("#### 1,000", "1000", "numeric"),
        ("\\boxed{(1, 2)}", "(1,2)", "string"),
        ("\\boxed{3}", 3, "string"),
        ("\\boxed{0.25}", 0.25, "string"),
        ("solution...\n#### 18", "Janet sells 16 - 3 - 4 = 9 eggs ... 9 * 2 = 18.\n#### 18", "string"),
    ],
)
def test_equal_without_sympy(completion: str, gold: object, match: str) -> None:
    reward = MathReward(symbolic=False)  # never starts a worker
    res = reward(completion, {"answer": gold})
    assert (res.score, res.reason, res.details["match"]) == (1.0, "ok", match)
    assert reward.worker.stats["starts"] == 0


def test_wrong_and_missing(math_reward: MathReward) -> None:
    assert math_reward("\\boxed{2}", {"answer": "3"}).reason == "wrong_answer"
    assert math_reward("I do not know", {"answer": "3"}).reason == "no_answer"
    with pytest.raises(TaskFormatError):
        math_reward("\\boxed{2}", {"solution": "2"})


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"),
        ("x^2-1", "(x-1)(x+1)"),
        ("2x+1", "1+2*x"),
        ("\\pi/2", "\\frac{\\pi}{2}"),
        ("\\sqrt{2}", "1.41421356237"),
        ("(\\frac{1}{2}, 2)", "(0.5, 4/2)"),
    ],
)
def test_symbolic_equivalence(math_reward: MathReward, pred: str, gold: str) -> None:
    res = math_reward(f"so \\boxed{{{pred}}}", {"answer": gold})
    assert (res.score, res.reason, res.details["match"]) == (1.0, "ok", "symbolic")


def test_symbolic_inequality(math_reward: MathReward) -> None:
    res = math_reward("\\boxed{x^2+1}", {"answer": "(x-1)(x+1)"})
    assert (res.score, res.reason) == (0.0, "wrong_answer")


@pytest.mark.parametrize(
    "hostile",
    [
        "__import__('os').system('true')",
        "x.__class__",
        "\\input{/etc/passwd}",
        "9**9**9**9",  # Python, not LaTeX: math-verify reads LaTeX only, and never evaluates code
        "factorial(10**10)",
    ],
)
def test_code_in_answers_is_unparsable(math_reward: MathReward, hostile: str) -> None:
    res = math_reward(f"\\boxed{{{hostile}}}", {"answer": "x"})
    assert (res.score, res.reason) == (0.0, "unparsable")


@pytest.mark.parametrize("bomb", ["9^{9^{9^{9}}}", "(10^{10})!"])
def test_explosive_math_times_out_and_worker_recovers(math_reward: MathReward, bomb: str) -> None:
    before = math_reward.worker.stats["timeouts"]
    t0 = time.monotonic()
    res = math_reward(f"\\boxed{{{bomb}}}", {"answer": "1"})
    elapsed = time.monotonic() - t0
    assert res.score == 0.0
    assert res.reason in ("timeout", "too_complex")
    assert elapsed < TIMEOUT_S + 3.0
    if res.reason == "timeout":
        assert math_reward.worker.stats["timeouts"] == before + 1
    # the next symbolic question gets a fresh worker and a right answer
    assert math_reward("\\boxed{\\sqrt{4}+x}", {"answer": "x+2"}).score == 1.0


def test_close_kills_worker_and_registry() -> None:
    reward = get_reward("math", timeout_s=TIMEOUT_S)
    assert reward("\\boxed{\\sqrt{9}}", {"answer": "y - y + 3 + 0*z"}).score == 1.0
    pid = reward.worker._proc.pid
    reward.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_rewards_computed_in_threads() -> None:
    """math-verify's SIGALRM timeouts cannot be armed off the main thread; the worker runs them on its
    own main thread, so rewards computed by a thread pool still get symbolic answers and timeouts."""
    from concurrent.futures import ThreadPoolExecutor

    reward = MathReward(timeout_s=TIMEOUT_S)
    cases = [("\\frac{\\pi}{2}", "\\pi/2", 1.0), ("x^2-1", "(x-1)(x+1)", 1.0), ("x^2+1", "(x-1)(x+1)", 0.0)]
    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda c: reward(f"\\boxed{{{c[0]}}}", {"answer": c[1]}), cases * 3))
        assert [r.score for r in got] == [c[2] for c in cases] * 3
        assert {r.reason for r in got} == {"ok", "wrong_answer"}
        with ThreadPoolExecutor(1) as pool:
            res = pool.submit(reward, "\\boxed{9^{9^{9^{9}}}}", {"answer": "1"}).result()
        assert (res.score, res.reason) == (0.0, "timeout")
    finally:
        reward.close()


def test_a_call_in_an_answer_is_never_run(math_reward: MathReward) -> None:
    # math-verify reads ``open('f')`` as LaTeX: the product o*p*e*n*(f), a wrong answer, not a call.
    res = math_reward("\\boxed{open('f')}", {"answer": "x"})
    assert (res.score, res.reason) == (0.0, "wrong_answer")


def test_without_the_last_number_fallback_only_a_marked_answer_scores() -> None:
    """``last_number=False``: noise that ends in the right number is ``unmarked`` (0); a marked answer
    scores as before; set through a workflow's ``[reward.kwargs] reward_kwargs``, as outcome passes it."""
    strict = MathReward(timeout_s=TIMEOUT_S, symbolic=False, last_number=False)
    noise = "Nine Forces of Solutauna ... a war Caldero 12"
    assert MathReward(symbolic=False)(noise, {"answer": "12"}).score == 1.0  # the default fallback
    res = strict(noise, {"answer": "12"})
    assert (res.score, res.reason, res.details["method"]) == (0.0, "unmarked", "last_number")
    assert strict("so 5 + 7 = 12\nAnswer: 12", {"answer": "12"}).reason == "ok"
    assert strict("\\boxed{11}", {"answer": "12"}).reason == "wrong_answer"
    team = get_reward("outcome", reward="math", reward_kwargs={"last_number": False, "symbolic": False})
    assert team.scorer(noise, {"answer": "12"}).reason == "unmarked"
