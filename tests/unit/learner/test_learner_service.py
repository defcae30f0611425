"""The learner as a service: real buffer process -> real learner process -> weights announcements.

A ``teamrl buffer`` process is fed groups over ZeroMQ; a ``teamrl learner`` process samples them,
steps DeepSpeed, and announces each version inline with a sha256 and a probe; the test subscribes
like a rollout does. Then the learner is killed with SIGKILL after its checkpoint, restarted on the
same run folder, and must go on from the checkpointed step: versions never go backwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from teamrl.protocol import ports
from teamrl.protocol.codec import encode_trajectories
from teamrl.protocol.errors import PeerTimeout
from teamrl.protocol.trajectory import AgentStep, GraphTrajectory
from teamrl.protocol.zmq_transport import WeightsSubscriber, ZmqDataSender, latest_endpoint_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")


def free_port(pair: bool = False) -> int:
    return ports.free_port(2 if pair else 1)


def groups(n_groups: int, size: int, start: int, rng: np.random.Generator) -> list[GraphTrajectory]:
    """Two-agent episodes over the embedded vocabulary (ids 2..18), groups of ``size``."""
    out = []
    for g in range(start, start + n_groups):
        for k in range(size):
            steps = []
            for i, (agent, adapter) in enumerate((("solver", "solver-lora"), ("verifier", "verifier-lora"))):
                steps.append(
                    AgentStep(
                        agent_id=agent,
                        role=agent,
                        model_id="embedded-v1",
                        adapter=adapter,
                        policy_version=0,
                        turn=0,
                        parents=np.asarray([0] if i else [], np.int32),
                        prompt_ids=np.asarray([1, 16, 2, 3, 12, 4, 5, 13], np.int32),
                        response_ids=rng.integers(2, 19, size=4).astype(np.int32),
                        logprobs=np.full(4, -2.0, np.float32),
                        reward=float(rng.integers(0, 2)),
                    )
                )
            out.append(
                GraphTrajectory(
                    f"e{g}-{k}",
                    "test",
                    g * size + k,
                    f"t{g}",
                    f"g{g}",
                    "addition-duo",
                    steps,
                    reward=steps[0].reward,
                )
            )
    return out


def wait_for(pred, timeout: float, what: str, logs: Path | None = None, proc=None):
    deadline = time.monotonic() + timeout
    why = f"timed out waiting for {what}"
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            why = f"the learner exited with {proc.returncode} while waiting for {what}"
            break
        time.sleep(0.1)
    tails = ""
    if logs is not None:  # a timeout says nothing by itself: show what the services printed
        for log in sorted(logs.glob("*.log")):
            tails += f"\n--- {log.name}\n" + log.read_text(errors="replace")[-2500:]
    raise AssertionError(why + tails)


def test_learner_service_trains_publishes_and_resumes_after_kill(tmp_path: Path) -> None:
    data, sample, pub = free_port(), free_port(), free_port(pair=True)
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        "[buffer]\ngroup_size = 4\nmin_size = 8\nmax_policy_lag = 1000\nfsync = false\n"
        "checkpoint_interval_s = 0.1\n\n"
        '[learner]\nbatch_size = 8\nlogprob_tolerance = 100.0\npublish_mode = "inline"\n'
        'adapters = ["solver-lora", "verifier-lora"]\n'
        "probe_prompt = [1, 16, 2, 3, 12, 4, 5, 13]\nprobe_completion = [2, 4, 6, 14]\n"
        "checkpoint_interval = 2\nlr = 1e-3\n"
        # LangMARL rounds on: the embedded model cannot read the judge prompt, so each round is a
        # counted judge_error and weight training must go on regardless
        'profile_interval = 1\nprofiles = { planner = "Plan the steps.", solver = "Solve it." }\n'
    )
    # Not the rendezvous that an in-process test of this session wrote into os.environ: the learner
    # would read WORLD_SIZE=1 and a MASTER_PORT this process's TCPStore still holds (EADDRINUSE).
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS} | {"DS_ACCELERATOR": "cpu"}
    logs = tmp_path / "logs"
    logs.mkdir()
    cli = [sys.executable, "-m", "teamrl.cli.main"]
    buf = subprocess.Popen(
        [
            *cli,
            "buffer",
            "--config",
            str(cfg),
            "--dir",
            str(tmp_path / "buffer"),
            "--bind",
            f"tcp://127.0.0.1:{data}",
            "--sample-bind",
            f"tcp://127.0.0.1:{sample}",
            "--metrics-port",
            "0",
            "--insecure",
        ],
        stdout=open(logs / "buffer.log", "wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    run = tmp_path / "run"
    learner_argv = [
        *cli,
        "learner",
        "--config",
        str(cfg),
        "--buffer",
        f"tcp://127.0.0.1:{sample}",
        "--publish",
        f"tcp://127.0.0.1:{pub}",
        "--run-dir",
        str(run),
        "--insecure",
    ]
    sender = ZmqDataSender(f"tcp://127.0.0.1:{data}", "test-producer")
    sub = WeightsSubscriber(f"tcp://127.0.0.1:{pub}", latest_endpoint_for(f"tcp://127.0.0.1:{pub}"))
    rng = np.random.default_rng(0)
    seen: list[int] = []
    finals: list[bool] = []
    learner = None
    try:
        for i in range(0, 4):
            sender.send(encode_trajectories(groups(1, 4, i, rng)))
        assert sender.flush(30), "buffer did not ack the groups"
        learner = subprocess.Popen(
            [*learner_argv, "--set", "max_steps=100"],
            stdout=open(logs / "learner-1.log", "wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )

        last_ask = [0.0]

        def announced(upto: int):
            msg = sub.poll(100)
            if msg is None and time.monotonic() - last_ask[0] > 1.0:
                # what a rollout does when PUB is quiet: a restarted publisher's first
                # announcements can be lost while the subscription reconnects
                last_ask[0] = time.monotonic()
                try:
                    newest = sub.latest(500)
                except PeerTimeout:
                    newest = None
                if newest is not None and (not seen or newest.version > seen[-1]):
                    msg = newest
            if msg is not None:
                payload = b"".join(msg.location.chunks)
                assert hashlib.sha256(payload).hexdigest() == msg.sha256
                assert len(msg.probe.expected_logprobs) == len(msg.probe.completion_ids)
                seen.append(msg.version)
                finals.append(msg.final)
            return seen and seen[-1] >= upto

        wait_for(lambda: announced(2), 240, "versions 1 and 2", logs, learner)
        ckpt = run / "checkpoints" / "step-000002" / "DONE"
        wait_for(ckpt.is_file, 60, "the step-2 checkpoint", logs, learner)
        learner.send_signal(signal.SIGKILL)  # no chance to flush anything
        learner.wait(30)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows[:2]] == [0, 1]
        assert [r["version"] for r in rows[:2]] == [1, 2]
        assert [r["profile_version"] for r in rows[:2]] == [0.0, 0.0]  # v0 = math-duo's own profiles
        assert "rejected (judge_error)" in (logs / "learner-1.log").read_text()

        for i in range(4, 6):  # one more batch: the restarted learner makes step 2, then waits
            sender.send(encode_trajectories(groups(1, 4, i, rng)))
        assert sender.flush(30)
        # with a time budget (--max-minutes) that ran out before it started: its first step is its last
        learner = subprocess.Popen(
            [*learner_argv, "--set", "max_steps=100", "--set", "max_seconds=1", "--set", "linger_s=60"],
            stdout=open(logs / "learner-2.log", "wb"),
            stderr=subprocess.STDOUT,
            env=env | {"TEAMRL_RUN_T0": str(time.time() - 60)},
        )
        # announcements are read while the learner lives, as a rollout would (gaps healed via latest)
        wait_for(lambda: announced(3), 240, "version 3 after the restart", logs, learner)
        assert finals[seen.index(3)], "the version made after the time budget ran out is not final"
        assert not any(finals[: seen.index(3)])
        learner.send_signal(signal.SIGTERM)  # serving its final version: checkpoint and exit 0
        assert learner.wait(60) == 0, (logs / "learner-2.log").read_text()[-3000:]
        log2 = (logs / "learner-2.log").read_text()
        assert "resumed from" in log2 and "step 2, version 2" in log2
        assert re.search(r"step 2 v\d+ reward", log2), "no per-step line without --tensorboard"
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == 2 and rows[-1]["version"] == 3 and rows[-1]["final"] == 1
        assert "final" not in rows[0] and "done: serving v3" in log2
        assert seen == sorted(seen), f"versions went backwards: {seen}"
        assert (run / "checkpoints" / "step-000003" / "DONE").is_file()
    finally:
        if learner is not None and learner.poll() is None:
            learner.kill()
        sender.close()
        sub.close()
        buf.send_signal(signal.SIGTERM)
        buf.wait(30)


def test_learner_cli_refuses_a_bad_config_with_the_field_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[learner]\nbatch_size = 0\nalgorithm = "magic"\n')
    res = subprocess.run(
        [sys.executable, "-m", "teamrl.cli.main", "learner", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "batch_size" in res.stderr and "algorithm" in res.stderr
