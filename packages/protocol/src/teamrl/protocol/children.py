"""No child outlives its service: parent-death signals and a reaper for the process tree.

A service's children (vLLM's ``VLLM::EngineCore`` and ``VLLM::Worker`` under a rollout, a compiler
under a learner) are re-parented to PID 1 when the service dies without closing them, e.g. on SIGKILL,
and keep their memory and ports (README, "Architecture"). Two mechanisms, both Linux-only (elsewhere
they do nothing):

* ``set_parent_death_signal(sig)`` (``prctl(PR_SET_PDEATHSIG)``): the calling process gets ``sig``
  when its parent dies. The supervisor of ``teamrl run`` sets it in each service it starts (SIGTERM:
  the service drains and exits; ``parent_death_preexec`` is the ``Popen`` form). The kernel sends
  it when the *thread* that forked the process exits, so it is set only for children started from
  the main thread.
* ``start_reaper()``: a small watcher process (stdlib only, its own session, so neither Ctrl-C nor a
  ``killpg`` of the service's group reaches it) that records the service's descendants every
  ``POLL_S`` and, once the service is gone, SIGKILLs every recorded one still alive (matched by pid
  *and* start time, so a recycled pid is never hit) and their descendants. It then exits: it never
  outlives the service by more than about ``POLL_S``.

Run as a script (``python -I children.py PID``) this file is the reaper itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

POLL_S = 0.5
PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def parent_death_preexec(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process dies.

    libc is resolved here, in the parent, so the child between fork and exec only makes the call (no
    import, no allocation). None where unsupported."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: act as if it came after
            os.kill(os.getpid(), sig)

    return preexec


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) from /proc/PID/stat; None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()  # the name may hold spaces and parentheses
    try:
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _table() -> dict[int, tuple[int, int]]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                table[int(name)] = st
    return table


def descendants(root: int, table: dict[int, tuple[int, int]] | None = None) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time."""
    table = _table() if table is None else table
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    found: dict[int, int] = {}
    todo = list(kids.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = table[pid][1]
            todo.extend(kids.get(pid, ()))
    return found


def start_reaper() -> subprocess.Popen | None:
    """Start the watcher of this process's tree (see the module doc); None off Linux."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc"):
        return None
    return subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=sys.stderr,
        start_new_session=True,
        close_fds=True,
    )


def _reap(parent: int) -> int:
    me = os.getpid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    known: dict[int, int] = {}  # everything seen below the service and still alive: pid -> start time
    while os.getppid() == parent:
        table = _table()
        known = {p: t for p, t in known.items() if p in table and table[p][1] == t}
        known.update(descendants(parent, table))
        known.pop(me, None)
        time.sleep(POLL_S)
    # The service is gone: whatever it left keeps its own children, so walk down from each.
    table = _table()
    doomed: dict[int, int] = {}
    for pid, start in known.items():
        if pid in table and table[pid][1] == start:
            doomed[pid] = start
            doomed.update(descendants(pid, table))
    doomed.pop(me, None)
    for pid, start in doomed.items():
        st = _stat(pid)
        if st is not None and st[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if doomed:
        print(
            f"[teamrl reaper] service {parent} is gone: killed {len(doomed)} leftover processes",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(_reap(int(sys.argv[1])))
