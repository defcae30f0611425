"""No child outlives its service: parent-death signals and a reaper for the process tree.

A service's children (vLLM's ``VLLM::EngineCore`` and ``VLLM::Worker`` under a rollout, a compiler
under a learner) are re-parented to PID 1 when the service dies without closing them, e.g. on SIGKILL,
and keep their memory and ports (docs/architecture.md §2). Two mechanisms, both Linux-only (elsewhere
they do nothing):

* ``set_parent_death_signal(sig)`` (``prctl(PR_SET_PDEATHSIG)``): the calling process gets ``sig``
  when its parent dies. The supervisor of ``teamrl run`` asks each service it starts for it through
  the environment (``parent_death_env``: SIGTERM, the service drains and exits), and the service
  sets it on itself first thing (``die_with_parent_from_env``, called by ``teamrl.cli.main``). Not
  a ``preexec_fn``: Python code between fork and exec can deadlock the child when the parent has
  other threads, and ``Popen`` then blocks the parent waiting for the exec (docs/reliability.md
  R-orphan). The kernel sends the
  signal when the *thread* that forked the process exits, so it is asked for only by children
  started from the main thread.
* ``start_reaper()``: a small watcher process (stdlib only, its own session, so neither Ctrl-C nor a
  ``killpg`` of the service's group reaches it) that records the service's descendants every
  ``POLL_S`` and, once the service is gone, SIGKILLs every recorded one still alive (matched by pid
  *and* start time, so a recycled pid is never hit) and their descendants. It also notes the
  shared-memory files (``/dev/shm``: vLLM's ``psm_*`` segments, 160-250 MB each) the tree maps, and
  once the tree is dead unlinks those no live process maps any more: a SIGKILLed engine never
  unlinks its own, and 19 left behind held ~4 GB of RAM (issue 30). It then exits: it never
  outlives the service by more than about ``POLL_S``.

Run as a script (``python -I children.py PID``) this file is the reaper itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
PR_SET_PDEATHSIG = 1
SHM_DIR = "/dev/shm"
SHM_EVERY = 4  # polls between two reads of the tree's memory maps (they are long under vLLM)


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


PARENT_ENV = "TEAMRL_DIE_WITH_PARENT"  # "<parent pid>:<signal>", read and removed by the child


def parent_death_env(sig: int = signal.SIGTERM) -> dict[str, str]:
    """Environment asking a child started by this process to get ``sig`` when this process dies."""
    return {PARENT_ENV: f"{os.getpid()}:{int(sig)}"}


def die_with_parent_from_env() -> bool:
    """Honour ``parent_death_env`` in this process (and remove it, so this process's own children do
    not inherit a request that names another parent); True when set. A parent that died before the
    call is acted on at once, as if the signal had come after."""
    spec = os.environ.pop(PARENT_ENV, "")
    parent, _, sig = spec.partition(":")
    if not (parent.isdigit() and sig.isdigit()):
        return False
    if not set_parent_death_signal(int(sig)):
        return False
    if os.getppid() != int(parent):
        os.kill(os.getpid(), int(sig))
    return True


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


def shm_mapped(pid: int) -> set[str]:
    """The files under ``SHM_DIR`` that ``pid`` maps and that still exist there, by name."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            data = f.read()
    except OSError:
        return set()
    prefix = f" {SHM_DIR}/".encode()
    names = set()
    for line in data.splitlines():
        i = line.find(prefix)
        if i >= 0 and not line.endswith(b" (deleted)"):
            names.add(line[i + len(prefix) :].decode(errors="replace"))
    return names


def remove_unmapped(names: set[str], wait_s: float = 5.0) -> list[str]:
    """Unlink the ``names`` under ``SHM_DIR`` that no live process maps; returns those removed. A
    process killed a moment ago may still hold its maps: waited for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        held = set().union(*(shm_mapped(pid) for pid in _table())) & names
        if not held or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    removed = []
    for name in sorted(names - held):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:  # gone already, or not ours to remove
            pass
    return removed


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
    segments: set[str] = set()  # /dev/shm files the service or its tree mapped
    polls = 0
    while os.getppid() == parent:
        table = _table()
        known = {p: t for p, t in known.items() if p in table and table[p][1] == t}
        known.update(descendants(parent, table))
        known.pop(me, None)
        if polls % SHM_EVERY == 0:
            segments = {n for n in segments if os.path.exists(os.path.join(SHM_DIR, n))}
            segments.update(*(shm_mapped(p) for p in [parent, *known]))
        polls += 1
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
    removed = remove_unmapped(segments) if segments else []
    if doomed or removed:
        print(
            f"[teamrl reaper] service {parent} is gone: killed {len(doomed)} leftover processes, "
            f"removed {len(removed)} shared-memory files of theirs from {SHM_DIR}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(_reap(int(sys.argv[1])))
