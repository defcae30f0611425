"""A SIGKILLed rollout leaves no vLLM process behind (``VLLM::EngineCore``, ``VLLM::Worker``).

The rollout is started outside any supervisor, in its own session, as a plain ``teamrl rollout``
whose buffer and learner are absent (it says so in its log); once its engine is up, its whole process
tree is listed, the rollout alone is SIGKILLed, and every process of that list must be gone within
seconds (its reaper, ``teamrl.protocol.children``, ends them and then itself)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from teamrl.protocol.children import descendants, shm_mapped

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.usefixtures("embedded_model"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc"),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :].split()[0] != b"Z"


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80]
    except OSError:
        return "?"


def test_sigkilled_rollout_leaves_no_vllm_process(tmp_path: Path) -> None:
    log = tmp_path / "rollout.log"
    argv = [sys.executable, "-m", "teamrl.cli.main", "rollout", "--insecure"]  # plaintext on loopback
    argv += ["--buffer", f"tcp://127.0.0.1:{_port()}", "--weights", f"tcp://127.0.0.1:{_port()}"]
    argv += ["--set", "workflow=addition-duo", "--set", "group_size=2", "--set", "groups_in_flight=1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    tree: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 240
        while " up in " not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, (
                "engine not up in 240 s\n" + log.read_text(errors="replace")[-3000:]
            )
            time.sleep(0.5)
        # no buffer: the rollout says so every few seconds, naming the endpoint
        while "has not answered for" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline + 20, "no message about the missing buffer"
            time.sleep(0.5)
        time.sleep(1.0)  # the reaper polls every 0.5 s
        tree = descendants(proc.pid)
        names = {p: _name(p) for p in tree}
        assert any("VLLM" in n or "multiprocessing" in n for n in names.values()) or len(tree) >= 2, names
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        while any(_alive(p) for p in tree) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        left = {p: names[p] for p in tree if _alive(p)}
        assert not left, f"outlived the rollout: {left}"
        print(
            f"{len(tree)} processes under the rollout, all gone {time.monotonic() - t0:.1f} s after SIGKILL"
        )
    finally:
        for p in [proc.pid, *tree]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_sigterm_with_the_buffer_gone_exits_within_drain_plus_flush(tmp_path: Path) -> None:
    # window 1 and nobody acking: after its first group the sender waits in send() for credit that
    # never comes, the case that used to ignore SIGTERM until the supervisor's SIGKILL
    drain_s, flush_s = 2.0, 3.0
    log = tmp_path / "rollout.log"
    argv = [sys.executable, "-m", "teamrl.cli.main", "rollout", "--insecure"]  # plaintext on loopback
    argv += ["--buffer", f"tcp://127.0.0.1:{_port()}", "--weights", f"tcp://127.0.0.1:{_port()}"]
    argv += ["--set", "workflow=addition-duo", "--set", "group_size=2", "--set", "groups_in_flight=1"]
    argv += [
        "--set",
        "window=1",
        "--set",
        f"drain_timeout_s={drain_s}",
        "--set",
        f"flush_timeout_s={flush_s}",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    tree: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 240
        while "window full" not in log.read_text(errors="replace"):  # the sender's wait message
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, (
                "sender never blocked\n" + log.read_text(errors="replace")[-3000:]
            )
            time.sleep(0.5)
        tree = descendants(proc.pid)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
        took = time.monotonic() - t0
        text = log.read_text(errors="replace")
        assert rc == 1, text[-3000:]  # frames were lost, and said so
        assert "frames not acknowledged" in text
        print(f"SIGTERM to exit: {took:.1f} s (drain {drain_s} s + flush {flush_s} s + engine close)")
        assert took < drain_s + flush_s + 30, text[-3000:]
        t1 = time.monotonic()
        while any(_alive(p) for p in tree) and time.monotonic() - t1 < 15:
            time.sleep(0.1)
        assert not [p for p in tree if _alive(p)], "children outlived a clean stop"
    finally:
        for p in [proc.pid, *tree]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_sigkilled_engine_leaves_dev_shm_as_it_was(tmp_path: Path) -> None:
    """vLLM's shared-memory segments (``/dev/shm/psm_*``, 160-250 MB each) outlived SIGKILLed engines
    (issue 30: 19 of them, ~4 GB of RAM). The engine core and the rollout are SIGKILLed, so neither
    vLLM's clean-up nor Python's resource tracker runs; the rollout's reaper unlinks what its tree
    mapped. Other runs on the machine may add their own
    segments meanwhile, so the check is on this rollout's: every one it mapped is gone."""
    shm = Path("/dev/shm")
    before = {p.name for p in shm.iterdir()}
    log = tmp_path / "rollout.log"
    argv = [sys.executable, "-m", "teamrl.cli.main", "rollout", "--insecure"]  # plaintext on loopback
    argv += ["--buffer", f"tcp://127.0.0.1:{_port()}", "--weights", f"tcp://127.0.0.1:{_port()}"]
    argv += ["--set", "workflow=addition-duo", "--set", "group_size=2", "--set", "groups_in_flight=1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    tree: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 240
        while " up in " not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "engine not up in 240 s\n" + log.read_text(errors="replace")
            time.sleep(0.5)
        time.sleep(3.0)  # the reaper reads the tree's memory maps every 2 s
        tree = descendants(proc.pid)
        ours = set().union(*(shm_mapped(p) for p in [proc.pid, *tree]))
        assert ours, "the engine maps no /dev/shm segment: nothing to show"
        engines = [p for p in tree if "EngineCore" in _name(p)] or [p for p in tree if "VLLM" in _name(p)]
        assert engines, {p: _name(p) for p in tree}
        os.kill(engines[0], signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)  # and the rollout: no vLLM or Python clean-up runs
        rc = proc.wait(10)
        t0 = time.monotonic()
        while ours & {p.name for p in shm.iterdir()} and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        after = {p.name for p in shm.iterdir()}
        size = sum((shm / n).stat().st_size for n in ours if (shm / n).exists())
        print(
            f"/dev/shm: {len(before)} files before; the rollout's engine mapped {sorted(ours)}; after its "
            f"SIGKILL (and the rollout's, exit {rc}) {len(ours & after)} of them left ({size} bytes), "
            f"{len(after)} files in all (other runs' included)"
        )
        assert not ours & after, f"left in /dev/shm: {sorted(ours & after)}"
    finally:
        for p in [proc.pid, *tree]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
