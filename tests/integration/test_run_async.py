"""``teamrl run`` in async mode: buffer, rollout and learner as separate processes over ZeroMQ.

A short run is stopped with SIGTERM part-way (everything must exit cleanly), then continued with
``--resume``: the learner goes on from its checkpoint, versions never go backwards, every step
appears once, and the run folder has metrics, held-out evaluations, samples and plots.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]

STEPS = 20


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_async_run_stops_cleanly_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cli = [sys.executable, "-m", "teamrl.cli.main", "run", "--workflow", "addition-duo"]
    argv = [
        *cli,
        "--run-dir",
        str(run),
        "--steps",
        str(STEPS),
        "--tasks-per-step",
        "2",
        "--group-size",
        "4",
        "--eval-interval",
        "2",
        "--eval-tasks",
        "20",
        "--checkpoint-interval",
        "1",
    ]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 400
    while len(rows(run / "metrics.jsonl")) < 2 and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.5)
    assert len(rows(run / "metrics.jsonl")) >= 2, first.communicate(timeout=120)[0][-4000:]
    first.send_signal(signal.SIGINT)  # Ctrl-C: exit 130 (SIGTERM: 143, test_run_async_plan.py)
    out1, _ = first.communicate(timeout=180)
    assert first.returncode == 130, out1[-4000:]
    assert "services stopped" in out1
    stopped_at = rows(run / "metrics.jsonl")
    assert len(stopped_at) < STEPS, "the run finished before it could be interrupted"
    # CURVE is the default: the run's own keys, and every service reads them from [transport]
    transport = tomllib.loads((run / "config.toml").read_text())["transport"]
    assert transport == {"curve": True, "curve_dir": str((run / "curve").resolve())}
    keys = {p.name: p.read_bytes() for p in (run / "curve").iterdir()}

    second = subprocess.run([*cli, "--resume", str(run)], capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    m = rows(run / "metrics.jsonl")
    assert [r["step"] for r in m] == list(range(STEPS)), "a step is missing or repeated after resume"
    versions = [r["version"] for r in m]
    assert versions == sorted(versions) and versions[-1] == STEPS
    assert "resumed from" in (run / "logs" / "learner-0.log").read_text()
    ev = rows(run / "eval.jsonl")
    assert ev[0]["version"] == 0 and ev[-1]["version"] == STEPS
    assert all(0.0 <= e["solver_accuracy"] <= 1.0 for e in ev)
    for name in ("reward_steps.png", "reward_time.png", "grad_norm.png"):
        assert (run / "plots" / name).stat().st_size > 1000
    from teamrl.protocol.codec import decode_trajectories

    samples = sorted((run / "samples").glob("step-*.arrow"))
    assert samples and all(decode_trajectories(p.read_bytes()) for p in samples)
    stats = rows(run / "buffer" / "stats.jsonl")
    assert stats[-1]["inserted"] >= stats[-1]["sampled"] > 0
    assert stats[-1]["producers_seen"] >= 1  # the rollout said Hello (and heartbeats) to the buffer
    # all of the above went over CURVE (data, sample RPC, Hello, weights PUB + latest): the resumed
    # run kept its keys, and no service refused a peer
    assert {p.name: p.read_bytes() for p in (run / "curve").iterdir()} == keys
    assert tomllib.loads((run / "config.toml").read_text())["transport"]["curve"] is True
    for log in (run / "logs").glob("*.log"):
        assert "CURVE: refused" not in log.read_text(), log.name
    assert "rollout rollout-" in (run / "logs" / "buffer.log").read_text()  # "... registered"
    assert "[learner]" in (run / "config.toml").read_text()


def test_run_resume_of_a_folder_that_is_not_a_run_fails_clearly(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "teamrl.cli.main", "run", "--resume", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "run.json" in res.stderr
