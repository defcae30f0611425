"""Run untrusted Python (a model's candidate program) plus unit tests in a limited subprocess.

Two layers. The outer one, where the host allows it, is a bubblewrap (``bwrap``) namespace
sandbox (``isolation="namespace"``): the whole root file system mounted read-only, a private
writable ``/tmp`` (the run's working folder; nothing else is writable), a fresh ``/proc`` and a
minimal ``/dev``, ``/root``, ``/home`` and ``/run`` hidden, no network (``--unshare-net``: only a
down loopback), its own PID namespace (``--unshare-pid``; the candidate cannot see or signal any
host process, and everything in it dies with the namespace's init), IPC/UTS namespaces, no further
user namespaces, ``--die-with-parent``, and uid/gid 65534 (``nobody``): as root, ``bwrap`` itself is
started as 65534 so the candidate is unprivileged on the host too (a root-owned ``0600`` file, such
as a CURVE secret key, stays unreadable); as another user, the user namespace maps 65534 to that
user. Where ``bwrap`` is missing or cannot create namespaces (a container without user
namespaces, seccomp), ``isolation="auto"`` falls back to the process sandbox alone and logs one
warning; ``isolation="namespace"`` raises ``SandboxUnavailable`` instead. ``SandboxOutcome.sandbox``
says which one ran (``"namespace"`` or ``"process"``), and the code reward reports it.

The inner layer (always on; the only one in the fallback) does, per run:

* a fresh temporary working folder (also ``HOME`` and ``TMPDIR``), deleted afterwards;
* ``sys.executable -I -S`` (isolated: no user site, no ``PYTHON*`` variables, no current folder on
  ``sys.path``; ``-S``: stdlib only, unless ``site_packages=True``) with a clean environment, so
  the parent's secrets in environment variables are not handed to candidate code, and proxies
  pointed at a closed local port;
* its own session (``start_new_session``), so the whole process group is ``SIGKILL``-ed when the
  wall-clock ``timeout_s`` passes, when output passes ``output_bytes``, and in any case at the end
  (stragglers included); parent death kills it too (``PR_SET_PDEATHSIG``);
* rlimits set by the child on itself before any candidate code runs (no ``preexec_fn``, which is
  unsafe in a threaded parent such as a vLLM rollout): ``RLIMIT_CPU``, ``RLIMIT_AS`` (memory),
  ``RLIMIT_FSIZE`` (``SIGXFSZ`` ignored, so an oversized write raises ``EFBIG``), ``RLIMIT_NPROC``,
  ``RLIMIT_CORE`` = 0;
* inside the child, before the candidate runs: ``socket.socket`` (and ``_socket.socket``,
  ``create_connection``, ``socketpair``, ``getaddrinfo``...) replaced by versions that raise
  ``SandboxBlocked``, and likewise ``os.fork``/``exec*``/``spawn*``/``system``/``kill``/``setsid``
  (in both ``os`` and ``posix``) and ``_posixsubprocess.fork_exec``;
* stdout/stderr read through ``poll`` and capped at ``output_bytes`` each.

**The process layer alone is not a security boundary against a determined attacker.** The
candidate runs in the same interpreter as the harness and can undo the monkeypatches (``ctypes``,
the original classes in ``__mro__``), read world-readable files, write wherever the service user
may, and, when the parent is root, ``RLIMIT_NPROC`` is not enforced at all (the kernel exempts
root). Per-file size is capped but not the number of files. It stops accidents and casual reward
hacking; the namespace layer is what holds against a ``ctypes`` ``fork()``, a ``kill`` of a host
pid, or a write to ``/tmp`` (docs/transport-security.md).

How the result is reported: the harness writes JSON lines, each carrying a random per-run nonce,
to a private pipe (not stdout). The candidate is executed first; then each test step, and a
``done`` line at the very end. So ``sys.exit(0)``, ``os._exit(0)``, a crash or a kill before the
tests finish can never read as a pass: only reported test lines count, and the exit status is
ignored. The nonce lives in a local of the harness function and the job file holding it is deleted
before the candidate starts, so a printed or forged line does not count (forgeries are counted in
``foreign_lines``).

Call sequence::

    out = run_python(code, [Step("test", "assert f(1) == 2")], Limits(timeout_s=2))
    out.events          # [{"event": "started"}, {"event": "candidate_ok"}, {"event": "step", ...}, ...]
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from teamrl.rewards.errors import SandboxUnavailable

# The program the child runs (``python -I -S -c HARNESS job.json``). Everything is inside one
# function so the nonce and the report function are locals, not globals of ``__main__``.
HARNESS = r"""
def _harness():
    import json, os, sys
    job_path = sys.argv[1]
    with open(job_path) as f:
        job = json.load(f)
    os.unlink(job_path)
    nonce, fd, lim = job["nonce"], job["report_fd"], job["limits"]
    if job["drop_to"] is not None:
        os.setgroups([])
        os.setresgid(job["drop_to"], job["drop_to"], job["drop_to"])
        os.setresuid(job["drop_to"], job["drop_to"], job["drop_to"])

    def report(event, **kv):
        kv["event"] = event
        kv["nonce"] = nonce
        os.write(fd, (json.dumps(kv) + "\n").encode())

    def finish():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(0)

    import resource, signal
    def setlimit(kind, soft, hard=None):
        try:
            resource.setrlimit(kind, (soft, soft if hard is None else hard))
        except (ValueError, OSError):
            pass
    setlimit(resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1)
    setlimit(resource.RLIMIT_AS, lim["memory_bytes"])
    setlimit(resource.RLIMIT_FSIZE, lim["file_size_bytes"])
    setlimit(resource.RLIMIT_NPROC, lim["nproc"])
    setlimit(resource.RLIMIT_CORE, 0)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except Exception:
        pass
    if job["parent_pid"] is not None and os.getppid() != job["parent_pid"]:
        os._exit(1)

    class SandboxBlocked(PermissionError):
        pass

    def deny(what):
        def blocked(*args, **kwargs):
            raise SandboxBlocked(what + " is disabled in the sandbox")
        return blocked

    import socket, _socket
    class BlockedSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            raise SandboxBlocked("network is disabled in the sandbox")
    class BlockedRawSocket(_socket.socket):
        def __init__(self, *args, **kwargs):
            raise SandboxBlocked("network is disabled in the sandbox")
    socket.socket, socket.SocketType = BlockedSocket, BlockedSocket
    _socket.socket, _socket.SocketType = BlockedRawSocket, BlockedRawSocket
    for mod in (socket, _socket):
        for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo",
                     "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "dup"):
            if hasattr(mod, name):
                setattr(mod, name, deny("network"))
    import _posixsubprocess, posix
    for name in ("fork", "forkpty", "system", "popen", "execv", "execve", "execvp", "execvpe", "execl",
                 "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl",
                 "spawnle", "spawnlp", "spawnlpe", "posix_spawn", "posix_spawnp", "setsid", "setpgid",
                 "setpgrp", "kill", "killpg"):
        for mod in (os, posix):
            if hasattr(mod, name):
                setattr(mod, name, deny("process control (os." + name + ")"))
    _posixsubprocess.fork_exec = deny("process creation")

    def describe(exc):
        return {"etype": type(exc).__name__, "msg": str(exc)[:300], "errno": getattr(exc, "errno", None),
                "blocked": isinstance(exc, SandboxBlocked)}

    report("started", uid=os.getuid())
    ns = {"__name__": "candidate", "__builtins__": __builtins__}
    try:
        exec(compile(job["code"], "candidate.py", "exec"), ns)
    except SystemExit as exc:
        report("candidate_exit", code=str(exc.code)[:100])
        finish()
    except BaseException as exc:
        report("candidate_error", **describe(exc))
        finish()
    report("candidate_ok")
    for i, step in enumerate(job["steps"]):
        try:
            exec(compile(step["source"], "test_%d.py" % i, "exec"), ns)
        except BaseException as exc:
            report("step", index=i, kind=step["kind"], passed=False, **describe(exc))
            if step["kind"] != "test":
                break
            continue
        report("step", index=i, kind=step["kind"], passed=True)
    report("done")
    finish()

