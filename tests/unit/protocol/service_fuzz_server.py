"""One server for ``test_service_fuzz.py``, in its own process so that its RSS is its own (not the
fuzzer's) and a crash fails the test instead of pytest: ``python service_fuzz_server.py KIND DIR``
starts it, prints one JSON line of endpoints, and serves until its stdin closes (exit 0).

KIND: ``buffer`` (the buffer service's loop: data ingest + RPC, plaintext), ``latest`` (a
``WeightsPublisher`` that published version 7), ``http`` (the rollout's metrics HTTP server on a stub
service)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


class StubRollout:
    """What the rollout's HTTP handler reads from its service."""

    @property
    def last_tick(self) -> float:
        return time.monotonic()

    def not_ready_reason(self) -> str:
        return ""


def weights(version: int):
    from teamrl.protocol import control as C

    return C.WeightsPublished(
        announce_seq=0,
        version=version,
        adapters={"solver": "solver-lora"},
        location=C.UriWeights(uri="/tmp/adapters/v1"),
        sha256="0" * 64,
        probe=C.Probe(prompt_ids=[1], completion_ids=[2], expected_logprobs=[-0.5]),
    )


def main(kind: str, directory: Path) -> int:
    stop = threading.Event()

    def wait_stdin() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_stdin, daemon=True).start()

    def ready(**endpoints: object) -> None:
        print(json.dumps(endpoints), flush=True)

    if kind == "buffer":
        from teamrl.learner.buffer_config import BufferConfig
        from teamrl.learner.buffer_service import BufferService
        from teamrl.protocol.config import TransportConfig

        cfg = BufferConfig(
            bind="tcp://127.0.0.1:*",
            sample_bind="tcp://127.0.0.1:*",
            dir=directory / "buffer",
            max_policy_lag=None,  # nothing dropped as stale: what is stored is counted
            checkpoint_interval_s=0.01,
            fsync=False,
            capacity=256,
        )
        svc = BufferService(cfg, TransportConfig())
        ready(data=svc.receiver.endpoint, rpc=svc.rpc.endpoint)
        while not stop.is_set() and svc.stop_reason is None:
            svc.turn()
        svc.close()
        return 0 if stop.is_set() else 3  # 3: something stopped it that should not have
    if kind == "latest":
        from teamrl.protocol.zmq_transport import WeightsPublisher

        pub = WeightsPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        pub.publish(weights(7))
        ready(latest=pub.latest_endpoint)
        stop.wait()
        pub.close()
        return 0
    if kind == "http":
        from teamrl.rollout.probe_server import ProbeServer as _Http

        server = _Http(("127.0.0.1", 0), StubRollout())  # type: ignore[arg-type]
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        ready(http=list(server.server_address[:2]))
        stop.wait()
        server.shutdown()
        server.server_close()
        return 0
    raise SystemExit(f"unknown kind {kind!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
