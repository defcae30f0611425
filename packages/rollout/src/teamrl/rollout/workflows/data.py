"""Task data: read JSONL or Parquet, normalise the common public formats, shard across replicas.

A task is a plain dict with an ``"id"`` plus the fields its workflow's templates and reward read:

* math (``gsm8k``: ``question`` + ``answer`` ending in ``#### 42``; ``math``: ``problem`` +
  ``solution`` with ``\\boxed{}``, or ``answer``) -> ``{"id", "question", "answer"}``; the gold
  answer is kept as the data set writes it (``teamrl.rewards.math_reward`` extracts ``####`` and
  ``\\boxed`` from golds itself);
* QA (``nq``: ``question`` + ``answer``/``answers`` list; ``hotpotqa``: ``_id``, ``question``,
  ``answer``) -> ``{"id", "question", "answers"}``;
* code (``humaneval``: ``task_id``, ``prompt``, ``test``, ``entry_point``) -> the same fields plus
  ``"id"`` and ``"question"`` (= the prompt);
* ``plain``: records as they are (an ``id`` is added when missing); ``auto`` picks by fields.

Records are foreign input: a record that fits no format raises ``DatasetError`` naming the file,
the line and the fields it has.

Sharding is round-robin over the file order: ``shard(tasks, i, n) = tasks[i::n]`` is
deterministic, the shards are disjoint and together cover every task, and their sizes differ by
at most one.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from teamrl.rewards.errors import DatasetError

FORMATS = ("auto", "plain", "gsm8k", "math", "nq", "hotpotqa", "humaneval")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a ``.jsonl`` / ``.jsonl.gz`` / ``.json`` (a list) / ``.parquet`` file."""
    path = Path(path)
    name = path.name.lower()
    if not path.is_file():
        raise DatasetError(f"task file {path} does not exist")
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a bad file
            raise DatasetError(f"{path}: not a readable Parquet file: {e}") from e
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        if name.endswith(".json"):
            try:
                data = json.load(f)
            except ValueError as e:
                raise DatasetError(f"{path}: not JSON: {e}") from e
            if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
                raise DatasetError(f"{path}: a .json task file must hold a list of objects")
            return data
        out = []
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise DatasetError(f"{path}:{n}: not JSON: {e}") from e
            if not isinstance(rec, dict):
                raise DatasetError(
                    f"{path}:{n}: a task record must be a JSON object, got {type(rec).__name__}"
                )
            out.append(rec)
        return out


def detect_format(rec: Mapping[str, Any]) -> str:
    if {"prompt", "test", "entry_point"} <= rec.keys():
        return "humaneval"
    if "problem" in rec and ("solution" in rec or "answer" in rec):
        return "math"
    if "question" in rec and isinstance(rec.get("answer"), str) and "####" in rec["answer"]:
        return "gsm8k"
    if "question" in rec and "_id" in rec:
        return "hotpotqa"
    if "question" in rec and ("answers" in rec or isinstance(rec.get("answer"), list)):
        return "nq"
    return "plain"


def normalise(rec: Mapping[str, Any], fmt: str, default_id: str, where: str = "") -> dict[str, Any]:
    """One record as a task dict (see the module docstring)."""
    if fmt not in FORMATS:
        raise DatasetError(f"unknown task format {fmt!r} (known: {FORMATS})")
    if fmt == "auto":
        fmt = detect_format(rec)
    rec = dict(rec)

    def need(*keys: str) -> None:
        missing = [k for k in keys if k not in rec]
        if missing:
            raise DatasetError(f"{where}: {fmt} record lacks {missing} (fields: {sorted(rec)})")

    rid = str(rec.get("id", rec.get("_id", rec.get("task_id", default_id))))
    if fmt == "plain":
        return {**rec, "id": rid}
    if fmt == "gsm8k":
        need("question", "answer")
        return {"id": rid, "question": rec["question"], "answer": rec["answer"]}
    if fmt == "math":
        need("problem")
        if "answer" not in rec and "solution" not in rec:
            raise DatasetError(
                f"{where}: math record has neither 'answer' nor 'solution' (fields: {sorted(rec)})"
            )
        return {"id": rid, "question": rec["problem"], "answer": rec.get("answer", rec.get("solution"))}
    if fmt in ("nq", "hotpotqa"):
        need("question")
        answers = rec.get("answers", rec.get("answer"))
        if isinstance(answers, Mapping) and "text" in answers:
            answers = answers["text"]
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, Sequence) or not answers or not all(isinstance(a, str) for a in answers):
            raise DatasetError(
                f"{where}: {fmt} record needs 'answer' or 'answers' as strings, got {answers!r:.100}"
            )
        return {"id": rid, "question": rec["question"], "answers": list(answers)}
    need("prompt", "test", "entry_point")
    return {**rec, "id": rid, "question": rec["prompt"]}


def load_task_file(path: str | Path, fmt: str = "auto") -> list[dict[str, Any]]:
    """A task file as normalised task dicts, in file order."""
    path = Path(path)
    stem = path.name.split(".")[0]
    return [
        normalise(r, fmt, f"{stem}-{i}", f"{path} record {i + 1}") for i, r in enumerate(read_records(path))
    ]


def shard(tasks: Sequence[Any], replica_index: int, num_replicas: int) -> list[Any]:
    """Replica ``replica_index``'s tasks: every ``num_replicas``-th (disjoint, covering, deterministic)."""
    if num_replicas < 1 or not 0 <= replica_index < num_replicas:
        raise ValueError(f"replica {replica_index} is outside 0..{num_replicas - 1}")
    return list(tasks[replica_index::num_replicas])
