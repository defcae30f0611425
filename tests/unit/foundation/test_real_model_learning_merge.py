"""``tests/bench/real_model_learning.py --merge``: seeds of an earlier ``summary.json`` join a new run's
table only where it ran the same settings (docs/real-model.md, "Seeds 6 and 7"), without running teamrl."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import real_model_learning as rml  # noqa: E402

SETTINGS = {"workflow": "duo.toml", "model": "smollm2-135m", "steps": 28, "tasks_per_step": 4}
SETTINGS |= {"group_size": 8, "lr": 5e-4, "max_lag": 1, "n": 4, "temperature": None}
SETTINGS |= {"set": ["learner.dtype=bfloat16"], "max_minutes": 30.0, "tasks_sha256": "ab"}


def earlier(tmp_path: Path, **changed: object) -> Path:
    old = {k: v for k, v in SETTINGS.items() if k != "max_minutes"} | changed  # as older summaries: no budget
    old |= {
        "runs": [{"seed": 1, "wall_s": 1500}],
        "base_evals": [{"avg@4": 0.1}],
        "end_evals": [{"avg@4": 0.3}],
    }
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(old))
    return path


def test_an_earlier_summary_of_the_same_settings_gives_its_seeds(tmp_path: Path) -> None:
    args = argparse.Namespace(**SETTINGS, merge=str(earlier(tmp_path)))
    prior = rml.earlier_seeds(args, [6, 7])
    assert [r["seed"] for r in prior["runs"]] == [1] and prior["end_evals"] == [{"avg@4": 0.3}]
    assert rml.earlier_seeds(argparse.Namespace(**SETTINGS, merge=""), [6])["runs"] == []


def test_other_settings_or_the_same_seeds_are_refused(tmp_path: Path) -> None:
    args = argparse.Namespace(**SETTINGS, merge=str(earlier(tmp_path, lr=1e-3, set=[])))
    with pytest.raises(
        SystemExit, match=r"ran other settings: lr: 0.001 there, 0.0005 here; set: \[\] there"
    ):
        rml.earlier_seeds(args, [6])
    args = argparse.Namespace(**SETTINGS, merge=str(earlier(tmp_path)))
    with pytest.raises(SystemExit, match=r"already has seeds \[1\]"):
        rml.earlier_seeds(args, [1, 6])