_harness()
"""


@dataclass(frozen=True)
class Step:
    """One unit run after the candidate, in the candidate's namespace.

    ``test`` steps are counted (a failure moves on to the next one); a failing ``setup`` or
    ``entry`` step (``candidate = entry_point``) stops the run.
    """

    kind: Literal["setup", "entry", "test"]
    source: str


@dataclass(frozen=True)
class Limits:
    """Per-run limits. ``cpu_s`` defaults to ``ceil(timeout_s) + 1`` (a backstop for the wall clock)."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    file_size_mb: int = 16
    nproc: int = 1  # counts every process/thread of the user: 1 means "create none" (unless root)
    output_bytes: int = 64_000
    cpu_s: int | None = None
    site_packages: bool = False
    isolation: Literal["auto", "namespace", "process"] = "auto"

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"sandbox timeout_s must be > 0, got {self.timeout_s}")
        if self.memory_mb < 32:
            raise ValueError(
                f"sandbox memory_mb must be >= 32 (the interpreter needs it), got {self.memory_mb}"
            )
        if self.output_bytes < 1 or self.file_size_mb < 0 or self.nproc < 0:
            raise ValueError(f"sandbox limits must be non-negative: {self}")
        if self.isolation not in ("auto", "namespace", "process"):
            raise ValueError(
                f"sandbox isolation must be 'auto', 'namespace' or 'process', got {self.isolation!r}"
            )


