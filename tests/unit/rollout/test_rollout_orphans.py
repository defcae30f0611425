"""A SIGKILLed rollout leaves no vLLM process behind (``VLLM::EngineCore``, ``VLLM::Worker``).

The rollout is started outside any supervisor, in its own session, as a plain ``teamrl rollout``
whose buffer and learner are absent; once its engine is up, its whole process tree is listed, the
rollout alone is SIGKILLed, and every process of that list must be gone within seconds (its reaper,
``teamrl.protocol.children``, ends them and then itself)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from teamrl.protocol.children import descendants

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
    argv = [sys.executable, "-m", "teamrl.cli.main", "rollout"]
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
        time.sleep(2.0)  # the reaper polls every 0.5 s
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
