"""Math teams (Dr. MAS / MARFT set-ups): planner -> solver, and planner -> solver <-> verifier.

Tasks: :func:`generate` writes a seeded arithmetic/algebra set (integer expressions with
precedence, linear equations with integer roots, fraction sums, two-step word problems) whose gold
answers are exact; any GSM8K- or MATH-style JSONL/Parquet file works too
(``teamrl.rollout.workflows.data``). The reward is ``teamrl.rewards.math_reward`` on the solver's
text (``\\boxed{}``, ``Answer:`` or the last number); the planner shares the outcome; the verifier
is rewarded for a correct ``VERDICT: correct|wrong`` on the answer it read.

The base model is supplied at run time (``models.policy.path = ""``): these prompts need a real
vocabulary (any instruct model folder; the embedded char model cannot spell them).
"""

from __future__ import annotations

import random
from fractions import Fraction
from typing import Any

MODEL = "policy"

PLANNER = (
    "You are the planner of a two-agent team solving math problems. Read the problem and write a "
    "short numbered plan of the steps needed to solve it. Do not compute the final answer."
)
SOLVER = (
    "You are the solver of a math team. Follow the plan you are given, show your working briefly, "
    "and end with a line 'Answer: <value>' giving only the final value."
)
VERIFIER = (
    "You are the verifier of a math team. Check the solver's working and final answer step by step. "
    "End with exactly one line: 'VERDICT: correct' or 'VERDICT: wrong'."
)


def _agent(aid: str, profile: str, template: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "id": aid,
        "role": aid,
        "profile": profile,
        "model": MODEL,
        "adapter": f"{aid}-lora",
        "template": template,
        "sampling": {"max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0},
        **extra,
    }


def _common(roles: list[str]) -> dict[str, Any]:
    return {
        "models": {MODEL: {"path": ""}},
        "adapters": {f"{r}-lora": {"model": MODEL, "rank": 8} for r in roles},
        "tasks": {"builtin": "math-word"},  # generated 2-3 step word problems with a held-out split
    }


MATH_DUO: dict[str, Any] = {
    "name": "math-duo",
    "description": "planner -> solver on generated arithmetic/algebra (or a GSM8K/MATH JSONL)",
    **_common(["planner", "solver"]),
    "agents": [
        _agent("planner", PLANNER, "Problem: {task[question]}", 256),
        _agent("solver", SOLVER, "Problem: {task[question]}\n\nPlan:\n{out[planner]}", 512),
    ],
    "graph": {"kind": "static", "edges": [["planner", "solver"]]},
    "reward": {"name": "outcome", "kwargs": {"reward": "math", "answer_role": "solver"}},
}

MATH_TRIO: dict[str, Any] = {
    "name": "math-trio",
    "description": "planner -> solver -> verifier; 'VERDICT: wrong' sends the solver back (at most 2 times)",
    **_common(["planner", "solver", "verifier"]),
    "agents": [
        _agent("planner", PLANNER, "Problem: {task[question]}", 256),
        _agent(
            "solver",
            SOLVER,
            "Problem: {task[question]}\n\n{parents}",
            512,
            parent_format="[{agent}]\n{output}\n\n",
        ),
        _agent("verifier", VERIFIER, "Problem: {task[question]}\n\nSolver's work:\n{out[solver]}", 384),
    ],
    "graph": {
        "kind": "dynamic",
        "start": "planner",
        "edges": [
            ["planner", "solver"],
            ["solver", "solver"],
            ["verifier", "solver"],
            ["solver", "verifier"],
        ],
        "routes": [
            {"after": "planner", "next": "solver"},
            {"after": "solver", "next": "verifier"},
            {"after": "verifier", "when": "(?i)verdict:\\s*(wrong|incorrect)", "next": "solver", "limit": 2},
            {"after": "verifier", "next": "end"},
        ],
        "max_steps": 8,
    },
    "reward": {
        "name": "outcome",
        "kwargs": {"reward": "math", "answer_role": "solver", "verifier_role": "verifier"},
    },
}


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def generate(n: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` problems with exact answers; the same ``(n, seed)`` always gives the same list."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            a, b, c, d = (rng.randint(2, 60) for _ in range(4))
            q = f"What is {a} + {b} * {c} - {d}?"
            ans = Fraction(a + b * c - d)
        elif kind == 1:
            x, a, b = rng.randint(-12, 12), rng.randint(2, 9), rng.randint(-30, 30)
            c = a * x + b
            q = f"Solve for x: {a}x {'+' if b >= 0 else '-'} {abs(b)} = {c}."
            ans = Fraction(x)
        elif kind == 2:
            p, r = rng.randint(1, 9), rng.randint(1, 9)
            qd, sd = rng.randint(p + 1, 12), rng.randint(r + 1, 12)
            q = f"What is {p}/{qd} + {r}/{sd}? Give the answer as a fraction in lowest terms."
            ans = Fraction(p, qd) + Fraction(r, sd)
        else:
            boxes, per, sold = rng.randint(3, 12), rng.randint(6, 24), rng.randint(5, 40)
            sold = min(sold, boxes * per)
            q = (
                f"A shop has {boxes} boxes with {per} pencils in each box. It sells {sold} pencils. "
                "How many pencils are left?"
            )
            ans = Fraction(boxes * per - sold)
        out.append({"id": f"mathgen-{seed}-{i}", "question": q, "answer": _fmt(ans)})
    return out