@dataclass
class SandboxOutcome:
    """What happened. ``events`` holds only the harness's own (nonce-checked) report lines."""

    returncode: int | None
    timed_out: bool
    output_limited: bool
    wall_s: float
    stdout: str
    stderr: str
    events: list[dict[str, Any]] = field(default_factory=list)
    foreign_lines: int = 0
    pid: int = 0
    workdir: str = ""
    sandbox: Literal["namespace", "process"] = "process"

    def find(self, event: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["event"] == event), None)


_ENV_BASE = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "no_proxy": "",
    "NO_PROXY": "",
}
_DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, connections are refused
_REPORT_CAP = 1 << 20
_ORPHAN_GRACE_S = 0.2  # after the child exits, how long orphans may keep our pipes open
_EXIT_GRACE_S = 2.0  # how long the leader may take to end by itself once its output is in
_NOBODY = 65534
_SANDBOX_TMP = "/tmp"  # where the run's working folder appears inside the namespace sandbox
# Hidden behind an empty tmpfs inside the namespace sandbox (when they are real folders and do not
# hold the interpreter): other users' homes, runtime sockets and mounted secrets.
_HIDDEN = ("/root", "/home", "/run", "/var/tmp", "/dev/shm")
_PROBE_TIMEOUT_S = 20.0

log = logging.getLogger(__name__)
_probe_lock = threading.Lock()
_probe_result: tuple[bool, str] | None = None


def _bind_back(root: str, paths: set[str]) -> list[str]:
    """``bwrap`` arguments that show ``paths`` under a covered ``root`` again, read-only at their own
    paths, after making the folders that lead to them (mode 0755) inside the cover."""
    args: list[str] = []
    made = {root}
    for keep in sorted(k for k in paths if k.startswith(root + "/")):
        chain, parent = [], os.path.dirname(keep)
        while parent not in made and parent.startswith(root + "/"):
            chain.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(chain):
            args += ["--perms", "0755", "--dir", d]
            made.add(d)
        args += ["--ro-bind", keep, keep]
    return args


