"""The embedded default task: two-digit addition, solved by a solver and checked by a verifier.

Why this task: no pretrained weights can be had here, so the default model is a tiny character-level
Qwen2 built offline (``teamrl model build``). Addition is learnable by such a model on 2 CPU cores in
minutes, its reward is exactly verifiable, and the two roles have different reward distributions
(the solver is right rarely at first, the verifier is right about half the time), which is the
situation Dr. MAS's agent-wise normalisation is for.

Formats (every character is one token of the embedded tokenizer; ``;`` is the end-of-answer token):
  solver    prompt ``S07+45=``      response ``52;``  (the sum, zero-padded to 3 digits: ``052;``)
  verifier  prompt ``V07+45=052?``  response ``1;`` if the candidate is right, else ``0;``
  checker   prompt ``V052?07+45=``  response ``052===1;``: a verifier that writes its check out (the
            sum, a mark per digit, the verdict; ``teamrl model build --kind checker``)
"""

from __future__ import annotations

import os
import random
from pathlib import Path

# The embedded tokenizer's character vocabulary, in id order after the special tokens.
SPECIAL_TOKENS = ["<pad>", "<bos>"]
CHARS = list("0123456789+=;?SVR")
EOS = ";"
# The embedded model's folder: `teamrl model build` (teamrl.learner.modelbuild) writes it; a new
# version number is a new folder, so a changed build never reuses an old cache.
EMBEDDED_BUILD_VERSION = 1


def embedded_model_dir() -> Path:
    """``$TEAMRL_CACHE/models/embedded-v<N>`` (``~/.cache/teamrl`` when ``TEAMRL_CACHE`` is unset)."""
    root = Path(os.environ.get("TEAMRL_CACHE", Path.home() / ".cache" / "teamrl"))
    return root / "models" / f"embedded-v{EMBEDDED_BUILD_VERSION}"


def make_task(a: int, b: int) -> dict:
    return {
        "id": f"add-{a:02d}-{b:02d}",
        "a": a,
        "b": b,
        "question": f"{a:02d}+{b:02d}=",
        "answer": f"{a + b:03d}",
    }


def split_tasks(seed: int = 0, n_eval: int = 200) -> tuple[list[dict], list[dict]]:
    """All 10,000 ordered pairs, shuffled with ``seed``; the last ``n_eval`` are held out."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    tasks = [make_task(a, b) for a, b in pairs]
    return tasks[:-n_eval], tasks[-n_eval:]


def solver_prompt(task: dict) -> str:
    return "S" + task["question"]


def verifier_prompt(task: dict, candidate: str) -> str:
    return "V" + task["question"] + candidate + "?"


def parse_answer(response: str) -> str:
    """The digits before the first ``;`` (or all digits if none)."""
    head = response.split(EOS, 1)[0]
    return "".join(ch for ch in head if ch.isdigit())


def solver_reward(task: dict, response: str) -> float:
    got = parse_answer(response)
    return 1.0 if got and int(got) == int(task["answer"]) else 0.0


def verifier_verdict(response: str) -> bool | None:
    """``1`` accept, ``0`` reject: the character before the first ``;``, so a verifier may write its
    check out first (``052==R0;``: the sum, a mark per digit, the verdict;
    docs/verifier-learning.md); None when that character is neither."""
    head = response.split(EOS, 1)[0].strip()
    return {"1": True, "0": False}.get(head[-1:])


def verifier_reward(task: dict, candidate: str, response: str) -> float:
    """1 for a correct verdict on the candidate, 0 for a wrong or unparsable one."""
    verdict = verifier_verdict(response)
    if verdict is None:
        return 0.0
    return 1.0 if verdict == (solver_reward(task, candidate) == 1.0) else 0.0


def near_miss(rng: random.Random, s: int) -> int:
    """A wrong sum close to ``s`` (off by 1, 10 or up to 30, mod 200): the build's wrong candidates."""
    return (s + rng.choice([-10, -1, 1, 10, rng.randint(-30, 30) or 2])) % 200


def warmstart_examples(rng: random.Random, tasks: list[dict], n: int) -> list[tuple[str, str]]:
    """Supervised (prompt, response) pairs for the model build: both roles, half-wrong candidates."""
    return _examples(
        rng, tasks, n, lambda t, c: (verifier_prompt(t, c), ("1" if c == t["answer"] else "0") + EOS)
    )


def _examples(rng: random.Random, tasks: list[dict], n: int, judged) -> list[tuple[str, str]]:
    """``n`` pairs: half solver examples, half ``judged(task, candidate)`` of candidates that are
    right half the time, else near misses (the draws in this order, so a seed gives one build)."""
    out = []
    for _ in range(n):
        t = rng.choice(tasks)
        if rng.random() < 0.5:
            out.append((solver_prompt(t), t["answer"] + EOS))
        else:
            s = int(t["answer"])
            out.append(judged(t, f"{s if rng.random() < 0.5 else near_miss(rng, s):03d}"))
    return out


def check_prompt(task: dict, candidate: str) -> str:
    """The checker's prompt: the candidate first, then the question (``V058?07+45=``), so the sum it
    writes follows ``07+45=`` as in the solver's prompt (docs/verifier-learning.md)."""
    return "V" + candidate + "?" + task["question"]


def check_response(task: dict, candidate: str) -> str:
    """The worked check of ``candidate``: the sum, a mark per digit (``=`` agrees, ``R`` differs),
    the verdict and EOS (``052==R0;``); :func:`verifier_verdict` reads its verdict."""
    answer = task["answer"]
    marks = "".join("=" if x == y else "R" for x, y in zip(answer, candidate.rjust(3, "0"), strict=True))
    return answer + marks + ("0" if "R" in marks else "1") + EOS


def check_examples(rng: random.Random, tasks: list[dict], n: int) -> list[tuple[str, str]]:
    """Supervised pairs for the checker build: half solver examples (the check needs the sum), half
    worked checks of candidates that are right half the time, else near misses."""
    return _examples(rng, tasks, n, lambda t, c: (check_prompt(t, c), check_response(t, c)))
