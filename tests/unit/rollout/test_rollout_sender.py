"""The rollout's sender thread on exit: everything acked when the buffer is there, and a bounded
exit that counts what was left when it is not."""

from __future__ import annotations

import threading
import time

from teamrl.protocol.ports import free_port
from teamrl.protocol.zmq_transport import ZmqDataReceiver
from teamrl.rollout.sender import Sender as _Sender


def test_exit_with_a_backlog_and_no_buffer_is_bounded_and_counts_every_frame() -> None:
    # nobody listens: a queue longer than the window must not keep the thread past flush_timeout_s
    sender = _Sender(f"tcp://127.0.0.1:{free_port()}", "rollout-test", window=2)
    sender.flush_timeout_s = 0.5
    for i in range(10):
        sender.put(b"frame-%d" % i)
    sender.stop_event.set()
    t0 = time.monotonic()
    sender.start()
    sender.join(20)
    assert not sender.is_alive(), "the sender outlived its exit deadline"
    assert time.monotonic() - t0 < 10
    assert sender.lost == 10  # the window's un-acked frames plus the never-sent rest


def test_exit_sends_the_queue_and_waits_for_the_acks() -> None:
    rx = ZmqDataReceiver(f"tcp://127.0.0.1:{free_port()}")
    got: list[bytes] = []
    done = threading.Event()

    def buffer() -> None:
        while not done.is_set():
            frame = rx.recv(100)
            if frame is not None:
                got.append(bytes(frame.payload))
                rx.ack(frame)

    t = threading.Thread(target=buffer, daemon=True)
    t.start()
    sender = _Sender(rx.endpoint, "rollout-test", window=2)
    sender.flush_timeout_s = 30.0
    for i in range(10):
        sender.put(b"frame-%d" % i)
    sender.stop_event.set()
    sender.start()
    sender.join(60)
    done.set()
    t.join(5)
    rx.close()
    assert not sender.is_alive()
    assert sender.lost == 0
    assert got == [b"frame-%d" % i for i in range(10)]


def test_stop_while_the_window_is_full_and_no_buffer_exits_within_the_flush_deadline() -> None:
    # The buffer is gone while producing: the thread waits in send() for credit that never comes.
    # The stop event must end that wait; the exit then takes at most flush_timeout_s.
    sender = _Sender(f"tcp://127.0.0.1:{free_port()}", "rollout-test", window=2)
    sender.flush_timeout_s = 1.0
    sender.start()
    for i in range(10):
        sender.put(b"frame-%d" % i)
    deadline = time.monotonic() + 10
    while sender.unacked < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sender.unacked == 2, "the window never filled"
    time.sleep(0.3)  # now blocked in send() for the third frame
    t0 = time.monotonic()
    sender.stop_event.set()
    sender.join(20)
    assert not sender.is_alive(), "the sender did not see the stop event"
    assert time.monotonic() - t0 < sender.flush_timeout_s + 1.0
    assert sender.lost == 10  # 2 un-acked + 1 held + 7 never taken from the queue
