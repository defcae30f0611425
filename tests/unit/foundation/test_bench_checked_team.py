"""``tests/bench/checked_team.py`` reads a run's held-out rows into the figures it reports (the bench
itself trains for minutes per seed; README, "Verifier learning", quotes a run of it)."""

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
