"""No start-up wait without a deadline: DeepSpeed's CPU op build lock (``init_distributed``).

Fast tests stand in for the build (``ShareMemCommBuilder.load`` replaced by a stub that fails, as
torch would hang, if the build lock is still there); the slow one kills a real learner during a real
build in an empty ``TORCH_EXTENSIONS_DIR`` and starts another, which must start."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from teamrl.learner import distributed as engine  # the op build lives with the rendezvous

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fcntl, /proc")


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.fixture
def ext_dir(tmp_path: Path, monkeypatch) -> SimpleNamespace:
    """An extensions folder and a stub build that records its calls."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builder = type(get_accelerator().create_op_builder("ShareMemCommBuilder"))
    calls: list[float] = []

    def load(self, verbose=False):
        if (tmp_path / engine.OP_NAME / "lock").exists():
            raise AssertionError("torch would wait for ever on this lock")
        calls.append(time.monotonic())

    monkeypatch.setattr(builder, "load", load)
    monkeypatch.setattr(engine, "OP_BUILD_LOG_S", 0.3)
    return SimpleNamespace(path=tmp_path, calls=calls)


def _baton(ext: Path, owner: int | None) -> Path:
    (ext / engine.OP_NAME).mkdir(exist_ok=True)
    baton = ext / engine.OP_NAME / "lock"
    baton.touch()
    if owner is not None:
        (ext / f"{engine.OP_NAME}.teamrl-owner").write_text(f"{owner}\n")
    return baton


def test_a_lock_whose_owner_is_dead_is_taken_over_at_once(ext_dir: SimpleNamespace, caplog) -> None:
    baton = _baton(ext_dir.path, _dead_pid())  # a fresh lock: no age threshold involved
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="teamrl.learner"):
        engine._load_cpu_comm_op(timeout_s=30)
    assert ext_dir.calls and time.monotonic() - t0 < 5
    assert not baton.exists()
    assert "which is dead" in caplog.text
    assert (ext_dir.path / f"{engine.OP_NAME}.teamrl-owner").read_text().strip() == str(os.getpid())


def test_a_live_builder_is_waited_for_with_a_deadline_and_a_message(ext_dir: SimpleNamespace, caplog) -> None:
    owner = ext_dir.path / f"{engine.OP_NAME}.teamrl-owner"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX);"
            "f.truncate(0); f.write(str(os.getpid())); f.flush(); print('held', flush=True); time.sleep(60)",
            str(owner),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="teamrl.learner"), pytest.raises(TimeoutError) as e:
            engine._load_cpu_comm_op(timeout_s=1.5)
        assert 1.4 < time.monotonic() - t0 < 10
        assert str(holder.pid) in str(e.value)
        waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
        assert len(waits) >= 2 and str(holder.pid) in waits[0]
        assert not ext_dir.calls
    finally:
        holder.kill()
        holder.wait()
    engine._load_cpu_comm_op(timeout_s=10)  # the holder died: the kernel dropped its lock
    assert ext_dir.calls


def test_a_dead_owners_compiler_still_running_is_waited_for(ext_dir: SimpleNamespace, caplog) -> None:
    baton = _baton(ext_dir.path, _dead_pid())
    compiler = subprocess.Popen(["sleep", "1.5"], cwd=baton.parent)  # an orphaned ninja, say
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="teamrl.learner"):
            engine._load_cpu_comm_op(timeout_s=30)
        assert time.monotonic() - t0 >= 1.0 and ext_dir.calls
        assert f"pids [{compiler.pid}] still compiling" in caplog.text
    finally:
        compiler.kill()
        compiler.wait()


def test_a_lock_of_another_program_is_taken_over_only_when_old(
    ext_dir: SimpleNamespace, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(engine, "FOREIGN_LOCK_S", 1.0)
    baton = _baton(ext_dir.path, None)  # no teamrl owner on record
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="teamrl.learner"):
        engine._load_cpu_comm_op(timeout_s=30)
    assert time.monotonic() - t0 >= 0.9 and ext_dir.calls and not baton.exists()
    assert "no teamrl owner record" in caplog.text


LEARNER = "from teamrl.learner.engine import init_distributed; print(init_distributed('cpu'), flush=True)"


@pytest.mark.slow
def test_a_learner_killed_during_the_build_does_not_block_the_next(tmp_path: Path) -> None:
    ext = tmp_path / "ext"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(ext)}
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    first = subprocess.Popen([sys.executable, "-c", LEARNER], env=env, start_new_session=True)
    build = ext / engine.OP_NAME
    try:
        deadline = time.monotonic() + 300
        while not ((build / "lock").exists() and engine._processes_in(build)):
            assert first.poll() is None, "the first learner ended before its build started"
            assert time.monotonic() < deadline, "no build started"
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)  # the learner only: its compiler goes on alone
        first.wait(10)
        assert (build / "lock").exists()
        t0 = time.monotonic()
        out, err = tmp_path / "second.out", tmp_path / "second.err"
        with open(out, "w") as o, open(err, "w") as e:
            second = subprocess.Popen([sys.executable, "-c", LEARNER], env=env, stdout=o, stderr=e)
        try:
            rc = second.wait(900)  # a build: about a minute on 2 idle cores, far more on busy ones
        except subprocess.TimeoutExpired:
            second.kill()
            raise AssertionError(
                "the second learner did not start in 900 s:\n" + err.read_text()[-3000:]
            ) from None
        took = time.monotonic() - t0
        assert rc == 0, err.read_text()[-3000:]
        assert "(0, 1)" in out.read_text()
        assert "took over the build lock" in err.read_text(), err.read_text()[-3000:]
        print(f"second learner started in {took:.0f} s after taking over the lock")
    finally:
        if first.poll() is None:
            first.kill()
        for pid in engine._processes_in(build):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
