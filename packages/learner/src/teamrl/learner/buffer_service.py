"""The replay buffer process: trajectories in over ZeroMQ (acked), samples out over RPC, metrics,
a stats file, and the ``teamrl buffer`` command line.

One single-threaded loop, top to bottom (ZeroMQ sockets are single-threaded anyway)::

    while running:
        frames in     recv while the rate limiter admits inserts; decode; insert; append to the
                      current segment (durable); the frame now waits for its ack
        requests      SampleRequest -> SampleReply | ErrorReply; BufferStatsRequest -> BufferStats;
                      Drain / Shutdown -> BufferStats, then stop
        groups        release the ones past group_timeout_s
        checkpoint    when frames wait (checkpoint_interval_s or checkpoint_max_frames) or the
                      state changed; then ack exactly the frames it covers
        stats         one JSON line in DIR/stats.jsonl every STATS_INTERVAL_S

Why acks wait for a checkpoint: the (incarnation, seq) table that de-duplicates resends lives in
the checkpoint, so a frame acked before it would come back after a crash as new data. A frame that
fails to decode is refused at once (negative ack, counted by reason); the loop goes on.

Who may do what (docs/transport-security.md): ``Drain``/``Shutdown`` are obeyed only on the operator's
admin socket (``admin_bind``, by default ``ipc://DIR/admin.sock``, mode 0600: local only) or from a
peer holding the CURVE ``admin`` key; from anyone else they are refused (``not_admin``) and counted
in ``teamrl_protocol_auth_refused_total{socket="buffer_rpc"}``. With CURVE on, every RPC message is
authorised by the role of the key it came with (``teamrl.protocol.curve.BUFFER_RPC_RIGHTS``: rollout
Hello/Heartbeat, learner SampleRequest/BufferStatsRequest, admin BufferStatsRequest/Drain/Shutdown);
anything else is refused as ``not_authorised``, counted the same way, logged at most once per role
and message type every ``AUTH_LOG_S``, and the loop keeps serving. Without CURVE roles cannot be
told apart, so only the Drain/Shutdown rule holds. Versions come from ``VersionAnnounce`` alone (the
``learner`` key's, under CURVE): a frame's step or a sample's ``min_policy_version`` above its base's
announced version is refused (``policy_version_unpublished``), and anything more than
``policy_version_window`` above the current version (``policy_version_out_of_range``), counted, and not
stored, whoever sends it; model and agent ids the plan does not name are refused the same way
(``unknown_model_id``, ``unknown_agent_id``; docs/security.md).
A ``SampleRequest``'s ``agent_ids`` and ``model_id`` pick a learner group's view and base model
(docs/architecture.md, "The replay buffer"); an empty ``agent_ids`` list, or ids no step can carry,
is refused as ``invalid_agent_ids`` and counted.
CURVE on the data and RPC sockets comes from the ``[transport]`` table of the same config file
(``teamrl.protocol.config.TransportConfig``: ``curve``, ``curve_dir``).

SIGTERM / SIGINT / Drain / Shutdown: final checkpoint, ack, flush, exit 0. SIGKILL: the restarted
process loads the last complete checkpoint, restores the receiver's de-duplication table, and
producers resend whatever was not acked.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from teamrl.learner.buffer import (
    GROUPS_PENDING,
    MAX_AGENT_ID_CHARS,
    InvalidAgentId,
    InvalidView,
    Refused,
    ReplayBuffer,
    UnknownId,
    VersionOutOfRange,
)
from teamrl.learner.buffer_config import BufferConfig
from teamrl.learner.buffer_segments import SegmentStore
from teamrl.protocol import metrics as wire_metrics
from teamrl.protocol.codec import decode_batches
from teamrl.protocol.config import (
    TRANSPORT_EPILOG,
    NoKeys,
    TransportConfig,
    add_insecure_flag,
    transport_mode,
)
from teamrl.protocol.configfile import ConfigError as SharedConfigError
from teamrl.protocol.configfile import load_section
from teamrl.protocol.control import (
    MAX_STATS_MODELS,
    BufferStats,
    BufferStatsRequest,
    Drain,
    ErrorReply,
    Heartbeat,
    Hello,
    SampleReply,
    SampleRequest,
    Shutdown,
    VersionAnnounce,
    _Message,
)
from teamrl.protocol.curve import BUFFER_RPC_RIGHTS, key_roles
from teamrl.protocol.errors import ProtocolError
from teamrl.protocol.transport import Frame
from teamrl.protocol.zmq_transport import RpcServer, ZmqDataReceiver

log = logging.getLogger("teamrl.buffer")

STATS_INTERVAL_S = 2.0
POLL_MS = 10  # longest a quiet socket is waited on per loop turn (two sockets: ~20 ms per idle turn)
MAX_FRAMES_PER_TURN = 64  # frames taken in before requests get a turn
MAX_REQUESTS_PER_TURN = 16
ACK_FLUSH_S = 0.2  # on exit, time for the last acks to leave (sockets close with LINGER 0)
PRODUCER_TIMEOUT_S = 15.0  # a rollout silent this long (no heartbeat) counts as gone
MAX_PRODUCERS = 4096  # Hello/Heartbeat bookkeeping kept; the oldest entry goes first past this
AUTH_LOG_S = 10.0  # one log line per (role, message type) refused at most this often; the counter counts all


class ConfigError(SharedConfigError):
    """The buffer's config file or flags are wrong; the message names the field."""


