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
