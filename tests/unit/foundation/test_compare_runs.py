"""The seeds comparison's statistics and table (tests/bench/compare_runs.py), without running teamrl:
mean and 95 % CI by Student's t, paired differences, the table row and the merged table."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import compare_runs as cr  # noqa: E402


def test_mean_and_confidence_interval_follow_students_t() -> None:
    m, h, n = cr.mean_ci([0.5, 0.6, 0.55, 0.58, 0.52])
    sd = 0.0412310562561766  # sample standard deviation of those five
    assert n == 5 and m == pytest.approx(0.55) and h == pytest.approx(2.776 * sd / math.sqrt(5), rel=1e-3)
    assert cr.mean_ci([0.3, None, float("nan")])[::2] == (0.3, 1)  # one finite value: no interval
    assert math.isnan(cr.mean_ci([0.3])[1]) and cr.mean_ci([])[2] == 0
    assert cr.fmt((0.5, 0.05, 5)) == "0.500 ± 0.050" and cr.fmt((0.5, math.nan, 1)) == "0.500"


def test_paired_differences_and_the_table(tmp_path: Path) -> None:
    runs = {
        "grpo": [
            {"end": 0.40, "best": 0.5, "time_to_target": None, "wall_s": 100.0, "spike/s": 2.0},
            {"end": 0.44},
        ],
        "drmas": [
            {"end": 0.50, "best": 0.6, "time_to_target": 40.0, "wall_s": 95.0, "spike/s": 3.0},
            {"end": 0.52},
        ],
    }
    st = cr.statistics_of(runs)
    d_mean, d_half, d_n = st["difference"]["end"]
    sd = math.sqrt(((0.10 - 0.09) ** 2 + (0.08 - 0.09) ** 2) / 1)  # the paired differences 0.10, 0.08
    assert d_n == 2 and d_mean == pytest.approx(0.09) and d_half == pytest.approx(12.706 * sd / math.sqrt(2))
    assert st["difference"]["spike/s"] == (1.0, st["difference"]["spike/s"][1], 1)
    row = cr.table_row("algorithm", ["--steps", "40"], st, ["grpo", "drmas"], 2)
    assert row.startswith("| algorithm | `tests/bench/compare_runs.py algorithm --steps 40` | end held-out")
    assert "paired difference 0.090 ±" in row and "(2 seeds, 95 % CI) |" in row
    saved = tmp_path / "runs" / "algorithm"
    saved.mkdir(parents=True)
    (saved / "table.md").write_text(row + "\n")
    (saved / "summary.json").write_text(json.dumps({"what": "algorithm"}))
    assert cr.main(["table", str(tmp_path / "runs"), str(tmp_path / "docs")]) == 0
    text = (tmp_path / "docs" / "README.md").read_text()
    assert row in text and (tmp_path / "docs" / "algorithm-summary.json").is_file()


def test_each_adapters_gradient_norm_is_summarised_and_shown_without_an_evaluation(tmp_path: Path) -> None:
    """A run with ``--eval-interval 0`` (a real model's short comparison): its row is the per-adapter
    gradient norms; the first update's norm (``grad0/``: both settings of a seed see the same rollouts)
    and the median over steps are in the summary."""
    run = tmp_path / "grpo-seed0"
    run.mkdir()
    rows = [{"step": i, "grad_norm/solver-lora": g, "grad_norm/planner-lora": 1.0} for i, g in enumerate([4.0, 2.0, 3.0])]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = cr.summarise(run, 10.0, 0.5)
    assert "end" not in got and got["grad0/solver-lora"] == 4.0 and got["grad_median/solver-lora"] == 3.0
    assert got["spike/solver-lora"] == pytest.approx(4.0 / 3.0)
    st = cr.statistics_of({"grpo": [got, got], "drmas": [dict(got, **{"grad_median/solver-lora": 1.0})] * 2})
    row = cr.table_row("algorithm", [], st, ["grpo", "drmas"], 2)
    assert "end held-out" not in row and "median gradient norm" in row
    assert "solver-lora grpo 3.000 ± 0.000, drmas 1.000 ± 0.000" in row


def test_finished_runs_are_reused_and_the_factor_clip_row_is_the_first_update(tmp_path: Path, capsys) -> None:
    """``--reuse`` summarises run folders that hold ``--steps`` steps instead of running them again
    (none is run here: no ``teamrl run`` could start without a model); a folder with fewer steps is not
    a finished run. Comparison (d)'s row is each adapter's first-update gradient norm."""
    for name, g in (("unclipped", 40.0), ("clipped", 0.3)):
        run = tmp_path / f"{name}-seed1"
        run.mkdir()
        rows = [{"step": i, "time": 50.0 * (i + 1), "grad_norm/solver-lora": g / (i + 1)} for i in range(2)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "clipped-seed1" / "compare.json").write_text(json.dumps({"wall_s": 123.0}))
    assert cr.finished_wall(tmp_path / "unclipped-seed1", 3) is None  # 2 of 3 steps: not finished
    assert cr.finished_wall(tmp_path / "unclipped-seed1", 2) == 100.0  # no compare.json: the last step's time
    argv = ["factor-clip", "--steps", "2", "--seed", "1", "--seeds", "1", "--eval-interval", "0", "--reuse"]
    assert cr.main([*argv, "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["runs"]["clipped"][0]["wall_s"] == 123.0
    assert summary["runs"]["unclipped"][0]["grad0/solver-lora"] == 40.0
    row = (tmp_path / "table.md").read_text()
    assert "first-update gradient norm solver-lora unclipped 40.000, clipped 0.300" in row
    assert "compare_factor_clip=nan" in capsys.readouterr().out
