"""Write a task file of two-number sums and differences ("What is 27 + 15?"), for a user's-own-tasks run.

The file is what ``teamrl run --tasks`` and ``teamrl eval --tasks`` read (JSONL: ``id``, ``question``,
``answer``); the last tenth is the held-out split. Used in docs/real-model.md to find a level where
SmolLM2-135M-Instruct is between 10 and 60 % before RL.

    python tests/bench/tasks/make_two_number.py [--n 1000] [--low 10] [--high 60] [--seed 0] OUT.jsonl
    python tests/bench/tasks/make_two_number.py --unique --low 1 --high 15 OUT.jsonl

``--unique`` writes every distinct question of the range once (a + b, and a - b with a >= b), in an
order shuffled by ``--seed``, so the held-out tenth shares no question with the training part
(1 to 15: 345 questions, 34 held out).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def tasks(n: int, low: int, high: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        if rng.random() < 0.5:
            q, ans = f"What is {a} + {b}?", a + b
        else:
            a, b = max(a, b), min(a, b)
            q, ans = f"What is {a} - {b}?", a - b
        out.append({"id": f"two-{seed}-{i}", "question": q, "answer": str(ans)})
    return out


def unique_tasks(low: int, high: int, seed: int) -> list[dict[str, str]]:
    pairs = [(a, b, "+") for a in range(low, high + 1) for b in range(low, high + 1)]
    pairs += [(a, b, "-") for a in range(low, high + 1) for b in range(low, a + 1)]
    random.Random(seed).shuffle(pairs)
    return [
        {
            "id": f"two-u{i}",
            "question": f"What is {a} {op} {b}?",
            "answer": str(a + b if op == "+" else a - b),
        }
        for i, (a, b, op) in enumerate(pairs)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--low", type=int, default=10)
    p.add_argument("--high", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--unique", action="store_true", help="every distinct question of the range once")
    a = p.parse_args()
    rows = unique_tasks(a.low, a.high, a.seed) if a.unique else tasks(a.n, a.low, a.high, a.seed)
    Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} tasks to {a.out}")


if __name__ == "__main__":
    main()