def _bwrap_args(workdir: str) -> list[str]:
    """The ``bwrap`` command line (up to ``--``) for one run whose working folder is ``workdir``.

    As root, ``bwrap`` keeps only ``CAP_SETUID``/``CAP_SETGID`` and the harness drops to 65534
    before it reads anything untrusted (``job["drop_to"]``); as another user, the user namespace
    maps 65534 to that user. An interpreter installed under a hidden folder (pyenv in ``/root``)
    is bound back read-only at its own path, so only it shows there.
    """
    interp = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    interp.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    args = ["bwrap", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    for hidden in _HIDDEN:
        if not os.path.isdir(hidden) or os.path.islink(hidden):
            continue
        args += ["--tmpfs", hidden, *_bind_back(hidden, interp)]
    args += ["--bind", workdir, _SANDBOX_TMP, "--chdir", _SANDBOX_TMP]
    # An interpreter (e.g. a virtual environment) under /tmp is shadowed by the run's folder:
    # bind it back read-only at its own path (the folders leading to it are made in the run's folder).
    args += _bind_back(_SANDBOX_TMP, interp)
    args += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    # --as-pid-1: the harness is the namespace's PID 1 and bwrap's only child, so bwrap reaps it; with
    # an init of bwrap's own in between, that init was left a zombie under the host's PID 1 each run
    args += ["--die-with-parent", "--new-session", "--as-pid-1"]
    if os.geteuid() == 0:
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", "--disable-userns", "--uid", str(_NOBODY), "--gid", str(_NOBODY)]
    return [*args, "--"]


def _prepare_workdir(workdir: str) -> None:
    # 65534 owns it (the candidate writes there); group root lets the harness, still root but
    # without CAP_DAC_OVERRIDE, read and unlink the job file before it drops to 65534.
    if os.geteuid() == 0:
        os.chown(workdir, _NOBODY, 0)
        os.chmod(workdir, 0o770)


def namespace_sandbox_available() -> tuple[bool, str]:
    """Whether the ``bwrap`` namespace sandbox works here, and why not (probed once per process;
    a failure is logged once).

    The probe runs the interpreter under the exact command line a real run uses, so a missing
    binary, disabled user namespaces, a seccomp filter or an unreadable interpreter all show here.
    """
    global _probe_result
    with _probe_lock:
        if _probe_result is None:
            _probe_result = _probe()
            if not _probe_result[0]:
                log.warning(
                    "code sandbox: the namespace sandbox is unavailable (%s); candidates run in the "
                    "process sandbox only, which does not isolate the file system or host processes",
                    _probe_result[1],
                )
        return _probe_result


def _probe() -> tuple[bool, str]:
    if shutil.which("bwrap") is None:
        return False, "bwrap is not installed (Debian package 'bubblewrap')"
    workdir = tempfile.mkdtemp(prefix="teamrl-sandbox-probe-")
    drop = "import os\nif os.getuid() == 0:\n os.setgroups([]); os.setresgid(*[%d] * 3); os.setresuid(*[%d] * 3)\n"
    probe = drop % (_NOBODY, _NOBODY) + "import json, ctypes\nprint(os.getuid())"
    try:
        _prepare_workdir(workdir)
        proc = subprocess.run(
            [*_bwrap_args(workdir), sys.executable, "-I", "-S", "-c", probe],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=_PROBE_TIMEOUT_S,
            env=dict(_ENV_BASE),
            cwd="/",
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"bwrap probe failed: {exc}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if proc.returncode == 0 and proc.stdout.strip() == str(_NOBODY).encode():
        return True, ""
    err = proc.stderr.decode("utf-8", "replace").strip()[-300:]
    return False, f"bwrap probe exited {proc.returncode}: {err}"


def _use_namespace(limits: Limits) -> bool:
    if limits.isolation == "process":
        return False
    ok, why = namespace_sandbox_available()
    if not ok and limits.isolation == "namespace":
        raise SandboxUnavailable(f"the namespace sandbox was required but cannot run: {why}")
    return ok


def _has_exited(pid: int) -> bool:
    """Whether ``pid`` has exited, without reaping it (so its pid, our group id, stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _collect(
    proc: subprocess.Popen, report_fd: int, limits: Limits, start: float
) -> tuple[dict[str, bytes], bool, bool]:
    """Read stdout, stderr and the report pipe until EOF, the deadline, or an output cap."""
    assert proc.stdout is not None and proc.stderr is not None
    names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", report_fd: "report"}
    caps = {"stdout": limits.output_bytes, "stderr": limits.output_bytes, "report": _REPORT_CAP}
    bufs = {name: bytearray() for name in caps}
    poller = select.poll()
    for fd in names:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    open_fds = set(names)
    deadline = start + limits.timeout_s
    timed_out = limited = False
    exited_at: float | None = None
    while open_fds:
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            break
        if exited_at is None and _has_exited(proc.pid):
            exited_at = now
        if exited_at is not None and now - exited_at > _ORPHAN_GRACE_S:
            break
        for fd, _ in poller.poll(max(1, int(min(0.05, deadline - now) * 1000))):
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
                poller.unregister(fd)
                continue
            name = names[fd]
            room = caps[name] - len(bufs[name])
            bufs[name] += chunk[:room]
            if len(chunk) > room:
                limited = True
        if limited:
            break
    return {k: bytes(v) for k, v in bufs.items()}, timed_out, limited


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (``/proc/PID/task/PID/children``; empty when it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        return []


def _wait_exited(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``pid`` to exit, without reaping it."""
    deadline = time.monotonic() + timeout_s
    while not _has_exited(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _kill_and_reap(proc: subprocess.Popen, hurry: bool = True) -> int | None:
    """Kill what is left of the run and reap the leader; its exit status (None: unkillable).

    bwrap's child (the harness, PID 1 of the sandbox's namespace and in a session of its own, so
    ``killpg`` does not reach it) goes first: bwrap then reaps it and exits by itself. Killed first,
    bwrap would leave it running, and then a zombie under the host's PID 1 (issue 30). Unless
    ``hurry`` (a timeout or an output cap), the leader gets ``_EXIT_GRACE_S`` to end on its own."""
    if not _wait_exited(proc.pid, 0.0 if hurry else _EXIT_GRACE_S):
        for child in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
        _wait_exited(proc.pid, _EXIT_GRACE_S)
    # The leader is not reaped yet, so its pid (the group id) cannot have been reused.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # unkillable (D state): leave it, report no status
        return None


def run_python(code: str, steps: list[Step], limits: Limits | None = None) -> SandboxOutcome:
    """Run ``code`` then ``steps`` in a sandboxed interpreter; never raises for anything the code does.

    Raises ``SandboxUnavailable`` only if the interpreter cannot be started at all.
    """
    limits = limits or Limits()
    namespaced = _use_namespace(limits)
    workdir = tempfile.mkdtemp(prefix="teamrl-sandbox-")
    if namespaced:
        _prepare_workdir(workdir)
    inner_dir = _SANDBOX_TMP if namespaced else workdir
    read_fd, write_fd = os.pipe()
    os.set_inheritable(write_fd, True)
    try:
        job = _job(code, steps, limits, namespaced, write_fd)
        with open(os.path.join(workdir, "job.json"), "w") as f:
            json.dump(job, f)
        flags = ["-I"] if limits.site_packages else ["-I", "-S"]
        cmd = [sys.executable, *flags, "-c", HARNESS, os.path.join(inner_dir, "job.json")]
        if namespaced:
            cmd = _bwrap_args(workdir) + cmd
        start = time.monotonic()
        proc = _start_child(cmd, workdir, _child_env(inner_dir), write_fd)
        bufs, timed_out, limited, returncode = _wait_child(proc, read_fd, limits, start)
        wall_s = time.monotonic() - start
        if namespaced and returncode is not None and returncode > 128:
            returncode = 128 - returncode  # bwrap exits 128 + n when its child died of signal n
    finally:
        os.close(read_fd)
        shutil.rmtree(workdir, ignore_errors=True)
    events, foreign = _parse_report(bufs["report"], job["nonce"])
    return SandboxOutcome(
        returncode=returncode,
        timed_out=timed_out,
        output_limited=limited,
        wall_s=wall_s,
        stdout=bufs["stdout"].decode("utf-8", "replace"),
        stderr=bufs["stderr"].decode("utf-8", "replace"),
        events=events,
        foreign_lines=foreign,
        pid=proc.pid,
        workdir=workdir,
        sandbox="namespace" if namespaced else "process",
    )


def _job(code: str, steps: list[Step], limits: Limits, namespaced: bool, report_fd: int) -> dict[str, Any]:
    """What the harness reads from job.json: a fresh nonce, where to report, the code, the steps
    and the rlimits the child sets on itself."""
    return {
        "nonce": secrets.token_hex(16),
        "report_fd": report_fd,
        "parent_pid": None if namespaced else os.getpid(),
        "drop_to": _NOBODY if namespaced and os.geteuid() == 0 else None,
        "code": code,
        "steps": [{"kind": s.kind, "source": s.source} for s in steps],
        "limits": {
            "cpu_s": limits.cpu_s or math.ceil(limits.timeout_s) + 1,
            "memory_bytes": limits.memory_mb << 20,
            "file_size_bytes": limits.file_size_mb << 20,
            "nproc": limits.nproc,
        },
    }


def _child_env(inner_dir: str) -> dict[str, str]:
    """A clean environment: HOME and TMPDIR the run's folder, every proxy a closed local port."""
    env = dict(_ENV_BASE, HOME=inner_dir, TMPDIR=inner_dir)
    for var in ("http_proxy", "https_proxy", "ftp_proxy", "all_proxy"):
        env[var] = env[var.upper()] = _DEAD_PROXY
    return env


def _start_child(cmd: list[str], workdir: str, env: dict[str, str], report_fd: int) -> subprocess.Popen:
    """Start the harness in its own session, handing it only the report pipe's write end (which
    the parent closes here, so EOF on the read end means every holder is gone)."""
    try:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=env,
            start_new_session=True,
            pass_fds=(report_fd,),
        )
    except OSError as exc:
        raise SandboxUnavailable(f"cannot start {sys.executable}: {exc}") from exc
    finally:
        os.close(report_fd)


def _wait_child(
    proc: subprocess.Popen, report_fd: int, limits: Limits, start: float
) -> tuple[dict[str, bytes], bool, bool, int | None]:
    """Collect the child's output and report, then kill its whole group and reap it:
    (buffers, timed out, output limited, exit status or None)."""
    hurry = True
    try:
        bufs, timed_out, limited = _collect(proc, report_fd, limits, start)
        hurry = timed_out or limited
    finally:
        returncode = _kill_and_reap(proc, hurry)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    return bufs, timed_out, limited, returncode


def _parse_report(raw: bytes, nonce: str) -> tuple[list[dict[str, Any]], int]:
    events: list[dict[str, Any]] = []
    foreign = 0
    for line in raw.split(b"\n"):
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            foreign += 1
            continue
        if not isinstance(obj, dict) or obj.pop("nonce", None) != nonce or "event" not in obj:
            foreign += 1
            continue
        events.append(obj)
    return events, foreign