class BufferService:
    """The process around a ``ReplayBuffer``. ``BufferService(cfg).run()`` returns the exit code."""

    def __init__(self, cfg: BufferConfig, transport: TransportConfig | None = None) -> None:
        self.cfg = cfg
        self.transport = transport or TransportConfig()
        cfg.dir.mkdir(parents=True, exist_ok=True)
        (cfg.dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n")
        self.store = SegmentStore(cfg.dir, fsync=cfg.fsync, keep_checkpoints=cfg.keep_checkpoints)
        self.buffer = ReplayBuffer(cfg)
        now = time.monotonic()
        state, trajectories = self.store.load()
        if state is not None:
            self.buffer.load_state_dict(state, trajectories, now)
        self.receiver = ZmqDataReceiver(
            cfg.bind,
            hwm=cfg.recv_hwm,
            max_msg_size=cfg.max_msg_size,
            curve=self.transport.server_curve("buffer_data"),
        )
        for incarnation, seqs in self.buffer.seen().items():
            self.receiver.restore(incarnation, seqs)
        self.rpc = RpcServer(
            cfg.sample_bind, self.handle, curve=self.transport.server_curve("buffer_rpc"), name="buffer_rpc"
        )
        # z85 public key -> role, when keys are per role; None: roles cannot be told apart (plaintext,
        # or a single CURVE pair with an allow-list folder), so only Drain/Shutdown are restricted
        curve_dir = self.transport.curve_dir if self.transport.curve else None
        self._roles: dict[str, str] | None = key_roles(curve_dir) if curve_dir is not None else None
        self._auth_logged: dict[tuple[str, str], float] = {}
        admin = cfg.admin_bind or f"ipc://{cfg.dir.resolve() / 'admin.sock'}"
        self.admin = RpcServer(admin, self.handle_admin, name="buffer_admin")
        if admin.startswith("ipc://"):
            os.chmod(admin[len("ipc://") :], 0o600)
        self.waiting: list[Frame] = []  # persisted, not yet covered by a checkpoint (so not acked)
        self.first_wait = 0.0
        self.dirty = False  # state changed since the last checkpoint
        self.stop_reason: str | None = None
        self.last_checkpoint = now
        self.last_stats = 0.0
        self._dups_seen = 0
        self.producers: dict[str, dict[str, Any]] = {}  # incarnation -> Hello/Heartbeat bookkeeping
        log.info(
            "buffer up: data %s, sample %s, dir %s; %d held, %d pending groups, %d inserted so far",
            self.receiver.endpoint,
            self.rpc.endpoint,
            cfg.dir,
            self.buffer.size,
            self.buffer.pending_groups,
            self.buffer.inserted,
        )

    # --- requests -----------------------------------------------------------------------------

    def _remember(self, incarnation: str, entry: dict[str, Any]) -> dict[str, Any]:
        self.producers.pop(incarnation, None)
        self.producers[incarnation] = entry
        while len(self.producers) > MAX_PRODUCERS:
            del self.producers[next(iter(self.producers))]
        return entry

    def handle(self, msg: _Message) -> _Message:
        refused = self._authorise(msg)
        if refused is not None:
            return refused
        if isinstance(msg, SampleRequest):
            return self._sample(msg)
        if isinstance(msg, BufferStatsRequest):
            return self.stats()
        if isinstance(msg, VersionAnnounce):
            return self._announce(msg)
        if isinstance(msg, Hello):
            known = msg.incarnation in self.producers
            self._remember(msg.incarnation, {"service": msg.service, "last_seen": time.time(), "beats": 0})
            if not known:
                log.info("%s %s registered (%s)", msg.service, msg.incarnation, ", ".join(msg.capabilities))
            return self.stats()
        if isinstance(msg, Heartbeat):
            entry = self._remember(
                msg.incarnation,
                self.producers.get(msg.incarnation) or {"service": "unknown", "last_seen": 0.0, "beats": 0},
            )
            entry["last_seen"] = time.time()
            entry["beats"] += 1
            return self.stats()
        if isinstance(msg, (Drain, Shutdown)):
            return self.handle_admin(msg)  # authorised above: the admin key
        return ErrorReply(reason="unexpected_request", message=f"the buffer does not serve {msg.type!r}")

    def handle_admin(self, msg: _Message) -> _Message:
        """The operator's requests (admin socket, or the CURVE admin key on the RPC socket)."""
        if isinstance(msg, (Drain, Shutdown)):
            log.info("%s requested (%s): stopping", msg.type, msg.reason or "no reason given")
            self.stop_reason = msg.type
            return self.stats()
        if isinstance(msg, BufferStatsRequest):
            return self.stats()
        return ErrorReply(
            reason="unexpected_request", message=f"the admin socket does not serve {msg.type!r}"
        )

    def _peer_role(self) -> str | None:
        """The CURVE role of the request being served (None: plaintext, or no per-role keys)."""
        if self._roles is None or not self.rpc.peer_key:
            return None
        return self._roles.get(self.rpc.peer_key)

    def _authorise(self, msg: _Message) -> ErrorReply | None:
        """None when the sender's role may send ``msg`` on the RPC socket, else the refusal (counted
        in ``teamrl_protocol_auth_refused_total{socket="buffer_rpc",reason}``, rate-limited log)."""
        stop = isinstance(msg, (Drain, Shutdown))
        if self._roles is None:  # roles cannot be told apart: only the operator rule applies
            return self._deny(msg, None, "not_admin") if stop else None
        role = self._peer_role()
        if role is not None and msg.type in BUFFER_RPC_RIGHTS.get(role, ()):
            if not (isinstance(msg, Hello) and role in ("rollout", "learner") and msg.service != role):
                return None
        return self._deny(msg, role, "not_admin" if stop else "not_authorised")

    def _deny(self, msg: _Message, role: str | None, reason: str) -> ErrorReply:
        wire_metrics.AUTH_REFUSED.labels(socket="buffer_rpc", reason=reason).inc()
        who = f"the {role} key" if role else ("an unknown key" if self._roles is not None else "a peer")
        now, key = time.monotonic(), (role or "", msg.type)
        if now - self._auth_logged.get(key, -AUTH_LOG_S) >= AUTH_LOG_S:
            self._auth_logged[key] = now
            log.warning("%s from %s refused (%s); the buffer keeps serving", msg.type, who, reason)
        what = "only the operator may stop the buffer" if reason == "not_admin" else f"{who} may not send it"
        return ErrorReply(
            request_id=getattr(msg, "request_id", -1), reason=reason, message=f"{msg.type}: {what}"
        )

    def _announce(self, msg: VersionAnnounce) -> _Message:
        try:
            moved = self.buffer.announce(msg.model_id, msg.version, msg.agent_ids)
        except (VersionOutOfRange, InvalidAgentId, UnknownId) as e:  # counted by the buffer
            log.warning("version announcement refused: %s", e)
            return ErrorReply(reason=e.reason, message=str(e))
        if moved:  # durable before the reply: the learner publishes next, and no crash may forget it
            self.checkpoint(time.monotonic())
        return self.stats()

    def _sample(self, req: SampleRequest) -> _Message:
        try:
            out = self.buffer.sample(
                req.batch_size,
                rank=req.rank,
                agent_id=req.agent_id,
                agent_ids=req.agent_ids,
                model_id=req.model_id,
                min_policy_version=req.min_policy_version,
                trusted=self._peer_role() == "learner",
            )
        except (VersionOutOfRange, InvalidView, UnknownId) as e:  # counted by the buffer; nothing changed
            log.warning("sample request %d refused: %s", req.request_id, e)
            return ErrorReply(request_id=req.request_id, reason=e.reason, message=str(e))
        self.dirty = True  # evictions and version hints change state even when refused
        if isinstance(out, Refused):
            return ErrorReply(request_id=req.request_id, reason=out.reason, message=out.message)
        return SampleReply.carrying(  # the Arrow frame goes out as its own ZeroMQ frame, uncopied
            out.encode(), request_id=req.request_id, count=len(out.rows), weights=out.weights
        )

    def stats(self) -> BufferStats:
        lo, hi = self.buffer.policy_version_range()
        known = self.buffer.versions.listed(self.buffer.ids.models).items()
        versions = sorted((m, v) for m, v in known if 1 <= len(m) <= MAX_AGENT_ID_CHARS)  # nameable
        return BufferStats(
            size=self.buffer.size,
            per_agent=self.buffer.per_agent(),
            inserted=self.buffer.inserted,
            sampled=self.buffer.sampled,
            rejected=sum(self.buffer.rejected.values()),
            evicted=sum(self.buffer.evicted.values()),
            min_policy_version=lo,
            max_policy_version=hi,
            current_versions=dict(versions[:MAX_STATS_MODELS]),
        )

    # --- data ---------------------------------------------------------------------------------

    def _take_frame(self, frame: Frame, now: float) -> None:
        try:
            trajectories = decode_batches(frame.payload)
        except ProtocolError as e:  # foreign bytes: refuse for good, count, go on
            log.warning("refused frame %s/%d: %s: %s", frame.incarnation, frame.seq, e.reason, e)
            self.buffer.count_rejected(e.reason)
            self.receiver.reject(frame, e.reason)
            return
        try:
            res = self.buffer.insert(trajectories, source=(frame.incarnation, frame.seq), now=now)
        except (VersionOutOfRange, InvalidAgentId, UnknownId) as e:  # counted; refused, never stored
            log.warning("refused frame %s/%d: %s", frame.incarnation, frame.seq, e)
            self.receiver.reject(frame, e.reason)
            return
        if res.stale:
            log.info("frame %s/%d: %d stale trajectories dropped", frame.incarnation, frame.seq, res.stale)
        self.store.append(res.accepted)
        if not self.waiting:
            self.first_wait = now
        self.waiting.append(frame)
        self.dirty = True

    def checkpoint(self, now: float) -> None:
        self.store.checkpoint(self.buffer.state_dict(now), self.buffer.keys())
        if self.waiting:
            self.receiver.ack(*self.waiting)
            self.waiting = []
        self.dirty = False
        self.last_checkpoint = now

    def write_stats(self) -> None:
        GROUPS_PENDING.set(self.buffer.pending_groups)  # the queue depths: this and teamrl_buffer_size
        line = {
            "time": time.time(),
            "size": self.buffer.size,
            "inserted": self.buffer.inserted,
            "sampled": self.buffer.sampled,
            "rejected": dict(self.buffer.rejected),
            "evicted": sum(self.buffer.evicted.values()),
            "groups_pending": self.buffer.pending_groups,
            "max_policy_version": self.buffer.policy_version_range()[1],
            "producers_alive": sum(
                1 for p in self.producers.values() if time.time() - p["last_seen"] < PRODUCER_TIMEOUT_S
            ),
            "producers_seen": len(self.producers),
        }
        with open(self.cfg.dir / "stats.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    # --- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        def on_signal(signum: int, _frame: Any) -> None:
            log.info("%s received: stopping", signal.Signals(signum).name)
            self.stop_reason = signal.Signals(signum).name

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            while self.stop_reason is None:
                self.turn()
        finally:
            self.close()
        return 0

    def turn(self) -> None:
        """One pass over every duty of the loop."""
        cfg = self.cfg
        got = 0
        while got < MAX_FRAMES_PER_TURN and self.buffer.can_insert():
            frame = self.receiver.recv(0 if got else POLL_MS)
            if frame is None:
                break
            self._take_frame(frame, time.monotonic())
            got += 1
        self.buffer.count_duplicates(self.receiver.duplicates - self._dups_seen)
        self._dups_seen = self.receiver.duplicates
        for incarnation in self.receiver.take_evicted():
            self.buffer.forget_source(incarnation)
            self.producers.pop(incarnation, None)
            self.dirty = True

        served = 0
        while served < MAX_REQUESTS_PER_TURN and self.stop_reason is None:
            if not self.rpc.serve_once(0 if (got or served) else POLL_MS):
                break
            served += 1
        while self.stop_reason is None and self.admin.serve_once(0):
            pass

        now = time.monotonic()
        if self.buffer.expire_groups(now):
            self.dirty = True
        frames_due = self.waiting and (
            len(self.waiting) >= cfg.checkpoint_max_frames
            or now - self.first_wait >= cfg.checkpoint_interval_s
        )
        state_due = self.dirty and now - self.last_checkpoint >= cfg.checkpoint_interval_s
        if frames_due or state_due:
            self.checkpoint(now)
        if now - self.last_stats >= STATS_INTERVAL_S:
            self.write_stats()
            self.last_stats = now

    def close(self) -> None:
        self.checkpoint(time.monotonic())
        self.write_stats()
        time.sleep(ACK_FLUSH_S)
        self.receiver.close()
        self.rpc.close()
        self.admin.close()
        self.store.close()
        log.info(
            "buffer stopped (%s): %d held, %d inserted, %d sampled",
            self.stop_reason,
            self.buffer.size,
            self.buffer.inserted,
            self.buffer.sampled,
        )


# --------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="teamrl buffer",
        description="Run the replay buffer service: rollouts send trajectories to --bind (acked once "
        "durable), learner ranks sample from --sample-bind. State lives in --dir and survives kill -9.",
        epilog="Every other knob is a field of the [buffer] table (teamrl.learner.buffer_config.BufferConfig); "
        "flags override the file. " + TRANSPORT_EPILOG,
    )
    add_insecure_flag(p)
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        help="TOML file whose [buffer] table configures the buffer (none: defaults)",
    )
    p.add_argument(
        "--bind", metavar="ENDPOINT", help="data endpoint to bind, e.g. tcp://0.0.0.0:5555 (buffer.bind)"
    )
    p.add_argument(
        "--sample-bind",
        metavar="ENDPOINT",
        help="sample RPC endpoint to bind, e.g. tcp://0.0.0.0:5556 (buffer.sample_bind)",
    )
    p.add_argument(
        "--dir", metavar="DIR", help="folder for segments, checkpoints and stats.jsonl (buffer.dir)"
    )
    p.add_argument(
        "--metrics-port",
        metavar="N",
        type=int,
        help="Prometheus /metrics port, 0 = off (buffer.metrics_port)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def load_config(args: argparse.Namespace) -> BufferConfig:
    """The ``[buffer]`` table of ``--config`` (absent: defaults), then the flags; ConfigError if bad."""
    flags = {
        "bind": args.bind,
        "sample_bind": args.sample_bind,
        "dir": args.dir,
        "metrics_port": args.metrics_port,
    }
    return load_section(BufferConfig, args.config, "buffer", flags=flags, error=ConfigError)


def load_transport(args: argparse.Namespace) -> TransportConfig:
    """The ``[transport]`` table of ``--config`` (absent: defaults, CURVE off); ConfigError if bad."""
    return load_section(TransportConfig, args.config, "transport", flags={}, error=ConfigError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args)
        transport = load_transport(args)
        mode = transport_mode("teamrl buffer", transport, args.insecure)
    except ConfigError as e:
        print(f"teamrl buffer: {e}", file=sys.stderr)
        return 2
    except NoKeys as e:
        print(e, file=sys.stderr)
        return 2
    print(mode, file=sys.stderr, flush=True)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if cfg.metrics_port > 0:
        from prometheus_client import start_http_server

        start_http_server(cfg.metrics_port, addr=cfg.metrics_host)
    return BufferService(cfg, transport).run()


if __name__ == "__main__":
    sys.exit(main())
