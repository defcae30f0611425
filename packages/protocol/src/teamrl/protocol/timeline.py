"""Where a service's time goes: one state at a time, as Prometheus seconds and a run's timeline.

Call sequence (every service: the learner, the buffer, each rollout)::

    tl = Timeline.from_env("learner", replica="0")   # TEAMRL_TIMELINE=RUN/timeline.jsonl, or none
    tl.enter("sample_wait")      # closes the previous state's interval, opens this one
    ...
    with tl.state("export"):     # a nested state: the enclosing one resumes after the block
        ...
    tl.close()                   # closes the open interval and flushes

Each closed interval adds its seconds to ``teamrl_service_state_seconds_total{service, state}``
(a counter: ``rate()`` of it is the fraction of wall time in a state) and, when a path is set, becomes
one record ``{"service", "replica", "state", "t0", "t1"}`` (Unix seconds) of ``RUN/timeline.jsonl``.

Design decisions:

* **Cheap.** A transition is two clock reads and a list append; records are written in batches
  (every ``flush_every`` records or ``flush_s`` seconds, checked at a transition) as one ``os.write``
  on a file opened with ``O_APPEND``, so the services of a run share one file without interleaving
  lines (each batch is one append).
* **Wall-clock stamps** (``time.time``): the processes of a run share no monotonic clock, and lanes
  of different services must line up. Interval lengths for the counter use the same stamps.
* **States, not events.** A service is in exactly one state per lane; the lane's busy fraction is the
  share of its time in states not named in :data:`IDLE_STATES` (``teamrl show``).
* **Nothing is dropped silently**: a failed write is counted in ``teamrl_timeline_write_errors``
  and logged once; the records of that batch are lost (a timeline is diagnostics, never data).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prometheus_client import Counter

log = logging.getLogger("teamrl.timeline")

ENV_VAR = "TEAMRL_TIMELINE"

STATE_SECONDS = Counter(
    "teamrl_service_state_seconds",
    "Seconds a service spent in each state (rate() of it: the fraction of wall time in that state).",
    ["service", "state"],
)
WRITE_ERRORS = Counter("teamrl_timeline_write_errors", "Timeline batches that could not be written")

# states in which a service waits on another one (the rest count as busy)
IDLE_STATES = frozenset({"sample_wait", "weights_wait", "budget_wait", "idle", "wait"})


class Timeline:
    """One lane of a run's timeline (module docstring). Thread-safe: a lock guards transitions."""

    def __init__(
        self,
        service: str,
        replica: str = "0",
        path: Path | None = None,
        *,
        flush_every: int = 64,
        flush_s: float = 2.0,
    ) -> None:
        self.service, self.replica, self.path = service, str(replica), path
        self.flush_every, self.flush_s = flush_every, flush_s
        self._state: str | None = None
        self._t0 = time.time()
        self._pending: list[str] = []
        self._last_flush = self._t0
        self._lock = threading.Lock()
        self._warned = False

    @classmethod
    def from_env(cls, service: str, replica: str = "0") -> Timeline:
        """A lane writing to ``$TEAMRL_TIMELINE`` (set by ``teamrl run``); counters only when unset."""
        path = os.environ.get(ENV_VAR)
        return cls(service, replica, Path(path) if path else None)

    @property
    def current(self) -> str | None:
        return self._state

    def enter(self, state: str | None) -> str | None:
        """Close the open interval and open ``state`` (None: no state); returns the previous state.
        The state already open: nothing happens (a loop may say its state every turn)."""
        with self._lock:
            prev = self._state
            if state == prev:
                return prev
            now = time.time()
            if prev is not None and now > self._t0:
                self._record(prev, self._t0, now)
            self._state, self._t0 = state, now
            if self._pending and (
                len(self._pending) >= self.flush_every or now - self._last_flush >= self.flush_s
            ):
                self._flush(now)
            return prev

    @contextmanager
    def state(self, state: str) -> Iterator[None]:
        """``state`` for the block, then back to the state that was open before it."""
        prev = self.enter(state)
        try:
            yield
        finally:
            self.enter(prev)

    def close(self) -> None:
        """Close the open interval and write what is pending."""
        self.enter(None)
        with self._lock:
            self._flush(time.time())

    def _record(self, state: str, t0: float, t1: float) -> None:
        STATE_SECONDS.labels(self.service, state).inc(t1 - t0)
        if self.path is not None:
            rec = {"service": self.service, "replica": self.replica, "state": state, "t0": t0, "t1": t1}
            self._pending.append(json.dumps(rec, separators=(",", ":")))

    def _flush(self, now: float) -> None:
        self._last_flush = now
        if not self._pending or self.path is None:
            return
        data = ("\n".join(self._pending) + "\n").encode()
        self._pending = []
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as e:
            WRITE_ERRORS.inc()
            if not self._warned:
                self._warned = True
                log.warning("timeline %s: cannot write (%s); its records are lost", self.path, e)


def read_timeline(path: Path) -> list[dict[str, object]]:
    """The records of a ``timeline.jsonl`` (a torn last line from a kill is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and {"service", "state", "t0", "t1"} <= rec.keys():
            out.append(rec)
    return out
