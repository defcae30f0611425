"""``teamrl run`` survives any one process dying: the buffer, the learner and the rollout are each
SIGKILLed once, in turn, during one run, which still finishes every step.

Checked: exit code 0; the launcher restarted each killed service once and said so; every learner
step is in metrics.jsonl exactly once and versions never go backwards; the final version is
evaluated. The learner is killed before its first checkpoint: it starts again from the initial
adapters, and publishes them as a version above those it had published, which the rollout takes up
(before, it announced versions the rollout dropped as old, and the run waited with no end:
docs/reliability.md R-kill-learner). The other learner tests kill or stop it after a checkpoint.
Not checked here: duplicate or lost trajectories across the buffer's restart (the buffer's own kill -9
tests cover its checkpoint and the producers' resend).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]

STEPS = 9


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def service_pid(run: Path, name: str) -> int | None:
    """The pid of the ``teamrl <name>`` service of this run (found by its command line)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = [a.decode(errors="replace") for a in argv]
        if "teamrl.cli.main" in text and name in text and any(str(run) in a for a in text):
            return int(d.name)
    return None


def test_one_sigkill_of_each_service_in_turn_and_the_run_finishes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    argv = [
        sys.executable, "-m", "teamrl.cli.main", "run", "--workflow", "addition-duo",
        "--run-dir", str(run), "--steps", str(STEPS), "--tasks-per-step", "2", "--group-size", "4",
        "--eval-interval", "3", "--eval-tasks", "8", "--checkpoint-interval", str(STEPS - 1), "--max-lag", "8",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = []
    try:
        for at_step, name in ((2, "buffer"), (4, "learner"), (6, "rollout")):
            deadline = time.monotonic() + 600
            while len(rows(run / "metrics.jsonl")) < at_step and proc.poll() is None:
                assert time.monotonic() < deadline, f"no step {at_step} in 600 s"
                time.sleep(0.5)
            pid = service_pid(run, name)
            assert pid is not None and proc.poll() is None, f"{name} not found running"
            os.kill(pid, signal.SIGKILL)
            killed.append(name)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-5000:]
    for name in killed:
        assert f"{name}" in out and "restarting it (1/3)" in out
    assert "restarts:" in out
    m = rows(run / "metrics.jsonl")
    assert [r["step"] for r in m] == list(range(STEPS)), "a step is missing or repeated"
    versions = [r["version"] for r in m]
    assert versions == sorted(versions) and versions[-1] >= STEPS
    ev = rows(run / "eval.jsonl")
    assert ev[-1]["version"] == versions[-1], "the final version was not evaluated"
    assert "no checkpoint, resumed from the initial adapters" in (run / "logs" / "learner-0.log").read_text()
