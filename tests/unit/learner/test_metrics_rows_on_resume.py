"""A resumed learner redoes the steps after its last checkpoint; metrics.jsonl keeps each step once."""

from __future__ import annotations

import json
from pathlib import Path

from teamrl.learner.service import drop_rows_from


def test_rows_of_redone_steps_and_a_torn_line_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "version": s + 1} for s in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "vers')  # killed mid-write
    assert drop_rows_from(path, 4) == 3  # steps 4, 5 and the torn line
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2, 3]
    assert drop_rows_from(path, 4) == 0 and drop_rows_from(tmp_path / "none.jsonl", 0) == 0
