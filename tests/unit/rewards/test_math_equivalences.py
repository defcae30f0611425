"""The tricky equivalences of tests/bench/math_matching.py (docs/math-matching.md) under math-verify."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from teamrl.rewards.math_reward import MathReward

BENCH = Path(__file__).resolve().parents[2] / "bench" / "math_matching.py"
_spec = importlib.util.spec_from_file_location("math_matching", BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

KNOWN_MISSES = {"Euler"}  # math-verify does not evaluate e^{i\pi}; listed in docs/math-matching.md


@pytest.fixture(scope="module")
def reward() -> Iterator[MathReward]:
    r = MathReward(timeout_s=3.0)
    yield r
    r.close()


@pytest.mark.parametrize(("completion", "gold", "want", "what"), bench.CASES, ids=[c[3] for c in bench.CASES])
def test_case(reward: MathReward, completion: str, gold: str, want: float, what: str) -> None:
    got = reward(completion, {"answer": gold}).score
    if what in KNOWN_MISSES:
        assert got != want
    else:
        assert got == want
