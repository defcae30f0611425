"""Start, watch and stop the services of a local run as separate OS processes.

Each service is a ``teamrl <service> ...`` child process with its own log file in the run folder.
They talk only over ZeroMQ on loopback, exactly as across a cluster; the supervisor never shares
memory with them. Stopping sends SIGTERM (services drain and flush), waits, then SIGKILLs stragglers.

Each service runs in its own session and process group (its vLLM engine and workers inherit it), so the
supervisor ends whole groups: after a service exits or is killed, and before it is restarted, whatever
is left in its group is SIGKILLed. Each service also gets SIGTERM from the kernel if the supervisor
itself dies (``PR_SET_PDEATHSIG``, ``teamrl.protocol.children``), and a rollout's own reaper covers its
children even when it is killed outside a supervisor (docs/architecture.md §2).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from teamrl.protocol.children import parent_death_env

STACKS_GRACE_S = 2.0  # between SIGUSR1 (print stacks) and SIGKILL


@dataclass
class Service:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()  # inherited variables the service must not see (e.g. a rendezvous)
    proc: subprocess.Popen | None = None
    group_ended: bool = False  # the group of the exited ``proc`` was SIGKILLed (once: pgids recycle)
    killed: bool = False  # SIGKILLed by ``stop`` after ignoring SIGTERM

    def start(self) -> None:
        self.end_group()  # a restart: nothing of the previous incarnation may hold ports or memory
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in self.unset} | self.env
        # SIGTERM when the supervisor dies (the service drains and exits), set by the service itself
        # (teamrl.protocol.children). Only the main thread lives as long as the supervisor:
        # PDEATHSIG fires when the *thread* that started the child exits.
        if threading.current_thread() is threading.main_thread():
            env |= parent_death_env(signal.SIGTERM)
        fh = open(self.log, "ab")  # noqa: SIM115  (owned by the child for its lifetime)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "teamrl.cli.main", *self.argv],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own group: the service and every child it starts
        )
        self.group_ended = False
        fh.close()

    def end_group(self) -> None:
        """SIGKILL what is left in the group of an exited service (its engine, workers, sandboxes)."""
        if self.proc is None or self.proc.poll() is None or self.group_ended:
            return
        self.group_ended = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def kill_with_stacks(self, grace: float = STACKS_GRACE_S) -> None:
        """SIGKILL a service that did not stop in time; first SIGUSR1 asks it to print every thread's
        stack into its log (``faulthandler``, registered by ``teamrl.cli.main``), so the log says where
        it was stuck."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)  # the dump is written by a C handler at once; this is slack
        if self.proc.poll() is None:
            self.killed = True
            print(
                f"[teamrl] {self.name} did not stop after SIGTERM: killed; its thread stacks are at the end of {self.log}",
                file=sys.stderr,
                flush=True,
            )
            self.proc.kill()
        self.proc.wait()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Supervisor:
    def __init__(self) -> None:
        self.services: list[Service] = []

    def start(self, svc: Service) -> Service:
        svc.start()
        self.services.append(svc)
        return svc

    def dead(self) -> list[Service]:
        """Services that exited; what they left in their process groups is ended here."""
        dead = [s for s in self.services if s.proc is not None and s.proc.poll() is not None]
        for s in dead:
            s.end_group()
        return dead

    def stop(self, timeout: float = 30.0, order: list[str] | None = None) -> dict[str, int | None]:
        """SIGTERM every service (in ``order`` of name prefixes if given), wait, then SIGKILL."""
        groups: list[list[Service]] = []
        if order:
            for prefix in order:
                groups.append([s for s in self.services if s.name.startswith(prefix)])
            rest = [s for s in self.services if not any(s in g for g in groups)]
            groups.append(rest)
        else:
            groups = [self.services]
        for group in groups:
            for s in group:
                if s.alive:
                    s.proc.send_signal(signal.SIGTERM)
            deadline = time.time() + timeout
            for s in group:
                if s.proc is None:
                    continue
                try:
                    s.proc.wait(max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    s.kill_with_stacks()
                s.end_group()
        return {s.name: (s.proc.returncode if s.proc else None) for s in self.services}
