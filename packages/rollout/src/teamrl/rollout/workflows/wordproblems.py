"""Synthetic multi-step arithmetic word problems with a fixed train / held-out split.

Task sets ``math-word`` (training) and ``math-word-held-out`` (evaluation) of
``teamrl.rollout.workflows.load_tasks``; the math workflows (math-duo, math-trio) read them like any
other task set. Each problem takes 2 or 3 arithmetic steps on small integers (``+``, ``-``, ``*`` and
exact ``/``; every intermediate value is a positive integer below 300), e.g.::

    Mia has 4 bags with 6 apples in each bag. She buys 7 more apples. How many apples does Mia have now?
    4 * 6 = 24
    24 + 7 = 31

A task record is ``{"id", "question", "answer", "plan", "solution"}``: ``answer`` is the gold value as
a string (what ``teamrl.rewards.math_reward`` compares), ``plan`` a numbered list of the steps
without their results and ``solution`` one ``a op b = c`` line per step (both used to write
demonstrations for the embedded text model's warm start, ``teamrl.models.text``;
docs/workflows.md describes the held-out split).

Design decisions:

* **The split is by arithmetic, not by wording.** A problem's *skeleton* is its sequence of
  operations and operands; a stable hash of the skeleton puts it in the held-out split
  (``HELD_OUT_PERCENT`` of all skeletons) or in train. Names, objects and verbs are drawn
  independently, so no held-out problem is a train problem with another name: the two splits share
  no skeleton, hence no question.
* **Deterministic and unique.** ``generate(n, seed, split)`` draws from ``random.Random(seed)`` and
  keeps the first ``n`` problems of the split whose skeleton is new; the same arguments always give
  the same list, and one list never repeats a skeleton.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Literal

HELD_OUT_PERCENT = 10
MAX_VALUE = 300
SPLITS = ("train", "held-out")

NAMES = (
    ("Mia", "She"),
    ("Tom", "He"),
    ("Ana", "She"),
    ("Leo", "He"),
    ("Sara", "She"),
    ("Ben", "He"),
    ("Nina", "She"),
    ("Omar", "He"),
    ("Lily", "She"),
    ("Sam", "He"),
    ("Zoe", "She"),
    ("Raj", "He"),
    ("Eva", "She"),
    ("Max", "He"),
    ("Ivy", "She"),
    ("Kai", "He"),
)
ITEMS = (
    "apples",
    "pencils",
    "stickers",
    "marbles",
    "cards",
    "books",
    "coins",
    "shells",
    "cookies",
    "stamps",
    "beads",
    "eggs",
    "toy cars",
    "flowers",
)
CONTAINERS = ("bags", "boxes", "jars", "baskets", "packs", "trays")
ADD_VERBS = ("buys {k} more {items}", "finds {k} more {items}", "gets {k} more {items} from a friend")
SUB_VERBS = ("gives away {k} {items}", "loses {k} {items}", "uses {k} {items}", "sells {k} {items}")


@dataclass(frozen=True)
class _Step:
    op: str  # "+", "-", "*", "/"
    a: int
    b: int

    @property
    def value(self) -> int:
        if self.op == "+":
            return self.a + self.b
        if self.op == "-":
            return self.a - self.b
        if self.op == "*":
            return self.a * self.b
        return self.a // self.b

    def line(self) -> str:
        return f"{self.a} {self.op} {self.b} = {self.value}"


def _skeleton_key(parts: list[tuple[Any, ...]]) -> str:
    return ";".join(",".join(str(x) for x in p) for p in parts)


def split_of(skeleton: str) -> str:
    """``"held-out"`` for ``HELD_OUT_PERCENT`` % of skeletons (a stable hash), else ``"train"``."""
    h = int(hashlib.sha256(skeleton.encode()).hexdigest()[:8], 16)
    return "held-out" if h % 100 < HELD_OUT_PERCENT else "train"


def _one(rng: random.Random) -> tuple[str, dict[str, Any]] | None:
    """One random problem as (skeleton key, record without id), or None when a draw is rejected."""
    n_steps = rng.choice((2, 3))
    name, pron = rng.choice(NAMES)
    items = rng.choice(ITEMS)
    parts: list[tuple[Any, ...]] = []
    steps: list[_Step] = []
    plan: list[str] = []
    if rng.random() < 0.4:
        bags, per = rng.randint(2, 9), rng.randint(2, 12)
        box = rng.choice(CONTAINERS)
        text = [f"{name} has {bags} {box} with {per} {items} in each."]
        steps.append(_Step("*", bags, per))
        plan.append(f"Multiply the {bags} {box} by the {per} {items} in each.")
        parts.append(("bags", bags, per))
        value = bags * per
    else:
        value = rng.randint(5, 40)
        text = [f"{name} has {value} {items}."]
        parts.append(("has", value))
    divided = False
    while len(steps) < n_steps:
        left = n_steps - len(steps)
        kinds = ["add", "sub"] + (["packs"] if left >= 2 else []) + (["share"] if left == 1 else [])
        kind = rng.choice(kinds)
        if kind == "add":
            k = rng.randint(2, 20)
            text.append(f"{pron} {rng.choice(ADD_VERBS).format(k=k, items=items)}.")
            steps.append(_Step("+", value, k))
            plan.append(f"Add the {k} more {items}.")
        elif kind == "sub":
            if value < 4:
                return None
            k = rng.randint(2, min(20, value - 1))
            text.append(f"{pron} {rng.choice(SUB_VERBS).format(k=k, items=items)}.")
            steps.append(_Step("-", value, k))
            plan.append(f"Subtract the {k} {items} that are gone.")
        elif kind == "packs":
            p, q = rng.randint(2, 6), rng.randint(2, 10)
            box = rng.choice(CONTAINERS)
            text.append(f"{pron} buys {p} {box} with {q} {items} in each.")
            steps.append(_Step("*", p, q))
            steps.append(_Step("+", value, p * q))
            plan.append(f"Multiply the {p} {box} by the {q} {items} in each.")
            plan.append(f"Add them to the {items} {name} already has.")
            parts.append(("packs", p, q))
            value = steps[-1].value
            continue
        else:  # share equally: the last step, and it asks a different question
            ks = [k for k in range(2, 10) if value % k == 0 and value // k >= 2]
            if not ks:
                return None
            k = rng.choice(ks)
            text.append(f"{pron} shares the {items} equally among {k} friends.")
            steps.append(_Step("/", value, k))
            plan.append(f"Divide the total by the {k} friends.")
            divided = True
        parts.append((kind, steps[-1].b))
        value = steps[-1].value
        if value <= 0 or value >= MAX_VALUE:
            return None
    if any(s.value <= 0 or s.value >= MAX_VALUE for s in steps):
        return None
    question = (
        f"How many {items} does each friend get?" if divided else f"How many {items} does {name} have now?"
    )
    record = {
        "question": " ".join(text) + " " + question,
        "answer": str(value),
        "plan": "\n".join(f"{i + 1}. {p}" for i, p in enumerate(plan)),
        "solution": "\n".join(s.line() for s in steps),
    }
    return _skeleton_key(parts), record


def generate(
    n: int = 5000, seed: int = 0, split: Literal["train", "held-out"] = "train", max_draws: int | None = None
) -> list[dict[str, Any]]:
    """``n`` problems of ``split`` (the same arguments always give the same list; no skeleton repeats).

    Raises ``ValueError`` for an unknown split, or when ``max_draws`` draws (default ``200 n + 10000``)
    do not yield ``n`` distinct problems of the split.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (splits: {list(SPLITS)})")
    rng = random.Random(f"teamrl-wordproblems-{seed}")
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    budget = max_draws if max_draws is not None else 200 * n + 10_000
    tag = "wp" if split == "train" else "wph"
    for _ in range(budget):
        if len(out) >= n:
            break
        drawn = _one(rng)
        if drawn is None:
            continue
        key, rec = drawn
        if key in seen or split_of(key) != split:
            continue
        seen.add(key)
        out.append({"id": f"{tag}-{seed}-{len(out)}", **rec, "skeleton": key})
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct {split} problems in {budget} draws (asked for {n})")
    return out


def check(task: dict[str, Any]) -> bool:
    """True when the record's solution lines are right and end at its answer (a self-test)."""
    last = None
    for line in task["solution"].splitlines():
        lhs, rhs = line.split(" = ")
        a, op, b = lhs.split(" ")
        x, y, z = int(a), int(b), int(rhs)
        want = {"+": x + y, "-": x - y, "*": x * y, "/": x // y if y and x % y == 0 else None}[op]
        if want != z:
            return False
        last = z
    return last is not None and str(last) == task["answer"]
