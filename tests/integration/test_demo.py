"""``teamrl demo`` (docs/results.md, "The demo"): the packaged config trains addition-duo-checked,
the solver on the embedded model and the verifier on the embedded checker, one learner group each.
A short run finishes; both groups train; held-out rows carry both bases' versions; the verifier
tells right from wrong answers from v0 on (balanced accuracy: a constant verdict scores 0.5); the
run's plots include each agent's held-out metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.usefixtures("embedded_model", "embedded_checker_model"),
]

STEPS = 4


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_the_demo_trains_a_team_whose_verifier_checks(tmp_path: Path) -> None:
    run = tmp_path / "demo"
    argv = [sys.executable, "-m", "teamrl.cli.main", "demo", "--run-dir", str(run), "--steps", str(STEPS)]
    argv += ["--tasks-per-step", "4", "--group-size", "4", "--eval-interval", "2", "--eval-tasks", "40"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    for group in ("embedded-v1", "checker"):
        steps = [r["step"] for r in rows(run / "groups" / group / "metrics.jsonl")]
        assert steps == list(range(STEPS)), group
    ev = rows(run / "eval.jsonl")
    assert ev[0]["versions"] == {"embedded-v1": 0, "checker": 0}
    assert ev[-1]["versions"] == {"embedded-v1": STEPS, "checker": STEPS}
    assert ev[0]["verifier_balanced_accuracy"] >= 0.75, ev[0]
    assert (run / "plots" / "held_out.png").stat().st_size > 1000
