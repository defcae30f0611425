"""A rollout service: Flex-MG workflow episodes on vLLM, published to the replay buffer.

``teamrl rollout --buffer tcp://buffer:5555 --weights tcp://learner-0.learner:5557`` runs, in one
asyncio loop plus one sender thread::

    start        vLLM engine (RolloutEngine) up and warm; ask the learner for its latest adapters
    weights      (teamrl.rollout.weights) WeightsPublished (PUB, gaps healed through the "latest"
                 endpoint) -> payload (inline chunks or the shared folder) -> sha256 check -> safe
                 unpack -> vLLM load as <adapter>@v<version> -> probe verification; only then do
                 new requests use it.
                 A refusal (checksum, corrupt, missing, load_failed, probe_failed, stale_version,
                 bad_rank, bad_targets) is logged and counted; generation goes on with the last good one.
    episodes     groups of ``group_size`` episodes of one task, ``groups_in_flight`` groups at once
                 (vLLM batches their requests); tasks from this replica's shard of the data set.
                 A finished group is one Arrow frame handed to the sender thread.
    replica 0    held-out evaluations and a sample group per version (teamrl.rollout.evaluation)
    sender       the thread that owns the ZeroMQ DEALER (credit window, acks, resend after reconnect)
    SIGTERM      /readyz turns false, no new groups start; groups in flight get ``drain_timeout_s``
                 to finish, the rest are cancelled (a cancelled episode is never published, in part
                 or whole); the sender gets ``flush_timeout_s`` to send what is queued and have
                 it acked; exit 0, or 1 when frames were left un-acknowledged (logged, counted).

HTTP on ``--metrics-port``: /metrics (Prometheus), /healthz (the loop is alive), /readyz (a policy is
being served, the engine is up and the service is not draining).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.server
import itertools
import logging
import os
import queue
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from teamrl.protocol.config import TransportConfig
from teamrl.protocol.configfile import ConfigError, load_section
from teamrl.rollout import metrics as M
from teamrl.rollout.evaluation import Evaluator
from teamrl.rollout.weights import WeightsApplier

log = logging.getLogger("teamrl.rollout")


class RolloutConfigError(ConfigError):
    """The rollout config file or a flag is wrong; the message names the field."""


class RolloutConfig(BaseModel):
    """The ``[rollout]`` table. Flags of ``teamrl rollout`` override the file."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        "", description="model folder; empty = the embedded model (`teamrl model build` makes it)"
    )
    workflow: str = Field(
        min_length=1,
        description="workflow name (`teamrl workflow list`) or TOML file, as `teamrl run --workflow`",
    )
    tasks: str = Field("", description="JSONL or Parquet task file; empty = the workflow's training split")
    group_size: int = Field(8, ge=1, description="episodes per task (the group of a group baseline)")
    groups_in_flight: int = Field(16, ge=1, description="groups generated concurrently")
    max_groups: int = Field(0, ge=0, description="stop after this many groups (0 = run until stopped)")
    replica: int = Field(-1, ge=-1, description="this replica's index for task sharding (-1: from POD_NAME)")
    num_replicas: int = Field(1, ge=1, description="replicas sharing the task set")
    seed: int = Field(0, description="seeds task order and sampling")
    window: int = Field(16, ge=1, description="frames in flight to the buffer before sending blocks")
    max_queued_frames: int = Field(
        32, ge=1, description="finished groups waiting to be sent before generation waits (backpressure)"
    )
    drain_timeout_s: float = Field(30.0, ge=0, description="time groups in flight get to finish on SIGTERM")
    flush_timeout_s: float = Field(
        30.0,
        ge=0,
        description="on exit, time to send what is queued and have it acked (queue included)",
    )
    max_lora_rank: int = Field(8, ge=1, description="largest LoRA rank the engine accepts")
    lora_target_modules: list[str] = Field(
        default_factory=list,
        description="modules LoRA applies to (the adapters' targets); empty = vLLM's default",
    )
    keep_versions: int = Field(2, ge=1, description="adapter versions kept loaded")
    kv_cache_bytes: int = Field(256 * 1024 * 1024, ge=1, description="vLLM CPU KV cache size")
    adapter_dir: str = Field("", description="where received adapters are unpacked; empty = a temp folder")
    eval_interval: int = Field(0, ge=0, description="replica 0: evaluate held-out tasks every N versions")
    eval_tasks: int = Field(200, ge=1, description="held-out tasks per evaluation")
    start_version: int = Field(
        0, ge=0, description="generate only once this adapter version is live (a resumed run's current one)"
    )
    eval_file: str = Field("", description="replica 0 appends evaluations here (JSONL)")
    samples_dir: str = Field("", description="replica 0 writes a sample group per new version here")
    buffer_control: str = Field(
        "", description="buffer RPC endpoint for Hello / Heartbeat; empty = the data endpoint's port + 1"
    )
    heartbeat_interval_s: float = Field(5.0, gt=0, description="seconds between heartbeats to the buffer")
    reward_scale: dict[str, float] = Field(
        default_factory=dict, description="multiply a role's training step reward, e.g. {verifier = 10.0}"
    )


