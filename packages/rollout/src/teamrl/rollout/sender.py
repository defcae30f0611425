"""The sender thread: the one owner of the ZeroMQ DEALER that carries trajectories to the buffer.

A rollout service's asyncio loop hands each finished group (one Arrow frame) to :class:`Sender`
(``put`` / ``put_bounded``, which waits while ``max_queued_frames`` wait: backpressure); the thread
sends them within the credit window, counts acks, resends after a reconnect, and on stop gets
``flush_timeout_s`` to send what is queued and have it acked. Nothing is dropped silently: what is
not acked by then is counted in ``lost`` (the service exits 1) and logged.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any

from teamrl.rollout import metrics as M

log = logging.getLogger("teamrl.rollout")


class Sender(threading.Thread):
    """Owns the ZeroMQ DEALER: frames from a queue go out; acks come back; nothing is dropped."""

    def __init__(self, endpoint: str, incarnation: str, window: int, curve: Any = None) -> None:
        super().__init__(name="teamrl-sender", daemon=True)
        self.endpoint = endpoint
        self.curve = curve  # CurveKeys of the rollout role for the buffer's data socket, or None
        self.incarnation = incarnation
        self.window = window
        self.q: queue.Queue[bytes] = queue.Queue()
        self.stop_event = threading.Event()
        self.flush_timeout_s = 30.0
        self.lost = 0
        self.unacked = 0
        self.connected = threading.Event()
        self.blocked = 0  # groups waiting in put_bounded for room in the queue (asyncio side)

    def run(self) -> None:
        """Send until stopped; then ``flush_timeout_s`` in all for the queued frames and their acks.

        The exit deadline covers the queue too: after a long cut the queue can hold hundreds of
        frames, and sending them all at the buffer's ingest rate took 88 s in the topology test,
        past any grace period. What is not acked by the deadline is counted in ``lost``."""
        from teamrl.protocol.errors import PeerTimeout
        from teamrl.protocol.zmq_transport import ZmqDataSender

        sender = ZmqDataSender(self.endpoint, self.incarnation, window=self.window, curve=self.curve)
        acked_seen = 0
        deadline: float | None = None
        unsent = 0
        held: bytes | None = None  # taken from the queue, not yet taken by the sender
        try:
            while True:
                if self.stop_event.is_set():
                    deadline = deadline or time.monotonic() + self.flush_timeout_s
                    if (held is None and self.q.empty()) or time.monotonic() >= deadline:
                        break
                    if sender.unacked >= self.window:  # send would block past the deadline
                        sender.flush(min(0.05, max(0.0, deadline - time.monotonic())))
                        continue
                if held is None:
                    try:
                        held = self.q.get(timeout=0.05)
                    except queue.Empty:
                        sender.flush(0.0)
                if held is not None:
                    try:
                        # A full window waits for acks until the stop event: a buffer that is gone
                        # must not keep the thread (and SIGTERM) waiting here for ever.
                        sender.send(held, stop=self.stop_event.is_set)
                    except PeerTimeout:
                        pass  # stopping: the frame stays held, sent or counted as lost below
                    else:
                        held = None
                        M.FRAMES_SENT.inc()
                if sender._connects:
                    self.connected.set()
                M.FRAMES_ACKED.inc(sender.acked - acked_seen)
                acked_seen = sender.acked
                self.unacked = sender.unacked
                M.PUBLISH_QUEUE.set(self.q.qsize() + sender.unacked)
            unsent = self.q.qsize() + (held is not None)
            left = max(0.0, deadline - time.monotonic()) if deadline else self.flush_timeout_s
            if not sender.flush(left) or unsent:
                log.warning(
                    "%d frames not acknowledged after %.0f s (%d of them never sent)",
                    sender.unacked + unsent,
                    self.flush_timeout_s,
                    unsent,
                )
            M.FRAMES_ACKED.inc(sender.acked - acked_seen)
        finally:
            self.lost = sender.close() + unsent
            M.PUBLISH_QUEUE.set(self.lost)

    def load(self) -> float:
        """Frames queued or in flight, as a share of the window (capped at 1): the heartbeat's load."""
        return min(1.0, (self.q.qsize() + self.unacked) / max(1, self.window))

    def put(self, payload: bytes) -> None:
        self.q.put(payload)
        M.PUBLISH_QUEUE.set(self.q.qsize() + self.unacked)

    async def put_bounded(self, payload: bytes, max_queued: int, stopping: Any) -> None:
        """Queue a frame once fewer than ``max_queued`` wait to be sent (backpressure: the group that
        finished waits, so no new group starts while the buffer cannot keep up). On stop it queues at
        once: the exit flush sends or counts it."""
        self.blocked += 1
        try:
            while self.q.qsize() >= max_queued and not stopping() and self.is_alive():
                await asyncio.sleep(0.05)
        finally:
            self.blocked -= 1
        self.put(payload)
