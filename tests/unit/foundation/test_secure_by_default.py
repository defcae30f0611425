"""Secure by default (issue 30 item 3; docs/security.md): every service refuses to start without CURVE
keys unless ``--insecure`` is given, and says which in one line at start; ``--help`` names the
``[transport]`` table and how to make keys; ``teamrl keys DIR`` makes them."""

from __future__ import annotations

import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "teamrl.cli.main"]
REFUSAL = "refusing to start without CURVE keys"


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "argv",
    [
        ["buffer", "--bind", "tcp://127.0.0.1:0", "--sample-bind", "tcp://127.0.0.1:0"],
        ["learner", "--buffer", "tcp://127.0.0.1:9", "--set", 'adapters=["a"]']
        + ["--set", "probe_prompt=[1]", "--set", "probe_completion=[2]"],
    ],
    ids=["buffer", "learner"],
)
def test_a_service_without_keys_refuses_in_one_line(argv: list[str]) -> None:
    out = _run(argv)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert REFUSAL in lines[0] and "--insecure" in lines[0] and "teamrl keys" in lines[0]


@pytest.mark.parametrize("service", ["buffer", "learner", "rollout"])
def test_help_names_the_transport_table_and_how_to_make_keys(service: str) -> None:
    out = _run([service, "--help"])
    text = " ".join(out.stdout.split())
    assert out.returncode == 0
    for words in ("[transport]", "teamrl keys DIR", "curve_secret.py", "--insecure"):
        assert words in text, (service, words)


def test_keys_makes_a_folder_the_transport_table_reads(tmp_path: Path) -> None:
    from teamrl.protocol.config import TransportConfig, transport_mode

    out = _run(["keys", str(tmp_path / "keys")])
    assert out.returncode == 0, out.stderr
    files = sorted(p.name for p in (tmp_path / "keys").iterdir())
    assert files == sorted(
        f"{r}.{e}" for r in ("admin", "buffer", "learner", "rollout") for e in ("key", "pub")
    )
    transport = TransportConfig(**tomllib.loads(out.stdout)["transport"])
    assert transport.server_curve("buffer_rpc") is not None
    assert transport_mode("teamrl buffer", transport, insecure=False).startswith("teamrl buffer: CURVE")


def test_insecure_starts_and_says_so(tmp_path: Path) -> None:
    argv = ["buffer", "--dir", str(tmp_path / "b"), "--insecure"]
    argv += ["--bind", "tcp://127.0.0.1:0", "--sample-bind", "tcp://127.0.0.1:0"]
    proc = subprocess.Popen([*CLI, *argv], stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        assert "--insecure: plaintext links" in first, first
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
