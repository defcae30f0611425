"""A real language model through the whole system (docs/real-model.md): SmolLM2-135M-Instruct, built
from its pinned wheel, trains a text team for two learner steps in an async run (vLLM rollouts,
DeepSpeed learner, ZeroMQ buffer), and each published adapter version is probed in vLLM before
the rollout uses it.

The team is the user's path: math-duo's TOML copied and edited (shorter token budgets, a
temperature that suits a 135M model), run by file. Sized for CI: one task of two episodes per
step, no held-out evaluation.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _short_math_duo(tmp: Path) -> Path:
    from teamrl.rollout.workflows import shipped

    text = shipped()["math-duo"].read_text()
    text = text.replace("max_tokens = 256", "max_tokens = 48").replace("max_tokens = 512", "max_tokens = 64")
    text = text.replace("temperature = 1.0", "temperature = 0.7")
    path = tmp / "my-math-duo.toml"
    path.write_text(text)
    assert tomllib.loads(text)["agents"][1]["sampling"]["max_tokens"] == 64
    return path


def test_real_model_team_trains_two_steps(tmp_path: Path, smollm2_model: Path) -> None:
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "teamrl.cli.main", "run", "--workflow", str(_short_math_duo(tmp_path))]
    argv += ["--model", str(smollm2_model), "--run-dir", str(run), "--steps", "2", "--tasks-per-step", "1"]
    argv += ["--group-size", "2", "--eval-interval", "0", "--insecure"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    cfg = tomllib.loads((run / "config.toml").read_text())
    assert cfg["rollout"]["max_model_len"] < 1024  # sized from the workflow, not the model's 8,192
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in metrics] == [0, 1] and metrics[-1]["version"] == 2
    log = (run / "logs" / "rollout-0.log").read_text()
    live = re.findall(r"adapters v(\d+) live(?: on \S+)? \(probe error ([0-9.e+-]+)", log)
    assert {int(v) for v, _ in live} >= {1, 2}, log[-3000:]
    assert all(float(err) <= 1e-3 for _, err in live)
