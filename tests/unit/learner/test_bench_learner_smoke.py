"""``tests/bench/learner.py`` keeps running on the CPU (tiny sizes, no timing asserted).

The GPU figures in docs/gpu.md come from this bench (``scripts/gpu_check.sh``); this keeps its code
paths (update rounds, profile, weight push with the probe check, ``--push-rank``) working where CI runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "learner.py"

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]


def test_learner_bench_runs_on_the_cpu() -> None:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a world of one on its own port, whatever this pytest process set
    args = ["--rows", "4", "--prompt", "8", "--response", "8", "--rounds", "1", "--pushes", "1"]
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args, "--profile", "1", "--push-rank", "16"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "learner_ratio=" in out and "profile ours:" in out
    assert "weight push, LoRA r 16" in out and "probe log-probs match" in out
