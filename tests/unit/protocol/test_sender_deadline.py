"""ZmqDataSender.send with a full window: the wait has a deadline, sees a stop callback, and says
every few seconds which endpoint it waits for and for how long."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from teamrl.protocol import zmq_transport
from teamrl.protocol.errors import PeerTimeout
from teamrl.protocol.zmq_transport import ZmqDataSender


def _nobody() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_full_window_times_out_and_keeps_the_frame_out() -> None:
    sender = ZmqDataSender(_nobody(), "inc-deadline", window=2, ack_timeout_s=30)
    try:
        assert sender.send(b"a") == 0 and sender.send(b"b") == 1
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout):
            sender.send(b"c", timeout_s=0.3)
        assert 0.25 <= time.monotonic() - t0 < 2.0
        assert sender.unacked == 2 and sender.sent == 2  # the third frame was not taken
    finally:
        assert sender.close() == 2


def test_stop_callback_ends_the_wait_and_the_wait_is_logged(monkeypatch, caplog) -> None:
    monkeypatch.setattr(zmq_transport, "WAIT_LOG_S", 0.2)
    endpoint = _nobody()
    sender = ZmqDataSender(endpoint, "inc-stop", window=1, ack_timeout_s=30)
    stop = threading.Event()
    threading.Timer(0.7, stop.set).start()
    try:
        sender.send(b"a")
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger=zmq_transport.__name__), pytest.raises(PeerTimeout):
            sender.send(b"b", stop=stop.is_set)
        assert 0.6 <= time.monotonic() - t0 < 2.0
    finally:
        sender.close()
    waits = [r.getMessage() for r in caplog.records if "window full" in r.getMessage()]
    assert waits, "no wait message"
    assert endpoint in waits[0] and "inc-stop" in waits[0] and "never up" in waits[0]
