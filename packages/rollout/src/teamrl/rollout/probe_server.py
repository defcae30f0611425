"""The HTTP probe server of a rollout service: /metrics (Prometheus), /healthz, /readyz.

/healthz says the asyncio loop is alive (it ticked in the last 30 s), /readyz that a policy is
being served, the engine is up and the service is not draining (else 503 and the reason). It
serves from a daemon thread, so a stalled loop still answers /healthz (with 503).
"""

from __future__ import annotations

import http.server
import threading
import time
from typing import Any, Protocol


class Probed(Protocol):
    """What the probes read of the service (``teamrl.rollout.service.RolloutService`` is one)."""

    last_tick: float  # time.monotonic() of the loop's last tick

    def not_ready_reason(self) -> str: ...  # "" when ready


class ProbeServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], svc: Probed) -> None:
        self.svc = svc
        super().__init__(addr, _Handler)

    @classmethod
    def serve(cls, host: str, port: int, svc: Probed) -> ProbeServer:
        """Bound to ``host:port`` and serving from a daemon thread."""
        server = cls((host, port), svc)
        threading.Thread(target=server.serve_forever, name="teamrl-http", daemon=True).start()
        return server


class _Handler(http.server.BaseHTTPRequestHandler):
    server: ProbeServer
    timeout = 10.0  # seconds a connection may sit idle: a slow or silent client cannot hold a thread

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        svc = self.server.svc
        if self.path == "/metrics":
            body, ctype, code = generate_latest(), CONTENT_TYPE_LATEST, 200
        elif self.path == "/healthz":
            alive = time.monotonic() - svc.last_tick < 30.0
            body, ctype, code = (
                (b"ok\n" if alive else b"event loop stalled\n"),
                "text/plain",
                200 if alive else 503,
            )
        elif self.path == "/readyz":
            why = svc.not_ready_reason()
            body = (why or "ready").encode() + b"\n"
            ctype, code = "text/plain", 503 if why else 200
        else:
            body, ctype, code = b"not found\n", "text/plain", 404
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # probes every few seconds: keep the log for events
