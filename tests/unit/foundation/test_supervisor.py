"""The supervisor ends whole process groups: a service's children die with it (SIGKILL, stop,
restart), and a service gets SIGTERM when the supervisor itself dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from teamrl.cli.supervisor import Service, Supervisor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, prctl")

REAL_PYTHON = sys.executable
FAKE = f"""\
#!{REAL_PYTHON}
# stands in for `python -m teamrl.cli.main ARGV`: a service that starts one child (its engine)
import os, signal, subprocess, sys, time
from teamrl.protocol.children import die_with_parent_from_env
die_with_parent_from_env()  # what teamrl.cli.main does first for a service
if os.environ.get("FAKE_IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the child too, as a shell trap is
    signal.signal(signal.SIGUSR1, lambda *_: print("stacks asked for", file=sys.stderr, flush=True))
child = subprocess.Popen(["sleep", "600"])
path = os.environ["FAKE_CHILD_PID"]
with open(path + ".tmp", "w") as f:
    f.write(str(child.pid))
os.replace(path + ".tmp", path)
while True:
    time.sleep(1)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :].split()[0] != b"Z"  # a zombie is dead, only not yet reaped


def _wait_for(pred, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return bool(pred())


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch) -> Path:
    exe = tmp_path / "fakepy"
    exe.write_text(FAKE)
    exe.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(exe))
    return exe


def _child(pid_file: Path) -> int:
    assert _wait_for(pid_file.exists, 10), "the fake service did not start its child"
    child = int(pid_file.read_text())
    pid_file.unlink()
    return child


def _cleanup(sup: Supervisor) -> None:
    for s in sup.services:
        if s.proc is not None:
            try:
                os.killpg(s.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_killed_service_leaves_nothing_and_its_restart_gets_a_new_group(
    tmp_path: Path, fake_python: Path
) -> None:
    sup = Supervisor()
    pid_file = tmp_path / "child.pid"
    svc = sup.start(
        Service("rollout-0", ["rollout"], tmp_path / "r.log", env={"FAKE_CHILD_PID": str(pid_file)})
    )
    try:
        child = _child(pid_file)
        assert os.getpgid(svc.proc.pid) == svc.proc.pid and os.getpgid(child) == svc.proc.pid
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(10)
        assert _alive(child)  # the kernel leaves the orphan running ...
        assert [s.name for s in sup.dead()] == ["rollout-0"]
        assert _wait_for(lambda: not _alive(child), 5)  # ... the supervisor ends it as soon as it sees it
        svc.start()  # a restart
        child = _child(pid_file)
        assert os.getpgid(child) == svc.proc.pid
        codes = sup.stop(timeout=5)
        assert codes["rollout-0"] == -signal.SIGTERM
        assert _wait_for(lambda: not _alive(child), 5), "the restarted service's child outlived the stop"
    finally:
        _cleanup(sup)


def test_stop_ends_the_group_of_a_service_that_ignores_sigterm(tmp_path: Path, fake_python: Path) -> None:
    sup = Supervisor()
    pid_file = tmp_path / "child.pid"
    env = {"FAKE_CHILD_PID": str(pid_file), "FAKE_IGNORE_TERM": "1"}
    sup.start(Service("buffer", ["buffer"], tmp_path / "b.log", env=env))
    try:
        child = _child(pid_file)
        t0 = time.monotonic()
        codes = sup.stop(timeout=1)
        assert codes["buffer"] == -signal.SIGKILL and time.monotonic() - t0 < 7
        assert sup.services[0].killed
        assert "stacks asked for" in (tmp_path / "b.log").read_text()  # SIGUSR1 came before SIGKILL
        assert _wait_for(lambda: not _alive(child), 5), "the service's child outlived the stop"
    finally:
        _cleanup(sup)


def test_a_service_gets_sigterm_when_the_supervisor_dies(tmp_path: Path, fake_python: Path) -> None:
    svc_file, child_file = tmp_path / "svc.pid", tmp_path / "child.pid"
    code = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        sys.executable = {str(fake_python)!r}
        from teamrl.cli.supervisor import Service, Supervisor
        s = Supervisor().start(
            Service("learner", ["learner"], Path({str(tmp_path / "l.log")!r}),
                    env={{"FAKE_CHILD_PID": {str(child_file)!r}}})
        )
        Path({str(svc_file)!r}).write_text(str(s.proc.pid))
        time.sleep(600)
        """
    )
    boss = subprocess.Popen([REAL_PYTHON, "-c", code])
    svc = None
    try:
        assert _wait_for(lambda: svc_file.exists() and svc_file.read_text(), 60)
        svc = int(svc_file.read_text())
        _child(child_file)
        boss.kill()
        boss.wait(10)
        assert _wait_for(lambda: not _alive(svc), 5), "the service outlived its supervisor"
    finally:
        boss.kill()
        if svc is not None:
            try:
                os.killpg(svc, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_service_prints_its_thread_stacks_on_sigusr1() -> None:
    code = (
        "import sys, time\n"
        "from teamrl.cli.main import _stacks_on_sigusr1\n"
        "_stacks_on_sigusr1()\n"
        "def stuck_here():\n"
        "    print('ready', flush=True); time.sleep(60)\n"
        "stuck_here()\n"
    )
    p = subprocess.Popen([REAL_PYTHON, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        p.kill()
        err = p.communicate(timeout=10)[1]
        assert "stuck_here" in err and "thread" in err, err
    finally:
        p.kill()


def test_a_service_that_exits_with_a_config_error_is_not_restarted(tmp_path: Path, capsys) -> None:
    """Exit code 2 (bad config or usage: here a buffer started without keys or --insecure) is not
    something a restart fixes: the run stops at once instead of restarting it three times."""
    from teamrl.cli.run_async import CONFIG_RC, Watch, restart_or_give_up

    sup = Supervisor()
    svc = sup.start(Service("buffer", ["buffer", "--dir", str(tmp_path / "buf")], tmp_path / "b.log"))
    assert svc.proc is not None and svc.proc.wait(timeout=60) == CONFIG_RC
    watch = Watch()
    assert restart_or_give_up(sup, watch) is False
    assert watch.restarts == {} and watch.rc == 1
    assert "a configuration error, which a restart cannot fix" in capsys.readouterr().err
