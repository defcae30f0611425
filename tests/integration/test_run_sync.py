"""`teamrl run` end to end (sync mode): vLLM samples, Arrow over ZeroMQ, DeepSpeed steps, adapters hot-load.

Two learner steps on few tasks: this checks that every stage runs and records what it should, not
that the team learns (docs/results.md's demo figures measure that).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]


def test_run_two_steps_writes_metrics_eval_adapters_and_plots(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "teamrl.cli.main",
        "run",
        "--workflow",
        "addition-duo",
        "--mode",
        "sync",
        "--run-dir",
        str(run),
        "--steps",
        "2",
    ]
    cmd += ["--tasks-per-step", "4", "--group-size", "4", "--eval-interval", "2", "--eval-tasks", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert [r["version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["episodes"] == 16
        assert r["probe_err"] < 1e-3  # each published version was verified in vLLM
        assert "loss/solver-lora" in r and "loss/verifier-lora" in r
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]
    assert all(0.0 <= e["solver_accuracy"] <= 1.0 for e in evals)
    for v in (0, 1, 2):
        for a in ("solver-lora", "verifier-lora"):
            assert (run / "adapters" / f"v{v}" / a / "adapter_model.safetensors").is_file()
    assert {p.name for p in (run / "plots").iterdir()} >= {"reward_steps.png", "grad_norm.png"}


def test_a_spent_time_budget_makes_the_first_step_the_last(tmp_path: Path) -> None:
    """``--max-minutes`` in sync mode: the budget (0.6 s) is spent by the first step, so that step is the
    last of 5, and it is evaluated as a final step is (docs/running.md "A time budget")."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "teamrl.cli.main", "run", "--workflow", "addition-duo", "--mode", "sync"]
    cmd += ["--run-dir", str(run), "--steps", "5", "--max-minutes", "0.01", "--tasks-per-step", "2"]
    cmd += ["--group-size", "2", "--eval-interval", "5", "--eval-tasks", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["version"]) for r in rows] == [(0, 1)]
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1]


def test_run_help_is_fast_and_documents_flags() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "teamrl.cli.main", "run", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    for flag in ("--steps", "--group-size", "--algorithm", "--update-order", "--run-dir"):
        assert flag in proc.stdout
