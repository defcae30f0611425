"""Local TCP ports for services a launcher plans before starting them (docs/reliability.md R-ports).

A launcher chooses every service's ports first, writes them into the services' command lines, and only
then starts the services, which bind seconds later. Two things can take a chosen port in between:

- the launcher itself, choosing again: ``bind(("127.0.0.1", 0))`` returns a port the kernel considers
  free *now*, so a port checked but not yet bound (the second of a PUB + "latest" pair) can be handed
  out a second time, and whichever service binds later fails with EADDRINUSE on every restart;
- any process's outgoing connection, whose local port the kernel takes from the same ephemeral range
  that ``bind(0)`` draws from.

So ports here are drawn at random from *below* the kernel's ephemeral range (which no outgoing
connection or ``bind(0)`` ever uses), checked free by binding, and never handed out twice by one
process. Where the range below is too narrow (an unusual ``ip_local_port_range``), the kernel's
``bind(0)`` is the fallback, still without repeats.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

LOWEST = 10000  # below: well-known and registered services' habits
EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default
TRIES = 500

_given: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports and ``bind(0)``."""
    try:
        lo, hi = (int(x) for x in EPHEMERAL_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port(span: int = 1) -> int:
    """A port p such that p .. p + span - 1 are free now and none was handed out before by this process.

    ``span=2`` is a service that binds two adjacent ports (the learner's weights PUB and its "latest"
    RPC). Thread-safe.
    """
    if span < 1:
        raise ValueError(f"span must be >= 1, got {span}")
    lo_eph, _ = ephemeral_range()
    below = lo_eph - LOWEST - span
    with _lock:
        for _ in range(TRIES):
            p = _rng.randrange(LOWEST, lo_eph - span + 1) if below > 1000 else _kernel_port()
            wanted = range(p, p + span)
            if wanted[-1] > 65535 or any(q in _given for q in wanted):
                continue
            if all(_bindable(q) for q in wanted):
                _given.update(wanted)
                return p
    raise RuntimeError(f"no {span} adjacent free port(s) on 127.0.0.1 after {TRIES} tries")
