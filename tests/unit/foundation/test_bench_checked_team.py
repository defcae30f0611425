"""``tests/bench/checked_team.py`` reads a run's held-out rows into the figures it reports (the bench
itself trains for minutes per seed; docs/verifier-learning.md quotes a run of it)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "checked_team.py"


def _bench():
    sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("checked_team", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_run_folder_is_summarised_from_its_held_out_rows(tmp_path: Path) -> None:
    rows = [
        {"step": 0, "solver_accuracy": 0.695, "verifier_balanced_accuracy": 0.943},
        {"step": 10, "solver_accuracy": 0.775, "verifier_balanced_accuracy": 1.0},
        {"step": 20, "solver_accuracy": 0.77, "verifier_balanced_accuracy": 0.989},
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = _bench().run_summary(tmp_path)
    assert got == {
        "verifier_ba_v0": 0.943,
        "verifier_ba_best": 1.0,
        "verifier_ba_end": 0.989,
        "solver_v0": 0.695,
        "solver_end": 0.77,
    }
    assert _bench().run_summary(tmp_path / "missing") == {}


def test_the_summary_is_written_as_a_table(tmp_path: Path) -> None:
    bench = _bench()
    runs = [{"verifier_ba_end": 1.0, "wall_s": 240.0}, {"verifier_ba_end": 0.98, "wall_s": 250.0}]
    stats = {k: bench.mean_ci([r.get(k) for r in runs]) for k in bench.LABELS}
    summary = {"runs": runs, "base": {}, "stats": stats, "gain": bench.mean_ci([0.2, 0.22]), "steps": 40}
    bench.write_docs(tmp_path / "docs", summary)
    table = (tmp_path / "docs" / "table.md").read_text()
    assert "| verifier balanced accuracy, end | 0.990 ± 0.127 |" in table
    assert "over 2 seeds (40 steps each)" in table and "| wall time of a run (s) | 245.0 ± 63.5 |" in table
    assert json.loads((tmp_path / "docs" / "summary.json").read_text())["steps"] == 40
