"""The embedded model's workflows: two-digit addition in its character vocabulary.

``addition-duo`` is exactly the episode ``teamrl run`` has run since the first demo (and that
``teamrl.rollout.runner`` writes out by hand): the solver answers ``S07+45=``; the verifier, whose
step depends on the solver's (``parents=[0]``), judges ``V07+45=052?`` where ``052`` is the
solver's answer cut/padded to three digits; both sample at most 5 tokens and stop at ``;`` (id 14);
act ``k`` is seeded ``seed + k``. Rewards are :mod:`teamrl.rewards.addition`'s.

``addition-trio`` adds the dynamic dependency function: a verdict ``0`` sends the solver back
(re-sampling the same prompt, a new turn), at most twice; a ``1`` or the third rejection ends the
episode. Its trajectory reward is the final answer's; each turn's reward is that turn's answer.
"""

from __future__ import annotations

from typing import Any

MODEL = "embedded-v1"
_SAMPLING = {"max_tokens": 5, "temperature": 1.0, "top_p": 1.0, "stop": [], "stop_token_ids": [14]}


def _agents() -> list[dict[str, Any]]:
    return [
        {
            "id": "solver",
            "role": "solver",
            "model": MODEL,
            "adapter": "solver-lora",
            "template": "S{task[question]}",
            "output": "addition_candidate",
            "sampling": dict(_SAMPLING),
            "chat": False,
        },
        {
            "id": "verifier",
            "role": "verifier",
            "model": MODEL,
            "adapter": "verifier-lora",
            "template": "V{task[question]}{out[solver]}?",
            "sampling": dict(_SAMPLING),
            "chat": False,
        },
    ]


_COMMON: dict[str, Any] = {
    "models": {MODEL: {"path": ""}},
    "adapters": {"solver-lora": {"model": MODEL, "rank": 8}, "verifier-lora": {"model": MODEL, "rank": 8}},
    "reward": {"name": "addition"},
    "tasks": {"builtin": "addition"},
}

ADDITION_DUO: dict[str, Any] = {
    "name": "addition-duo",
    "description": "solver -> verifier on two-digit addition (both agents on the embedded model)",
    **_COMMON,
    "agents": _agents(),
    "graph": {"kind": "static", "edges": [["solver", "verifier"]]},
}

ADDITION_TRIO: dict[str, Any] = {
    "name": "addition-trio",
    "description": "solver -> verifier; a rejection sends the solver back (at most 2 retries)",
    **_COMMON,
    "agents": _agents(),
    "graph": {
        "kind": "dynamic",
        "start": "solver",
        "edges": [["solver", "verifier"]],
        "routes": [
            {"after": "solver", "next": "verifier"},
            {"after": "verifier", "when": "^0", "next": "solver", "limit": 2},
            {"after": "verifier", "next": "end"},
        ],
        "max_steps": 6,
    },
}
