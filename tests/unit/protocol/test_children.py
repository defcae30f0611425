"""No child outlives its service: the reaper kills a SIGKILLed service's leftover tree, and the
parent-death signal reaches a child whose parent dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from teamrl.protocol.children import descendants

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")

# A stand-in service: the reaper, then a forked child (as vLLM starts its engine core) that starts a
# grandchild of its own (as the engine core starts its workers); it writes the pids and waits.
SERVICE = textwrap.dedent(
    """
    import json, multiprocessing, subprocess, sys, time
    from teamrl.protocol.children import start_reaper

    def core(path):
        w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(path, "w") as f:
            json.dump({"core": multiprocessing.current_process().pid, "worker": w.pid}, f)
        time.sleep(600)

    if __name__ == "__main__":
        start_reaper()
        multiprocessing.get_context("fork").Process(target=core, args=(sys.argv[1],)).start()
        time.sleep(600)
    """
)


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
        time.sleep(0.1)
    return pred()


def test_sigkilled_service_leaves_no_children(tmp_path: Path) -> None:
    script, pids_file = tmp_path / "service.py", tmp_path / "pids.json"
    script.write_text(SERVICE)
    svc = subprocess.Popen([sys.executable, str(script), str(pids_file)], start_new_session=True)
    try:
        assert _wait_for(pids_file.exists, 60), "the stand-in service did not start its children"
        time.sleep(0.2)
        pids = json.loads(pids_file.read_text())
        tree = descendants(svc.pid)
        assert pids["core"] in tree and pids["worker"] in tree
        time.sleep(1.5)  # the reaper has seen the whole tree
        os.kill(svc.pid, signal.SIGKILL)
        svc.wait(10)
        assert _wait_for(lambda: not any(_alive(p) for p in pids.values()), 10), (
            f"left behind: {[p for p in pids.values() if _alive(p)]}"
        )
        # the reaper itself exits once its work is done
        assert _wait_for(lambda: not any(_alive(p) for p in tree if p not in pids.values()), 10)
    finally:
        for p in [svc.pid, *descendants(svc.pid)]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _kill_parent_and_expect_the_child_gone(parent_code: str, pid_file: Path) -> None:
    """Run ``parent_code`` (it starts a child that writes its pid to ``pid_file``), SIGKILL the parent
    once the child is up, and expect the child to be gone within 10 s."""
    parent = subprocess.Popen([sys.executable, "-c", parent_code, str(pid_file)], start_new_session=True)
    try:
        assert _wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60)
        child = int(pid_file.read_text())
        parent.kill()
        parent.wait(10)
        assert _wait_for(lambda: not _alive(child), 10), "the child outlived its parent"
    finally:
        parent.kill()


def test_parent_death_signal_reaches_the_child(tmp_path: Path) -> None:
    # parent -> child (sets PDEATHSIG SIGTERM, then sleeps); SIGKILL the parent: the child is gone
    pid_file = tmp_path / "child.pid"
    child_code = (
        "import os, sys, time; from teamrl.protocol.children import set_parent_death_signal;"
        "assert set_parent_death_signal(); open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
    )
    parent_code = (
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child_code!r}, sys.argv[1]]);"
        "time.sleep(600)"
    )
    _kill_parent_and_expect_the_child_gone(parent_code, pid_file)


def test_a_child_asked_through_its_environment_dies_with_its_parent(tmp_path: Path) -> None:
    # the supervisor's form: no preexec_fn, the child sets PDEATHSIG itself from parent_death_env()
    pid_file = tmp_path / "child.pid"
    child_code = (
        "import os, sys, time; from teamrl.protocol.children import PARENT_ENV, die_with_parent_from_env;"
        "assert die_with_parent_from_env() and PARENT_ENV not in os.environ;"
        "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
    )
    parent_code = (
        "import os, subprocess, sys, time; from teamrl.protocol.children import parent_death_env;"
        f"subprocess.Popen([sys.executable, '-c', {child_code!r}, sys.argv[1]], env=os.environ | parent_death_env());"
        "time.sleep(600)"
    )
    _kill_parent_and_expect_the_child_gone(parent_code, pid_file)
    # a request naming a parent that is already gone is acted on at once
    orphan = subprocess.run(
        [
            sys.executable,
            "-c",
            "from teamrl.protocol.children import die_with_parent_from_env as d; d(); print('alive')",
        ],
        env=os.environ | {"TEAMRL_DIE_WITH_PARENT": "1:15"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert orphan.returncode == -15 and "alive" not in orphan.stdout


# A stand-in service whose engine core maps a shared-memory segment the way vLLM's do
# (``/dev/shm/psm_*``, created, mapped, never unlinked by a process that is SIGKILLed).
SHM_SERVICE = textwrap.dedent(
    """
    import json, mmap, multiprocessing, os, sys, time
    from teamrl.protocol.children import start_reaper

    def core(path):
        name = f"psm_teamrl_test_{os.getpid()}"
        fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 1 << 20)
        seg = mmap.mmap(fd, 1 << 20)
        seg[:5] = b"hello"
        with open(path, "w") as f:
            json.dump({"core": os.getpid(), "segment": name}, f)
        time.sleep(600)

    if __name__ == "__main__":
        start_reaper()
        multiprocessing.get_context("fork").Process(target=core, args=(sys.argv[1],)).start()
        time.sleep(600)
    """
)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_sigkilled_engines_shared_memory_is_removed(tmp_path: Path) -> None:
    before = sorted(os.listdir("/dev/shm"))
    script, pids_file = tmp_path / "service.py", tmp_path / "pids.json"
    script.write_text(SHM_SERVICE)
    svc = subprocess.Popen([sys.executable, str(script), str(pids_file)], start_new_session=True)
    try:
        assert _wait_for(lambda: pids_file.exists() and pids_file.read_text(), 60)
        info = json.loads(pids_file.read_text())
        time.sleep(2.5)  # the reaper reads the tree's maps every SHM_EVERY polls
        os.kill(info["core"], signal.SIGKILL)  # the engine dies without unlinking its segment
        assert _wait_for(lambda: not _alive(info["core"]), 10)
        assert info["segment"] in os.listdir("/dev/shm")  # left behind, as vLLM's were
        os.kill(svc.pid, signal.SIGKILL)  # then its service (a real rollout exits 3 on a dead engine)
        svc.wait(10)
        assert _wait_for(lambda: sorted(os.listdir("/dev/shm")) == before, 15), (
            f"/dev/shm before {before}, after {sorted(os.listdir('/dev/shm'))}"
        )
        print(
            f"/dev/shm: {len(before)} files before, {info['segment']} while the engine lived, "
            f"{len(os.listdir('/dev/shm'))} after"
        )
    finally:
        for p in [svc.pid, *descendants(svc.pid)]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
