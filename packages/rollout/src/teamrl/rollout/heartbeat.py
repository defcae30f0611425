"""A rollout service's presence at the buffer: one ``Hello``, then a ``Heartbeat`` every interval.

``heartbeats`` (run by ``teamrl.rollout.service.RolloutService``) talks to the buffer's RPC
endpoint. The data path never depends on it: a buffer that does not answer is logged every few
seconds (which endpoint, for how long), never fatal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("teamrl.rollout")


async def heartbeats(
    endpoint: str,
    incarnation: str,
    capabilities: list[str],
    *,
    curve: Any,
    interval_s: float,
    load: Callable[[], float],
    stopping: Callable[[], bool],
) -> None:
    """Hello once (who I am: ``incarnation``, ``capabilities``), then a Heartbeat carrying
    ``load()`` every ``interval_s``, until ``stopping()``. Until the Hello is answered it is
    retried every second."""
    from teamrl.protocol.control import Heartbeat, Hello
    from teamrl.protocol.errors import PeerTimeout
    from teamrl.protocol.zmq_transport import RpcClient

    rpc = RpcClient(endpoint, timeout_ms=2000, curve=curve)
    hello = Hello(service="rollout", incarnation=incarnation, capabilities=capabilities)
    said_hello, beat = False, 0
    last_answer = time.monotonic()
    try:
        while not stopping():
            msg = (
                Heartbeat(incarnation=incarnation, seq=beat, time=time.time(), load=load())
                if said_hello
                else hello
            )
            try:
                await asyncio.to_thread(rpc.call, msg)
                if said_hello:
                    beat += 1
                said_hello = True
                last_answer = time.monotonic()
            except PeerTimeout:  # said every few seconds: which endpoint, for how long
                log.warning(
                    "buffer control endpoint %s has not answered for %.0f s (%s)",
                    endpoint,
                    time.monotonic() - last_answer,
                    msg.type,
                )
            await asyncio.sleep(interval_s if said_hello else 1.0)
    finally:
        rpc.close()
