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

import functools
import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, Literal

HELD_OUT_PERCENT = 10
DIFFICULTIES = (1, 2, 3)  # arithmetic steps per problem (TaskSource.difficulty)
MAX_VALUE = 300
MIN_NUMBER = 10  # the smallest max_number: every step kind still has numbers to draw
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


@dataclass
class _Draft:
    """A problem being drawn: its sentences, steps, plan lines, skeleton parts and running value."""

    name: str
    pron: str
    items: str
    text: list[str] = field(default_factory=list)
    steps: list[_Step] = field(default_factory=list)
    plan: list[str] = field(default_factory=list)
    parts: list[tuple[Any, ...]] = field(default_factory=list)
    value: int = 0
    divided: bool = False

    def say(self, sentence: str, step: _Step, plan: str) -> None:
        self.text.append(sentence)
        self.steps.append(step)
        self.plan.append(plan)

    def took(self, kind: str) -> bool:
        """Record the last step in the skeleton and the running value; False when it left (0, MAX_VALUE)."""
        self.parts.append((kind, self.steps[-1].b))
        self.value = self.steps[-1].value
        return 0 < self.value < MAX_VALUE

    def record(self) -> dict[str, Any]:
        if self.divided:
            question = f"How many {self.items} does each friend get?"
        else:
            question = f"How many {self.items} does {self.name} have now?"
        return {
            "question": " ".join(self.text) + " " + question,
            "answer": str(self.value),
            "plan": "\n".join(f"{i + 1}. {p}" for i, p in enumerate(self.plan)),
            "solution": "\n".join(s.line() for s in self.steps),
        }


def _one(
    rng: random.Random, steps: int | None = None, max_number: int | None = None
) -> tuple[str, dict[str, Any]] | None:
    """One random problem as (skeleton key, record without id), or None when a draw is rejected;
    ``steps`` arithmetic steps (None: 2 or 3, drawn); ``max_number``: no number written in the
    problem above it (None: no bound beyond the generator's own ranges)."""
    n_steps = rng.choice((2, 3)) if steps is None else steps
    name, pron = rng.choice(NAMES)
    d = _Draft(name, pron, rng.choice(ITEMS))
    _opening(rng, d)
    while len(d.steps) < n_steps:
        left = n_steps - len(d.steps)
        kinds = ["add", "sub"] + (["packs"] if left >= 2 else []) + (["share"] if left == 1 else [])
        if not _STEP_KINDS[rng.choice(kinds)](rng, d):
            return None
    if any(s.value <= 0 or s.value >= MAX_VALUE for s in d.steps):
        return None
    if max_number is not None and any(x > max_number for p in d.parts for x in p if isinstance(x, int)):
        return None
    return _skeleton_key(d.parts), d.record()


def _opening(rng: random.Random, d: _Draft) -> None:
    """The first sentence: bags of items (a first step), or a plain count."""
    if rng.random() < 0.4:
        bags, per = _boxes(rng, d, f"{d.name} has", 9, 12)
        d.parts.append(("bags", bags, per))
        d.value = bags * per
    else:
        d.value = rng.randint(5, 40)
        d.text.append(f"{d.name} has {d.value} {d.items}.")
        d.parts.append(("has", d.value))


def _boxes(rng: random.Random, d: _Draft, who: str, max_boxes: int, max_per: int) -> tuple[int, int]:
    """ "<who> N boxes with M items in each.": a multiply step; returns (N, M)."""
    n, m = rng.randint(2, max_boxes), rng.randint(2, max_per)
    box = rng.choice(CONTAINERS)
    d.say(
        f"{who} {n} {box} with {m} {d.items} in each.",
        _Step("*", n, m),
        f"Multiply the {n} {box} by the {m} {d.items} in each.",
    )
    return n, m


# kind -> (operation, verbs, plan line) of a step that adds items or takes some away
_CHANGES = {
    "add": ("+", ADD_VERBS, "Add the {k} more {items}."),
    "sub": ("-", SUB_VERBS, "Subtract the {k} {items} that are gone."),
}


def _change(rng: random.Random, d: _Draft, kind: str) -> bool:
    """``k`` items added or taken away (taking away needs at least 4 there)."""
    op, verbs, plan = _CHANGES[kind]
    if op == "-" and d.value < 4:
        return False
    k = rng.randint(2, 20 if op == "+" else min(20, d.value - 1))
    d.say(
        f"{d.pron} {rng.choice(verbs).format(k=k, items=d.items)}.",
        _Step(op, d.value, k),
        plan.format(k=k, items=d.items),
    )
    return d.took(kind)


def _packs(rng: random.Random, d: _Draft) -> bool:
    """Two steps: packs of items bought (multiply), added to the count (no range check here)."""
    p, q = _boxes(rng, d, f"{d.pron} buys", 6, 10)
    d.steps.append(_Step("+", d.value, p * q))
    d.plan.append(f"Add them to the {d.items} {d.name} already has.")
    d.parts.append(("packs", p, q))
    d.value = d.steps[-1].value
    return True


def _share(rng: random.Random, d: _Draft) -> bool:
    """Share equally: the last step, and it asks a different question."""
    ks = [k for k in range(2, 10) if d.value % k == 0 and d.value // k >= 2]
    if not ks:
        return False
    k = rng.choice(ks)
    d.say(
        f"{d.pron} shares the {d.items} equally among {k} friends.",
        _Step("/", d.value, k),
        f"Divide the total by the {k} friends.",
    )
    d.divided = True
    return d.took("share")


_STEP_KINDS = {
    "add": functools.partial(_change, kind="add"),
    "sub": functools.partial(_change, kind="sub"),
    "packs": _packs,
    "share": _share,
}


def generate(
    n: int = 5000,
    seed: int = 0,
    split: Literal["train", "held-out"] = "train",
    max_draws: int | None = None,
    difficulty: int | None = None,
    max_number: int | None = None,
    at_most: bool = False,
) -> list[dict[str, Any]]:
    """``n`` problems of ``split`` (the same arguments always give the same list; no skeleton repeats).

    ``difficulty``: the arithmetic steps of every problem, 1 to 3 (None: 2 or 3, the default set, as
    before the setting existed). One-step problems have fewer distinct skeletons: at most ~1,500
    train and ~150 held-out. ``max_number`` (``MIN_NUMBER`` or more): no number written in a problem
    above it, the other half of a problem's difficulty for a small model (docs/real-model.md).

    Raises ``ValueError`` for an unknown split or difficulty, or when ``max_draws`` draws (default
    ``200 n + 10000``) do not yield ``n`` distinct problems of the split (``at_most``: the fewer
    found are the list, for bounds with fewer problems than asked).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (splits: {list(SPLITS)})")
    if difficulty is not None and difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    if max_number is not None and max_number < MIN_NUMBER:
        raise ValueError(f"max_number must be at least {MIN_NUMBER}, got {max_number!r}")
    tag_n = f"-n{max_number}" if max_number is not None else ""
    rng = random.Random(f"teamrl-wordproblems-{seed}" + (f"-d{difficulty}" if difficulty else "") + tag_n)
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    budget = max_draws if max_draws is not None else 200 * n + 10_000
    tag = "wp" if split == "train" else "wph"
    for _ in range(budget):
        if len(out) >= n:
            break
        drawn = _one(rng, difficulty, max_number)
        if drawn is None:
            continue
        key, rec = drawn
        if key in seen or split_of(key) != split:
            continue
        seen.add(key)
        out.append({"id": f"{tag}-{seed}-{len(out)}", **rec, "skeleton": key})
    if len(out) < n and not at_most:
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
