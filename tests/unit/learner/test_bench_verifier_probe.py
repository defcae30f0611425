"""``tests/bench/verifier_probe.py`` keeps running (a few steps of each format; no figure asserted).

docs/verifier-learning.md quotes a full run of it; this keeps its code paths working where CI runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "verifier_probe.py"

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]


def test_verifier_probe_runs_every_format() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--steps", "3", "--every", "3"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "AUC" in out and "greedy balanced accuracy" in out
    for fmt in ("plain", "recompute", "compare", "compare-adjacent"):
        assert f"  {fmt} step 3: verdict loss" in out, fmt
    assert "plain: held-out verdict balanced accuracy" in out


def test_verifier_probe_trains_from_scratch() -> None:
    args = ["--init", "scratch", "--layers", "1", "--formats", "compare", "--steps", "2", "--every", "2"]
    proc = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "  compare step 2: verdict loss" in proc.stdout


def test_verifier_probe_refuses_an_unknown_format() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--formats", "plain,riddle"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "unknown format(s): riddle" in proc.stderr
