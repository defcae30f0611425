"""A team of different models under ``teamrl run`` (docs/teams.md): the
solver on the embedded Qwen2 model and the verifier on the embedded Llama model, one learner group
per base model (the Llama group with two data-parallel ranks, the Qwen2 group with one), one vLLM
engine per base in the rollout.

One run: the Qwen2 group's learner is SIGKILLed part-way (the launcher restarts it from its
checkpoint while the other group trains on), the run is stopped with SIGTERM, and ``--resume``
finishes it. Checked: every step of each group appears exactly once, each group's versions are
monotonic and end at the step count; each group's recomputed log-probs agree with its own vLLM
engine's; the trajectories carry each agent's own base model and version; the final versions are
evaluated, with each base's version in the evaluation row.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_run_survives_kills import rows

from teamrl.cli.plots import group_dir

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.usefixtures("embedded_model", "embedded_llama_model"),
]

STEPS = 10
GROUPS = ("embedded-v1", "embedded-llama")


def group_rows(run: Path, group: str) -> list[dict]:
    return rows(group_dir(run, group) / "metrics.jsonl")


def learner_pid(run: Path, group: str) -> int | None:
    """The pid of ``group``'s (one-rank) learner in this run (found by its command line)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            text = [a.decode(errors="replace") for a in (d / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if "learner" in text and group in text and str(group_dir(run, group)) in text:
            return int(d.name)
    return None


def wait_for(cond, what: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended while waiting for {what}: {proc.communicate()[0][-4000:]}"
        assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s"
        time.sleep(0.5)


def test_two_base_models_train_as_two_groups_survive_a_kill_and_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cli = [sys.executable, "-m", "teamrl.cli.main", "run", "--workflow", "addition-duo-hetero"]
    argv = [
        *cli, "--run-dir", str(run), "--steps", str(STEPS), "--tasks-per-step", "2", "--group-size", "4",
        "--eval-interval", "5", "--eval-tasks", "8", "--checkpoint-interval", "1", "--max-lag", "2",
        "--learners", "embedded-llama=2",
    ]  # fmt: skip
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: len(group_rows(run, GROUPS[0])) >= 2, "2 steps of the Qwen2 group", first)
        pid = learner_pid(run, GROUPS[0])
        assert pid is not None, "the Qwen2 group's learner is not running"
        os.kill(pid, signal.SIGKILL)
        at_kill = len(group_rows(run, GROUPS[0]))
        wait_for(lambda: len(group_rows(run, GROUPS[0])) > at_kill, "a step of the restarted group", first)
        first.send_signal(signal.SIGINT)  # Ctrl-C: exit 130 (SIGTERM: 143)
        out1, _ = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 130, out1[-5000:]
    assert "learner-embedded-v1-0 exited with" in out1 and "restarting it (1/3)" in out1, out1[-5000:]
    assert "3 learner rank(s) in 2 groups (embedded-v1, embedded-llama)" in out1
    assert len(group_rows(run, GROUPS[0])) < STEPS, "the killed group finished before the run was stopped"

    second = subprocess.run([*cli, "--resume", str(run)], capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, (second.stdout + second.stderr)[-5000:]
    finals = {}
    for g in GROUPS:
        m = group_rows(run, g)
        assert [r["step"] for r in m] == list(range(STEPS)), f"{g}: a step is missing or repeated"
        # strictly increasing; a version published after the last checkpoint is skipped on restart,
        # never issued twice (teamrl.learner.resume), so the last may be above the step count
        versions = [r["version"] for r in m]
        assert all(a < b for a, b in itertools.pairwise(versions)) and versions[-1] >= STEPS, (g, versions)
        finals[g] = versions[-1]
        # each group recomputes its own agents' log-probs on its own base, as that base's engine did
        gaps = [r["logprob_gap"] for r in m if r["logprob_gap"] == r["logprob_gap"]]  # NaN: no fresh rows
        assert gaps and max(gaps) < 0.05, (g, [r["logprob_gap"] for r in m])
        assert "resumed from" in (run / "logs" / f"learner-{g}-0.log").read_text()
    assert {k for k in group_rows(run, GROUPS[1])[-1] if k.startswith("loss/")} == {"loss/verifier-lora"}
    ev = rows(run / "eval.jsonl")
    assert ev[0]["version"] == 0 and ev[-1]["version"] == min(finals.values())
    assert ev[-1]["versions"] == finals
    assert 0.0 <= ev[-1]["solver_accuracy"] <= 1.0

    from teamrl.protocol.codec import decode_trajectories

    samples = sorted((run / "samples").glob("step-*.arrow"))
    assert samples, "no sample groups written"
    trajs = decode_trajectories(samples[-1].read_bytes())
    on = {(s.agent_id, s.model_id) for t in trajs for s in t.steps}
    assert on == {("solver", "embedded-v1"), ("verifier", "embedded-llama")}
