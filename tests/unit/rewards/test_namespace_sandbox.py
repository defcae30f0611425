"""The bubblewrap namespace sandbox: the attacks the process sandbox alone lets through.

Each candidate undoes the in-interpreter blocks with ``ctypes`` (or needs none) and tries to reach
the host: a file in the host's ``/tmp``, a write next to the repository, a ``fork()`` that outlives
the run, ``kill()`` of a host pid, a connection to a port the host listens on, a root-only file.
Skipped where ``bwrap`` cannot run (the fallback is tested at the end, everywhere).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from teamrl.rewards import sandbox
from teamrl.rewards.code_reward import CodeReward
from teamrl.rewards.errors import SandboxUnavailable
from teamrl.rewards.sandbox import Limits, Step, namespace_sandbox_available, run_python

TIMEOUT_S = 4.0
ADD = "def add(a, b):\n    return a + b\n"
TESTS = {"tests": ["assert add(1, 2) == 3"]}
LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"

needs_bwrap = pytest.mark.skipif(
    not namespace_sandbox_available()[0], reason=f"no namespace sandbox: {namespace_sandbox_available()[1]}"
)


def _ns(code: str, steps: list[Step] | None = None, **limits: object) -> sandbox.SandboxOutcome:
    out = run_python(code, steps or [], Limits(timeout_s=TIMEOUT_S, isolation="namespace", **limits))  # type: ignore[arg-type]
    assert out.sandbox == "namespace"
    return out


def _procs_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _host_folder() -> Path:
    """A writable host folder that the sandbox sees read-only: not under /tmp (the sandbox has its
    own) nor a folder it hides; the tests' own folder unless the checkout itself lives in /tmp."""
    for cand in (Path(__file__).parent, Path("/var/lib"), Path("/opt"), Path("/srv")):
        top = "/" + str(cand.resolve()).split("/")[1]
        if top not in ("/tmp", "/root", "/home", "/run") and os.access(cand, os.W_OK):
            return cand
    pytest.skip("no writable host folder outside /tmp and the sandbox's hidden folders")


@needs_bwrap
def test_write_to_tmp_stays_inside_and_the_root_is_read_only() -> None:
    name = f"/tmp/teamrl-escape-{uuid.uuid4().hex}"
    outside = _host_folder() / f"written-from-the-sandbox-{uuid.uuid4().hex}"
    code = (
        ADD
        + f"open({name!r}, 'w').write('x')\n"
        + f"try:\n    open({str(outside)!r}, 'w').write('x')\nexcept OSError as e:\n    ro = e.errno\n"
    )
    res = CodeReward(timeout_s=TIMEOUT_S, isolation="namespace")(code, TESTS)
    assert (res.score, res.details["sandbox"]) == (1.0, "namespace"), res.details
    assert not os.path.exists(name) and not outside.exists()
    out = _ns(code, [Step("test", "import errno\nassert ro in (errno.EROFS, errno.EACCES), ro")])
    assert out.find("step")["passed"] is True, out.events


@needs_bwrap
def test_ctypes_fork_and_kill_do_not_reach_the_host() -> None:
    marker = f"teamrl-sleeper-{uuid.uuid4().hex}"
    host_pid = os.getpid()
    code = (
        LIBC
        + "import os, time\n"
        + f"pid = libc.fork()\nif pid == 0:\n    time.sleep(60)  # {marker}\n    libc._exit(0)\n"
        + "ppid = libc.getppid()\n"
        + "parent_alive = libc.kill(ppid, 0)\n"
        + f"host = libc.kill({host_pid}, 0)\nhost_errno = ctypes.get_errno()\n"
    )
    checks = [
        Step("test", "assert pid != -1"),  # nproc=4 lets the fork happen: the namespace must hold it
        Step("test", "import errno\nassert (host, host_errno) == (-1, errno.ESRCH), (host, host_errno)"),
        Step("test", f"assert ppid != {host_pid} and ppid < 10, ppid"),
        Step("test", "assert os.getuid() == 65534 and os.getgid() == 65534"),
    ]
    t0 = time.monotonic()
    out = _ns(code, checks, nproc=4)
    assert [e["passed"] for e in out.events if e["event"] == "step"] == [True] * 4, out.events
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    # The forked sleeper holds the pipes open until the deadline; then it dies with its namespace.
    deadline = time.monotonic() + 3
    while _procs_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _procs_with(marker) == []


@needs_bwrap
def test_no_network_even_with_the_socket_module_restored() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (
            LIBC
            + "import struct\n"
            + "fd = libc.socket(2, 1, 0)\n"
            + f"addr = struct.pack('<HH4s8x', 2, {socket.htons(port)}, bytes([127, 0, 0, 1]))\n"
            + "rc = libc.connect(fd, addr, len(addr))\nerr = ctypes.get_errno()\n"
        )
        out = _ns(code, [Step("test", "assert rc == -1, (rc, err)")])
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()
    assert out.find("step")["passed"] is True, out.events


@needs_bwrap
@pytest.mark.skipif(
    os.geteuid() != 0, reason="checks that root's files are out of reach when the caller is root"
)
def test_root_files_and_home_are_out_of_reach() -> None:
    # Outside /tmp (the sandbox has its own), where the sandbox sees the host's files read-only.
    folder = Path(tempfile.mkdtemp(dir=_host_folder()))
    try:
        folder.chmod(0o755)
        secret = folder / "secret.key"
        secret.write_text("curve secret")
        secret.chmod(0o600)
        code = (
            f"try:\n    leaked = open({str(secret)!r}).read()\nexcept OSError as e:\n    leaked = e.errno\n"
            "import os\nhome = os.listdir('/root')\n"
        )
        checks = [
            Step("test", "import errno\nassert leaked == errno.EACCES, leaked"),
            Step("test", "assert '.bashrc' not in home, home"),
        ]
        out = _ns(code, checks)
    finally:
        shutil.rmtree(folder)
    assert [e["passed"] for e in out.events if e["event"] == "step"] == [True, True], out.events


def test_fallback_when_bwrap_cannot_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sandbox, "_probe_result", None)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="teamrl.rewards.sandbox"):
        res = CodeReward(timeout_s=TIMEOUT_S)(ADD, TESTS)
    assert (res.score, res.details["sandbox"]) == (1.0, "process")
    assert any("namespace sandbox is unavailable" in r.getMessage() for r in caplog.records)
    with pytest.raises(SandboxUnavailable, match="bwrap is not installed"):
        run_python(ADD, [], Limits(timeout_s=TIMEOUT_S, isolation="namespace"))
