"""Learner kill-and-resume (issue 5 item 5): kill -9 after a checkpoint, restart, same losses.

Three processes of the same worker (this file run as a script) on the embedded model, CPU, one thread
each, seeded data per step (``example_trajectories`` with token ids below the model's vocabulary):

* A trains steps 0..K-1 uninterrupted;
* B trains 0..N-1, checkpoints, keeps training (work that the kill loses) and is killed with SIGKILL;
* C loads B's checkpoint and trains to K.

C's losses (every adapter's policy loss and the critic's value loss) must match A's to 1e-5 from step
N on, and the versions C publishes start above the checkpoint's and increase. The objective is
``ppo-critic`` at token level with a KL term, two epochs and gradient accumulation, so the checkpoint
must carry every adapter engine, the critic engine and their AdamW moments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ADAPTERS = ["solver-lora", "critic-lora", "judge-lora"]
K_STEPS, N_SAVE = 6, 3


def _worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    from teamrl.learner.engine import AdapterSettings, LearnerEngine, LearnerError, init_distributed
    from teamrl.learner.modelbuild import build
    from teamrl.protocol.examples import example_trajectories

    init_distributed("cpu")
    settings = {a: AdapterSettings(lr=2e-3, clip_low=0.2, clip_high=0.28) for a in ADAPTERS}
    eng = LearnerEngine.build(
        build(),
        ADAPTERS,
        adapter_settings=settings,
        objective="ppo-critic",
        critic_level="token",
        critic_lr=1e-2,
        kl_coef=0.01,
        epochs=2,
        micro_batch_rows=8,
        logprob_tolerance=None,
        seed=7,
    )
    vocab = int(eng.model.config.vocab_size)
    out = open(args.out, "a", buffering=1)  # noqa: SIM115 (line-buffered log read by the test)
    step, version = 0, 0
    if args.resume:
        incomplete = Path(args.resume + "-incomplete")
        if incomplete.is_dir():
            try:
                eng.load_checkpoint(incomplete)
                out.write(json.dumps({"incomplete_refused": False}) + "\n")
            except LearnerError:
                out.write(json.dumps({"incomplete_refused": True}) + "\n")
        state = eng.load_checkpoint(args.resume)
        step, version = state.next_step, max(state.adapter_versions.values())
        out.write(json.dumps({"resumed": step, "version": version}) + "\n")
    while step < args.steps:
        trajs = example_trajectories(6, 1000 + step, tokens=20, turns=2, vocab=vocab)
        res = eng.train_step(trajs, step, version)
        version += 1  # "published" after every step
        rec = {"step": step, "version": version, "value_loss": res.metrics["value_loss"]} | {
            f"loss/{a}": v for a, v in res.losses.items()
        }
        out.write(json.dumps(rec) + "\n")
        step += 1
        if step == args.save_at:
            eng.save_checkpoint(args.ckpt, versions=dict.fromkeys(ADAPTERS, version))
            out.write(json.dumps({"saved": step, "version": version}) + "\n")


def _records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _spawn(tmp: Path, name: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    out = tmp / f"{name}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # each worker is a world of one on its own free port; a pytest process that initialised
    # torch.distributed earlier (other learner tests) has these set, and A and B would share its port
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 (closed when the process ends)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--out", str(out), *extra], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    return proc, out


def _wait(proc: subprocess.Popen, tmp: Path, name: str, timeout: float = 300) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert rc == 0, f"worker {name} exited {rc}:\n" + (tmp / f"{name}.log").read_text()[-3000:]


@pytest.mark.slow
@pytest.mark.usefixtures("embedded_model")
def test_kill_9_after_checkpoint_resumes_with_identical_losses(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    a, a_out = _spawn(tmp_path, "a", "--steps", str(K_STEPS))
    # B would run far past the checkpoint: it is killed while training after it
    b, b_out = _spawn(tmp_path, "b", "--steps", "1000", "--save-at", str(N_SAVE), "--ckpt", str(ckpt))
    deadline = time.monotonic() + 300
    while not any("saved" in r for r in _records(b_out)):
        assert b.poll() is None, (
            "worker b died before its checkpoint:\n" + (tmp_path / "b.log").read_text()[-3000:]
        )
        assert time.monotonic() < deadline, "worker b wrote no checkpoint in time"
        time.sleep(0.2)
    while sum("step" in r for r in _records(b_out)) <= N_SAVE:  # kill it inside post-checkpoint work
        assert b.poll() is None
        time.sleep(0.05)
    os.kill(b.pid, signal.SIGKILL)
    assert b.wait(timeout=30) == -signal.SIGKILL
    saved = next(r for r in _records(b_out) if "saved" in r)
    assert saved["saved"] == N_SAVE

    # a copy without the completion marker must be refused before the real one is loaded
    incomplete = Path(str(ckpt) + "-incomplete")
    subprocess.run(["cp", "-r", str(ckpt), str(incomplete)], check=True)
    (incomplete / "engine_state.json").unlink()
    c, c_out = _spawn(tmp_path, "c", "--steps", str(K_STEPS), "--resume", str(ckpt))
    _wait(c, tmp_path, "c")
    _wait(a, tmp_path, "a")

    c_recs = _records(c_out)
    assert {"incomplete_refused": True} in c_recs
    resumed = next(r for r in c_recs if "resumed" in r)
    assert resumed == {"resumed": N_SAVE, "version": saved["version"]}
    full = {r["step"]: r for r in _records(a_out) if "step" in r}
    after = [r for r in c_recs if "step" in r]
    assert [r["step"] for r in after] == list(range(N_SAVE, K_STEPS))
    versions = [saved["version"]] + [r["version"] for r in after]
    assert all(x < y for x, y in zip(versions, versions[1:], strict=False)), versions
    for r in after:
        want = full[r["step"]]
        assert r["version"] == want["version"]
        keys = {k for k in r if k.startswith("loss/") or k == "value_loss"}
        assert keys == {k for k in want if k.startswith("loss/") or k == "value_loss"}
        assert len(keys) == len(ADAPTERS) + 1
        for k in keys:
            assert abs(r[k] - want[k]) <= 1e-5, (r["step"], k, r[k], want[k])
    # the steps before the checkpoint really trained: the losses are not all equal
    assert len({round(full[s]["value_loss"], 6) for s in full}) > 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="learner resume worker (see the module docstring)")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-at", type=int, default=-1)
    p.add_argument("--ckpt", default="")
    p.add_argument("--resume", default="")
    _worker(p.parse_args())