# --------------------------------------------------------------------------------------------
# the sender thread


class _Sender(threading.Thread):
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

    def put(self, payload: bytes) -> None:
        self.q.put(payload)
        M.PUBLISH_QUEUE.set(self.q.qsize() + self.unacked)

    async def put_bounded(self, payload: bytes, max_queued: int, stopping: Any) -> None:
        """Queue a frame once fewer than ``max_queued`` wait to be sent (backpressure: the group that
        finished waits, so no new group starts while the buffer cannot keep up). On stop it queues at
        once: the exit flush sends or counts it."""
        while self.q.qsize() >= max_queued and not stopping() and self.is_alive():
            await asyncio.sleep(0.05)
        self.put(payload)


# --------------------------------------------------------------------------------------------
# HTTP: /metrics /healthz /readyz


class _Http(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], svc: RolloutService) -> None:
        self.svc = svc
        super().__init__(addr, _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Http
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


# --------------------------------------------------------------------------------------------
# the service


class RolloutService:
    """One rollout service. ``asyncio.run(RolloutService(cfg, ...).main())`` returns the exit code."""

    def __init__(
        self,
        cfg: RolloutConfig,
        *,
        buffer: str,
        weights: str,
        metrics_port: int = 0,
        metrics_host: str = "127.0.0.1",
        transport: TransportConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.buffer = buffer
        self.weights = weights
        self.transport = transport or TransportConfig()  # [transport]: CURVE on every link when on
        self.incarnation = f"rollout-{uuid.uuid4().hex[:12]}"
        self.stopping = False
        self.started = False
        self.last_tick = time.monotonic()
        self.groups_done = 0
        self.episodes_done = 0
        self.http: _Http | None = None
        if metrics_port > 0:
            self.http = _Http((metrics_host, metrics_port), self)
            threading.Thread(target=self.http.serve_forever, name="teamrl-http", daemon=True).start()
        self.sender = _Sender(
            buffer, self.incarnation, cfg.window, self.transport.client_curve("rollout", "buffer_data")
        )
        self.sender.flush_timeout_s = cfg.flush_timeout_s
        self.fatal = False  # the engine died: exit non-zero so a supervisor restarts the service
        self._place_replica()
        self._build_engine()
        self.applier = WeightsApplier(
            self.engine, self.runner, Path(cfg.adapter_dir or tempfile.mkdtemp(prefix="teamrl-adapters-"))
        )
        self.evaluator = Evaluator(cfg, self.runner, self.replica)

    def _place_replica(self) -> None:
        """Where this replica stands: its shard of the tasks and its sampling seeds."""
        cfg = self.cfg
        ordinal = cfg.replica if cfg.replica >= 0 else _replica_from_env()
        self.replica, self.num_replicas, self.seed_offset = ordinal or 0, cfg.num_replicas, ordinal or 0
        if ordinal is None:
            # A Deployment pod (name ends in a hash): no index to shard by. Every pod takes the
            # whole task set and seeds from its incarnation id, so pods never repeat each other.
            self.num_replicas = 1
            self.seed_offset = int(self.incarnation.rsplit("-", 1)[-1], 16) % 2**31
            if cfg.num_replicas > 1:
                log.warning("POD_NAME has no ordinal: task sharding off, sampling seeded by incarnation")

    def _build_engine(self) -> None:
        """The engine (started by ``start``) and the workflow runner on it."""
        from teamrl.rollout.engine import EngineConfig, RolloutEngine
        from teamrl.rollout.runner import WorkflowRunner

        cfg = self.cfg
        self.engine = RolloutEngine(
            EngineConfig(
                model=cfg.model,  # set by with_model(): the embedded model's folder when the config has none
                seed=cfg.seed + self.seed_offset,
                max_lora_rank=cfg.max_lora_rank,
                lora_target_modules=tuple(cfg.lora_target_modules),
                keep_versions=cfg.keep_versions,
                kv_cache_bytes=cfg.kv_cache_bytes,
            )
        )
        self.runner = WorkflowRunner(
            cfg.workflow,
            self.engine,
            self.incarnation,
            tasks=cfg.tasks,
            reward_kwargs={"role_scale": dict(cfg.reward_scale)} if cfg.reward_scale else None,
        )

    def not_ready_reason(self) -> str:
        if not self.started:
            return "engine starting"
        if self.stopping:
            return "draining"
        if not self.sender.connected.is_set():
            return "buffer link not up"
        return ""

    # --- weights (teamrl.rollout.weights) and evaluations (teamrl.rollout.evaluation) ----------

    async def weights_loop(self) -> None:
        """Follow the learner's adapter and profile versions; evaluate after each one."""
        await self.applier.follow(
            self.weights,
            self.transport.client_curve("rollout", "learner_weights"),
            lambda: self.stopping,
            self.maybe_evaluate,
        )

    async def maybe_evaluate(self, final: bool = False) -> None:
        await self.evaluator.maybe_evaluate(self.engine.version, final)

    # --- episodes -----------------------------------------------------------------------------

    async def run_group(self, task: dict, seeds: list[int], group_no: int) -> None:
        from teamrl.protocol.codec import encode_trajectories

        M.INFLIGHT.inc(len(seeds))
        try:
            trajs = await asyncio.gather(
                *[
                    self.runner.episode(task, seed, group_id=f"{self.incarnation}-{group_no}", seq=0)
                    for seed in seeds
                ]
            )
        except asyncio.CancelledError:
            M.ABANDONED.labels("drain").inc(len(seeds))
            raise
        except Exception as e:  # a broken episode must not stop the service; nothing partial goes out
            M.ABANDONED.labels("error").inc(len(seeds))
            if type(e).__name__ == "EngineDeadError":  # vLLM cannot recover: exit, get restarted
                if not self.fatal:
                    log.error("vLLM engine died (%s): draining and exiting with code 3", e)
                self.fatal = True
                self.request_stop("engine dead")
                return
            log.exception("group %d (task %s) failed: %s", group_no, task.get("id"), e)
            return
        finally:
            M.INFLIGHT.dec(len(seeds))
        for t in trajs:
            for s in t.steps:
                M.STEPS.labels(s.agent_id).inc()
                M.TOKENS.labels(s.agent_id).inc(len(s.response_ids))
                M.REWARD.labels(s.agent_id).observe(float(s.reward))
        await self.sender.put_bounded(
            encode_trajectories(list(trajs)), self.cfg.max_queued_frames, lambda: self.stopping
        )
        M.EPISODES.labels(self.cfg.workflow).inc(len(trajs))
        self.groups_done += 1
        self.episodes_done += len(trajs)
        self.evaluator.maybe_write_sample(list(trajs))

    async def wait_for_version(self) -> None:
        """Generate nothing before ``start_version`` is live (a resumed run's current weights): data
        sampled from older weights would only be dropped as stale. Says every few seconds what it
        waits for; a stop ends the wait."""
        want, t0, said = self.cfg.start_version, time.monotonic(), 0.0
        while self.engine.version < want and not self.stopping:
            waited = time.monotonic() - t0
            if waited - said >= 5.0:
                log.info(
                    "waiting for adapters v%d from %s before generating (%.0f s)", want, self.weights, waited
                )
                said = waited
            await asyncio.sleep(0.2)

    async def produce(self) -> None:
        rng = random.Random(self.cfg.seed * 7919 + self.seed_offset)
        tasks = list(self.runner.train_tasks(self.replica, self.num_replicas))
        if not tasks:
            raise RolloutConfigError(f"replica {self.replica} of {self.cfg.num_replicas} has no tasks")
        order: list[dict] = []
        inflight: set[asyncio.Task] = set()
        counter = itertools.count()
        try:
            while not self.stopping:
                self.last_tick = time.monotonic()
                if self.cfg.max_groups and self.groups_done + len(inflight) >= self.cfg.max_groups:
                    if not inflight:
                        break
                elif len(inflight) < self.cfg.groups_in_flight:
                    if not order:
                        order = tasks[:]
                        rng.shuffle(order)
                    task = order.pop()
                    seeds = [rng.randrange(2**31) for _ in range(self.cfg.group_size)]
                    t = asyncio.create_task(self.run_group(task, seeds, next(counter)))
                    inflight.add(t)
                    t.add_done_callback(inflight.discard)
                    continue
                await asyncio.sleep(0.02)
        finally:
            if inflight:
                log.info("draining: %d groups in flight get %.0f s", len(inflight), self.cfg.drain_timeout_s)
                _done, pending = await asyncio.wait(inflight, timeout=self.cfg.drain_timeout_s)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    async def heartbeat_loop(self) -> None:
        """Hello once (who I am), then a Heartbeat every interval, to the buffer's RPC endpoint.

        The data path never depends on this: a buffer that does not answer is logged, not fatal."""
        from teamrl.protocol.control import Heartbeat, Hello
        from teamrl.protocol.errors import PeerTimeout
        from teamrl.protocol.zmq_transport import RpcClient, latest_endpoint_for

        endpoint = self.cfg.buffer_control or latest_endpoint_for(self.buffer)
        rpc = RpcClient(endpoint, timeout_ms=2000, curve=self.transport.client_curve("rollout", "buffer_rpc"))
        hello = Hello(
            service="rollout", incarnation=self.incarnation, capabilities=["arrow-v1", self.cfg.workflow]
        )
        said_hello, beat = False, 0
        last_answer = time.monotonic()
        try:
            while not self.stopping:
                msg = (
                    hello
                    if not said_hello
                    else Heartbeat(
                        incarnation=self.incarnation,
                        seq=beat,
                        time=time.time(),
                        load=min(
                            1.0, (self.sender.q.qsize() + self.sender.unacked) / max(1, self.cfg.window)
                        ),
                    )
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
                await asyncio.sleep(self.cfg.heartbeat_interval_s if said_hello else 1.0)
        finally:
            rpc.close()

    async def throughput_loop(self) -> None:
        last, t_last = 0, time.monotonic()
        while not self.stopping:
            await asyncio.sleep(2.0)
            now, n = time.monotonic(), self.engine.tokens_generated
            M.THROUGHPUT.set((n - last) / (now - t_last))
            last, t_last = n, now
            self.last_tick = now

    async def main(self) -> int:
        """Start the engine, run the loops until a stop, drain; the exit code (3: engine dead, a
        supervisor restarts the service; 1: frames never acknowledged)."""
        from teamrl.protocol.children import start_reaper

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig.name)
        start_reaper()  # no vLLM process outlives this one, however it ends (SIGKILL included)
        await self.start()
        loops = [
            asyncio.create_task(c)
            for c in (self.weights_loop(), self.throughput_loop(), self.heartbeat_loop())
        ]
        try:
            await self.wait_for_version()
            await self.produce()
        finally:
            await self.shutdown(loops)
        log.info(
            "rollout stopped: %d groups, %d episodes published; %d frames un-acknowledged",
            self.groups_done,
            self.episodes_done,
            self.sender.lost,
        )
        if self.fatal:
            return 3
        return 0 if self.sender.lost == 0 else 1

    async def start(self) -> None:
        """The sender thread and the vLLM engine (its start-up and warm-up take most of the time)."""
        self.sender.start()
        t0 = time.time()
        await self.engine.start()
        self.started = True
        M.READY.set(1)
        log.info(
            "rollout %s up in %.0f s: replica %d/%d, workflow %s, buffer %s, weights %s",
            self.incarnation,
            time.time() - t0,
            self.replica,
            self.num_replicas,
            self.cfg.workflow,
            self.buffer,
            self.weights,
        )

    async def shutdown(self, loops: list[asyncio.Task]) -> None:
        """Stop the loops, let the sender flush (acks), close the engine and the HTTP endpoint."""
        self.stopping = True
        M.READY.set(0)
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        self.sender.stop_event.set()
        await asyncio.to_thread(self.sender.join)
        await self.engine.close()
        if self.http is not None:
            self.http.shutdown()

    def request_stop(self, why: str = "") -> None:
        if not self.stopping:
            log.info("%s: draining", why or "stop requested")
        self.stopping = True
        M.READY.set(0)


def _replica_from_env() -> int | None:
    """The StatefulSet ordinal in POD_NAME (``rollout-3`` -> 3); None when there is none."""
    tail = os.environ.get("POD_NAME", "").rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


# --------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="teamrl rollout",
        description="Run one rollout service: multi-agent workflow episodes on vLLM with per-agent LoRA "
        "adapters, published as Arrow graph trajectories over ZeroMQ to the replay buffer; adapter "
        "versions from the learner are verified before use. SIGTERM drains without losing data.",
        epilog="Every knob is a field of the [rollout] table (teamrl.rollout.service.RolloutConfig), "
        "settable with --set KEY=VALUE.",
    )
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with a [rollout] table")
    p.add_argument(
        "--set", metavar="KEY=VALUE", action="append", default=[], help="override a [rollout] field"
    )
    p.add_argument(
        "--buffer", default="tcp://127.0.0.1:5555", help="buffer data endpoint (default %(default)s)"
    )
    p.add_argument(
        "--weights",
        default="tcp://127.0.0.1:5557",
        help="learner weights PUB endpoint; its 'latest' endpoint is the next port (default %(default)s)",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics /healthz /readyz port, 0 = off")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def load_config(path: str | None, overrides: list[str]) -> RolloutConfig:
    """The ``[rollout]`` table of ``path`` (none: defaults) plus ``--set`` overrides."""
    return load_section(RolloutConfig, path, "rollout", overrides, error=RolloutConfigError)


def load_transport(path: str | None) -> TransportConfig:
    """The ``[transport]`` table of ``path`` (none: defaults, CURVE off), the table the buffer and
    learner read too (README, "Security"). With CURVE on, the rollout's keys are read here, so a
    missing key fails before the engine starts."""
    from teamrl.protocol.curve import CurveKeyError

    transport = load_section(TransportConfig, path, "transport", flags={}, error=RolloutConfigError)
    try:
        for socket in ("buffer_data", "buffer_rpc", "learner_weights"):
            transport.client_curve("rollout", socket)
    except (CurveKeyError, OSError, ValueError) as e:
        raise RolloutConfigError(f"{path} [transport]: {e}") from None
    return transport


def with_model(cfg: RolloutConfig) -> RolloutConfig:
    """``cfg`` with a model folder that exists: its own, else the embedded model's, which
    ``teamrl model build`` makes (``teamrl run`` and the deploy's init container run it first)."""
    if cfg.model:
        if not (Path(cfg.model) / "config.json").is_file():
            raise RolloutConfigError(f"model = {cfg.model!r}: no config.json there (not a model folder)")
        return cfg
    from teamrl.rewards.addition import embedded_model_dir

    default = embedded_model_dir()
    if not (default / "config.json").is_file():
        raise RolloutConfigError(
            f"no model given and the embedded model is not built at {default}: run `teamrl model build` "
            "first, or set model = DIR"
        )
    return cfg.model_copy(update={"model": str(default)})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        transport = load_transport(args.config)
        cfg = with_model(cfg)
    except RolloutConfigError as e:
        print(f"teamrl rollout: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    svc = RolloutService(
        cfg,
        buffer=args.buffer,
        weights=args.weights,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        transport=transport,
    )
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(svc.main())
    return 0


if __name__ == "__main__":
    sys.exit(main())
