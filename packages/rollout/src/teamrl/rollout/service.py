"""A rollout service: Flex-MG workflow episodes on vLLM, published to the replay buffer.

``teamrl rollout --buffer tcp://buffer:5555 --weights tcp://learner-0.learner:5557`` runs, in one
asyncio loop plus one sender thread::

    start        vLLM engine (RolloutEngine) up and warm, one per base (teamrl.rollout.bases); ask
                 the learner for its latest adapters
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
    heartbeat    Hello, then a Heartbeat every few seconds, to the buffer's RPC endpoint
                 (teamrl.rollout.heartbeat); never fatal
    SIGTERM      /readyz turns false, no new groups start; groups in flight get ``drain_timeout_s``
                 to finish, the rest are cancelled (a cancelled episode is never published, in part
                 or whole); the sender gets ``flush_timeout_s`` to send what is queued and have
                 it acked; exit 0, or 1 when frames were left un-acknowledged (logged, counted).

HTTP on ``--metrics-port``: /metrics (Prometheus), /healthz (the loop is alive), /readyz (a policy is
being served, the engine is up and the service is not draining).

Several base models (docs/architecture.md §3, "Rollout services"): a workflow whose agents run on
different base models (its ``[models]``) is served with one vLLM engine per base, each named in
``[rollout.models.<model id>]`` (folder, LoRA rank and targets, start version, weights endpoint) and
each following its own learner group's weights endpoint (``models.<id>.weights`` or, repeatable,
``--weights MODEL_ID=ENDPOINT``)::

    teamrl rollout --config rollout.toml --weights planner-model=tcp://learner-planner:5557 \
                   --weights solver-model=tcp://learner-solver:5557

An episode routes each agent to its base's engine, and each step records the version of its own
base's adapters. Held-out evaluations use the lowest live version over the bases (and list each);
LangMARL profile versions are taken from the first base's link only (the group of the first base of
``[rollout.models]`` runs the profile rounds). Without ``[rollout.models]`` the service runs one
engine from ``model`` and one ``--weights ENDPOINT``, as before; both cases run through one mapping
model id -> (engine, weights applier, endpoint, start version) (:func:`resolve_bases`).
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
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from teamrl.protocol.config import TransportConfig
from teamrl.protocol.configfile import ConfigError, load_section
from teamrl.rollout import metrics as M
from teamrl.rollout.bases import Bases, ServedBase
from teamrl.rollout.bases import engine_cpu_shares as engine_cpu_shares  # re-exported
from teamrl.rollout.evaluation import Evaluator
from teamrl.rollout.heartbeat import heartbeats

log = logging.getLogger("teamrl.rollout")


class RolloutConfigError(ConfigError):
    """The rollout config file or a flag is wrong; the message names the field."""


DEFAULT_WEIGHTS = "tcp://127.0.0.1:5557"  # --weights when not given (one base model)


class RolloutModel(BaseModel):
    """One base model of the workflow (``[rollout.models.<model id>]``): its own vLLM engine, which
    follows its own learner group's adapter versions (docs/architecture.md §3, "Rollout services")."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="model folder of this base (must hold config.json)")
    max_lora_rank: int = Field(8, ge=1, description="largest LoRA rank this base's engine accepts")
    lora_target_modules: list[str] = Field(
        default_factory=list,
        description="modules LoRA applies to on this base (its adapters' targets); empty = vLLM's default",
    )
    weights: str = Field(
        "",
        description="this base's learner weights PUB endpoint; empty = from `--weights MODEL_ID=ENDPOINT`",
    )
    start_version: int = Field(
        0, ge=0, description="generate only once this base's adapter version is live (a resumed run's)"
    )


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
    max_groups_per_version: int = Field(
        0,
        ge=0,
        description="start at most this many groups while no base's live adapter version changes (more "
        "would only be dropped as stale or evicted unread; teamrl run sets (max lag + 1) x the groups "
        "of a step x the ranks of a group); 0 = no limit",
    )
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
    models: dict[str, RolloutModel] = Field(
        default_factory=dict,
        description="one engine per base model of the workflow, by model id (its [models]); empty = one "
        "engine from model, max_lora_rank, lora_target_modules and start_version (set: those are unused)",
    )


def parse_weights_flags(flags: str | Sequence[str] | None) -> tuple[str | None, dict[str, str]]:
    """``--weights`` values: (one plain endpoint or None, ``{model_id: endpoint}``).

    Each value is ``ENDPOINT`` or ``MODEL_ID=ENDPOINT``; at most one plain endpoint, not mixed with
    ``MODEL_ID=`` ones, and no model id twice."""
    if flags is None:
        return None, {}
    plain: list[str] = []
    keyed: dict[str, str] = {}
    for item in [flags] if isinstance(flags, str) else list(flags):
        model_id, sep, endpoint = item.partition("=")
        if not sep or "://" in model_id:
            plain.append(item)
            continue
        if not model_id or not endpoint:
            raise RolloutConfigError(f"--weights {item!r}: expected ENDPOINT or MODEL_ID=ENDPOINT")
        if model_id in keyed:
            raise RolloutConfigError(f"--weights: model {model_id!r} given twice")
        keyed[model_id] = endpoint
    if len(plain) > 1 or (plain and keyed):
        raise RolloutConfigError(
            f"--weights {' '.join(plain)!s}: give one ENDPOINT (one base model), or one "
            "MODEL_ID=ENDPOINT per base model"
        )
    return (plain[0] if plain else None), keyed


def resolve_bases(cfg: RolloutConfig, weights: str | Sequence[str] | None = None) -> dict[str, ServedBase]:
    """The base models this service serves, ``{model_id: ServedBase}`` in ``[rollout.models]`` order.

    Without ``models``: one base keyed by the workflow's trained agents' model (or its only one), from
    ``model``, ``max_lora_rank``, ``lora_target_modules``, ``start_version`` and ``--weights``
    (default ``tcp://127.0.0.1:5557``). With ``models``: one per entry, the endpoint from
    ``--weights MODEL_ID=ENDPOINT`` (a flag overrides the file) or ``models.<id>.weights``, and
    ``model``, ``max_lora_rank``, ``lora_target_modules`` and ``start_version`` are not read. Raises
    RolloutConfigError, naming the model id and the field, before any engine starts: a model id
    that is not the workflow's, a workflow model an agent runs on with no engine, a base with
    trained agents and no weights endpoint, a ``path`` without config.json."""
    from teamrl.rollout.spec import WorkflowError
    from teamrl.rollout.workflows import load

    plain, keyed = parse_weights_flags(weights)
    try:
        wf = load(cfg.workflow)
    except WorkflowError as e:
        raise RolloutConfigError(f"workflow = {cfg.workflow!r}: {e}") from None
    if not cfg.models:
        return _one_base(cfg, wf, plain, keyed)
    return _several_bases(cfg, wf, plain, keyed)


def _agents_on(wf: Any, model_id: str) -> list[str]:
    return [a.id for a in wf.agents if a.model == model_id]


def _one_base(cfg: RolloutConfig, wf: Any, plain: str | None, keyed: dict[str, str]) -> dict[str, ServedBase]:
    """The one-engine case (no ``[rollout.models]``): every agent must run on the served model."""
    from teamrl.rollout.runner import served_model, trained_models, used_models

    used = used_models(wf)
    key = served_model(wf)
    if key is None:
        raise RolloutConfigError(
            f"workflow {wf.name!r} trains agents on base models {trained_models(wf) or used}, and model "
            "serves one: set [rollout.models.<model id>] (path, weights) for each of them"
        )
    missing = [m for m in used if m != key]
    if missing:
        m = missing[0]
        raise RolloutConfigError(
            f"workflow {wf.name!r} runs agents {_agents_on(wf, m)} on model {m!r}, which has no engine "
            f"here (model serves {key!r}): set [rollout.models.<model id>] (path, weights) for each"
        )
    for model_id in keyed:
        if model_id != key:
            raise RolloutConfigError(
                f"--weights {model_id}=...: {model_id!r} is not the base model this service runs ({key!r})"
            )
    endpoint = plain or keyed.get(key) or DEFAULT_WEIGHTS
    base = ServedBase(
        key, cfg.model, cfg.max_lora_rank, tuple(cfg.lora_target_modules), endpoint, cfg.start_version
    )
    return {key: base}


def _several_bases(
    cfg: RolloutConfig, wf: Any, plain: str | None, keyed: dict[str, str]
) -> dict[str, ServedBase]:
    """One engine per ``[rollout.models.<id>]``, each model id the workflow's, each agent's model
    served, each trained base with a weights endpoint and a model folder."""
    from teamrl.rollout.runner import trained_models, used_models

    for model_id in cfg.models:
        if model_id not in wf.models:
            raise RolloutConfigError(
                f"models.{model_id}: workflow {wf.name!r} has no model {model_id!r} "
                f"(its models: {sorted(wf.models)})"
            )
    for model_id in used_models(wf):
        if model_id not in cfg.models:
            raise RolloutConfigError(
                f"models.{model_id}: workflow {wf.name!r} runs agents {_agents_on(wf, model_id)} on model "
                f"{model_id!r}, which has no engine here: add [rollout.models.{model_id}] with its path"
            )
    for model_id in keyed:
        if model_id not in cfg.models:
            raise RolloutConfigError(
                f"--weights {model_id}=...: {model_id!r} is not a base model of [rollout.models] "
                f"({sorted(cfg.models)})"
            )
    if plain is not None and len(cfg.models) > 1:
        raise RolloutConfigError(
            f"--weights {plain}: this service runs {len(cfg.models)} base models ({sorted(cfg.models)}); "
            "give --weights MODEL_ID=ENDPOINT for each (or models.<model id>.weights)"
        )
    trained = trained_models(wf)
    bases: dict[str, ServedBase] = {}
    for model_id, m in cfg.models.items():
        endpoint = keyed.get(model_id) or plain or m.weights
        if not endpoint and model_id in trained:
            raise RolloutConfigError(
                f"models.{model_id}.weights: no weights endpoint for base {model_id!r} (agents "
                f"{_agents_on(wf, model_id)} train on it): set it, or --weights {model_id}=ENDPOINT"
            )
        if not endpoint and m.start_version:
            raise RolloutConfigError(
                f"models.{model_id}.start_version = {m.start_version}: base {model_id!r} follows no "
                "weights endpoint, so no version but 0 ever comes"
            )
        if not (Path(m.path) / "config.json").is_file():
            raise RolloutConfigError(
                f"models.{model_id}.path = {m.path!r}: no config.json there (not a model folder)"
            )
        bases[model_id] = ServedBase(
            model_id, m.path, m.max_lora_rank, tuple(m.lora_target_modules), endpoint, m.start_version
        )
    return bases


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

    @classmethod
    def serve(cls, host: str, port: int, svc: RolloutService) -> _Http:
        """Bound to ``host:port`` and serving from a daemon thread."""
        server = cls((host, port), svc)
        threading.Thread(target=server.serve_forever, name="teamrl-http", daemon=True).start()
        return server


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


class VersionBudget:
    """At most ``per_version`` groups started while the live adapter versions stay the same
    (AReaL's staleness control on the producer side): learners that are slow, restarting or done
    leave the rollout idle instead of flooding the buffer with data it will drop as stale or evict
    unread, which on shared cores also starves a restarting learner. Any base's new version refills
    it, so one learner group that is down does not stop the others' data. 0: no limit."""

    def __init__(self, per_version: int) -> None:
        self.per_version = per_version
        self.version: Any = None
        self.started = 0

    def take(self, version: Any) -> bool:
        """True (and counted) if one more group may start at ``version`` (the live versions)."""
        if version != self.version:
            self.version, self.started = version, 0
        if self.per_version and self.started >= self.per_version:
            M.WAITING_FOR_VERSION.set(1)
            return False
        M.WAITING_FOR_VERSION.set(0)
        self.started += 1
        return True


class RolloutService:
    """One rollout service. ``asyncio.run(RolloutService(cfg, ...).main())`` returns the exit code.

    ``weights``: the ``--weights`` values (one endpoint, or ``MODEL_ID=ENDPOINT`` ones; None = the
    default endpoint for one base). ``bases`` maps each base model id to its engine and weights
    applier (:func:`resolve_bases`, ``teamrl.rollout.bases``); ``engine`` and ``applier`` are the
    first base's. LangMARL profile versions are applied only from the first base's link: the
    learner group of the first base of ``[rollout.models]`` runs the profile rounds
    (docs/architecture.md §3)."""

    def __init__(
        self,
        cfg: RolloutConfig,
        *,
        buffer: str,
        weights: str | Sequence[str] | None = None,
        metrics_port: int = 0,
        metrics_host: str = "127.0.0.1",
        transport: TransportConfig | None = None,
    ) -> None:
        plans = resolve_bases(cfg, weights)  # config errors before anything starts
        self.cfg = cfg
        self.buffer = buffer
        self.transport = transport or TransportConfig()  # [transport]: CURVE on every link when on
        self.incarnation = f"rollout-{uuid.uuid4().hex[:12]}"
        self.stopping = False
        self.started = False
        self.last_tick = time.monotonic()
        self.groups_done = 0
        self.episodes_done = 0
        self.http = _Http.serve(metrics_host, metrics_port, self) if metrics_port > 0 else None
        self.sender = _Sender(
            buffer, self.incarnation, cfg.window, self.transport.client_curve("rollout", "buffer_data")
        )
        self.sender.flush_timeout_s = cfg.flush_timeout_s
        self.fatal = False  # an engine died: exit non-zero so a supervisor restarts the service
        self.replica, self.num_replicas, self.seed_offset = place_replica(cfg, self.incarnation)
        self.bases = Bases.build(plans, cfg.seed + self.seed_offset, cfg.keep_versions, cfg.kv_cache_bytes)
        self.runner = _workflow_runner(cfg, self.bases, self.incarnation)
        self.bases.attach_appliers(self.runner, cfg.adapter_dir)
        self.evaluator = Evaluator(cfg, self.runner, self.replica)

    @property
    def engine(self) -> Any:
        """The first base's engine (the only one without ``[rollout.models]``)."""
        return next(iter(self.bases.values())).engine

    @property
    def applier(self) -> Any:
        """The first base's weights applier."""
        return next(iter(self.bases.values())).applier

    def not_ready_reason(self) -> str:
        if not self.started:
            down = self.bases.down()
            return "engine starting" + (f" ({', '.join(down)})" if len(self.bases) > 1 else "")
        if self.stopping:
            return "draining"
        if not self.sender.connected.is_set():
            return "buffer link not up"
        return ""

    # --- weights (teamrl.rollout.weights) and evaluations (teamrl.rollout.evaluation) ----------

    def weights_loops(self) -> list[Any]:
        """One coroutine per followed base: its learner group's adapter versions (and, first base
        only, profile versions) applied to its engine; an evaluation is considered after each."""
        curve = self.transport.client_curve("rollout", "learner_weights")
        return [
            b.applier.follow(b.plan.weights, curve, lambda: self.stopping, self.maybe_evaluate)
            for b in self.bases.followed()
        ]

    async def weights_loop(self) -> None:
        """Every base's :meth:`weights_loops` until a stop."""
        await asyncio.gather(*self.weights_loops())

    async def maybe_evaluate(self, final: bool = False) -> None:
        """Evaluate (replica 0, every ``eval_interval`` versions) at the lowest live version over the
        followed bases, once each base's learner answered; "final" once every one of them announced
        its final version (``final``, one link's flag, is read from the appliers)."""
        followed = self.bases.followed()
        if not all(b.applier.answered for b in followed):
            return  # a restarted rollout evaluates the run's versions, not the base weights it starts on
        versions = {m: b.engine.version for m, b in self.bases.items()}
        low = self.live_version()
        final = bool(followed) and all(b.applier.final for b in followed)
        await self.evaluator.maybe_evaluate(low, final, versions)

    def live_version(self) -> int:
        """The lowest adapter version live over the bases that follow a learner (0: none yet)."""
        return self.bases.live_version()

    def live_versions(self) -> tuple[int, ...]:
        """The adapter version live on each base (in ``bases`` order)."""
        return self.bases.live_versions()

    # --- episodes -----------------------------------------------------------------------------

    async def run_group(self, task: dict, seeds: list[int], group_no: int) -> None:
        """The ``seeds`` episodes of ``task``, published as one frame once all finished (none of
        them when any fails); then counted, and maybe kept as the version's sample group."""
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
            self._group_failed(e, group_no, task)
            return
        finally:
            M.INFLIGHT.dec(len(seeds))
        _count_steps(trajs)
        await self.sender.put_bounded(
            encode_trajectories(list(trajs)), self.cfg.max_queued_frames, lambda: self.stopping
        )
        M.EPISODES.labels(self.cfg.workflow).inc(len(trajs))
        self.groups_done += 1
        self.episodes_done += len(trajs)
        self.evaluator.maybe_write_sample(list(trajs))

    def _group_failed(self, e: Exception, group_no: int, task: dict) -> None:
        """A dead engine (any base: vLLM cannot recover) stops the service with exit code 3, for a
        supervisor to restart it; any other failure is logged and generation goes on."""
        if type(e).__name__ == "EngineDeadError":
            if not self.fatal:
                log.error("a vLLM engine died (%s): draining and exiting with code 3", e)
            self.fatal = True
            self.request_stop("engine dead")
            return
        log.exception("group %d (task %s) failed: %s", group_no, task.get("id"), e)

    async def wait_for_version(self) -> None:
        """Generate nothing before every base's ``start_version`` is live on its engine (a resumed
        run's current weights): data sampled from older weights would only be dropped as stale.
        Says every few seconds what it waits for; a stop ends the wait."""
        t0, said = time.monotonic(), 0.0
        while not self.stopping:
            behind = self.bases.behind()
            if not behind:
                return
            waited = time.monotonic() - t0
            if waited - said >= 5.0:
                for plan in behind:
                    log.info(
                        "waiting for adapters v%d of %s from %s before generating (%.0f s)",
                        plan.start_version,
                        plan.model_id,
                        plan.weights,
                        waited,
                    )
                said = waited
            await asyncio.sleep(0.2)

    async def produce(self) -> None:
        """Start groups of this replica's tasks (shuffled anew each pass) while there is room in
        flight and the version budget allows, until a stop or ``max_groups``; then drain."""
        rng = random.Random(self.cfg.seed * 7919 + self.seed_offset)
        tasks = list(self.runner.train_tasks(self.replica, self.num_replicas))
        if not tasks:
            raise RolloutConfigError(f"replica {self.replica} of {self.cfg.num_replicas} has no tasks")
        order: list[dict] = []
        inflight: set[asyncio.Task] = set()
        counter = itertools.count()
        budget = VersionBudget(self.cfg.max_groups_per_version)
        try:
            while not self.stopping:
                self.last_tick = time.monotonic()
                if self.cfg.max_groups and self.groups_done + len(inflight) >= self.cfg.max_groups:
                    if not inflight:
                        break
                elif len(inflight) < self.cfg.groups_in_flight and budget.take(self.live_versions()):
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
            await _drain(inflight, self.cfg.drain_timeout_s)

    # --- side loops ---------------------------------------------------------------------------

    async def heartbeat_loop(self) -> None:
        """Hello, then Heartbeats, to the buffer's RPC endpoint (``teamrl.rollout.heartbeat``)."""
        from teamrl.protocol.zmq_transport import latest_endpoint_for

        await heartbeats(
            self.cfg.buffer_control or latest_endpoint_for(self.buffer),
            self.incarnation,
            ["arrow-v1", self.cfg.workflow],
            curve=self.transport.client_curve("rollout", "buffer_rpc"),
            interval_s=self.cfg.heartbeat_interval_s,
            load=self.sender.load,
            stopping=lambda: self.stopping,
        )

    async def throughput_loop(self) -> None:
        last, t_last = 0, time.monotonic()
        while not self.stopping:
            await asyncio.sleep(2.0)
            now, n = time.monotonic(), self.bases.tokens_generated()
            M.THROUGHPUT.set((n - last) / (now - t_last))
            last, t_last = n, now
            self.last_tick = now

    # --- life cycle ---------------------------------------------------------------------------

    async def main(self) -> int:
        """Start the engine, run the loops until a stop, drain; the exit code (3: engine dead, a
        supervisor restarts the service; 1: frames never acknowledged)."""
        from teamrl.protocol.children import start_reaper

        self._handle_signals()
        start_reaper()  # no vLLM process outlives this one, however it ends (SIGKILL included)
        await self.start()
        loops = self._start_loops()
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

    def _handle_signals(self) -> None:
        """SIGTERM and SIGINT request a stop (a drain), once the loop runs."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig.name)

    def _start_loops(self) -> list[asyncio.Task]:
        """The side loops as tasks: weights (one per followed base), throughput, heartbeat."""
        return [
            asyncio.create_task(c)
            for c in (*self.weights_loops(), self.throughput_loop(), self.heartbeat_loop())
        ]

    async def start(self) -> None:
        """The sender thread and the vLLM engines, one after the other (start-up and warm-up take
        most of the time); a failed start closes the engines already up."""
        self.sender.start()
        t0 = time.time()
        await self.bases.start()
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
            self.bases.weights_summary(),
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
        await self.bases.close()
        if self.http is not None:
            self.http.shutdown()

    def request_stop(self, why: str = "") -> None:
        if not self.stopping:
            log.info("%s: draining", why or "stop requested")
        self.stopping = True
        M.READY.set(0)


def place_replica(cfg: RolloutConfig, incarnation: str) -> tuple[int, int, int]:
    """Where this replica stands: (its index, the replicas sharing the tasks, its seed offset).

    A Deployment pod (name ends in a hash) has no index to shard by: every such pod takes the
    whole task set and seeds from its incarnation id, so pods never repeat each other."""
    ordinal = cfg.replica if cfg.replica >= 0 else _replica_from_env()
    if ordinal is not None:
        return ordinal, cfg.num_replicas, ordinal
    if cfg.num_replicas > 1:
        log.warning("POD_NAME has no ordinal: task sharding off, sampling seeded by incarnation")
    return 0, 1, int(incarnation.rsplit("-", 1)[-1], 16) % 2**31


def _workflow_runner(cfg: RolloutConfig, bases: Bases, incarnation: str) -> Any:
    """The workflow runner on the bases' engines (each agent routed to its base's engine)."""
    from teamrl.rollout.runner import WorkflowRunner

    return WorkflowRunner(
        cfg.workflow,
        {model_id: b.engine for model_id, b in bases.items()},
        incarnation,
        tasks=cfg.tasks,
        reward_kwargs={"role_scale": dict(cfg.reward_scale)} if cfg.reward_scale else None,
    )


def _count_steps(trajs: Sequence[Any]) -> None:
    """Steps, tokens and rewards of a published group, per agent (Prometheus)."""
    for t in trajs:
        for s in t.steps:
            M.STEPS.labels(s.agent_id).inc()
            M.TOKENS.labels(s.agent_id).inc(len(s.response_ids))
            M.REWARD.labels(s.agent_id).observe(float(s.reward))


async def _drain(inflight: set[asyncio.Task], timeout_s: float) -> None:
    """Groups in flight get ``timeout_s`` to finish; the rest are cancelled (never published)."""
    if not inflight:
        return
    log.info("draining: %d groups in flight get %.0f s", len(inflight), timeout_s)
    _done, pending = await asyncio.wait(inflight, timeout=timeout_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


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
        action="append",
        metavar="ENDPOINT | MODEL_ID=ENDPOINT",
        help="learner weights PUB endpoint; its 'latest' endpoint is the next port (default "
        f"{DEFAULT_WEIGHTS}). With [rollout.models] (one engine per base model), repeat "
        "MODEL_ID=ENDPOINT: each base's learner group's endpoint",
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
    ``teamrl model build`` makes (``teamrl run`` and the deploy's init container run it first).
    With ``[rollout.models]`` each base names its own folder (checked by :func:`resolve_bases`)
    and ``cfg`` is returned as it is."""
    if cfg.models:
        return cfg
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


def checked_config(args: argparse.Namespace) -> tuple[RolloutConfig, TransportConfig]:
    """The ``[rollout]`` and ``[transport]`` tables of ``--config`` with the flags, the model folder
    and the bases checked: every RolloutConfigError before logging starts."""
    cfg = load_config(args.config, args.set)
    transport = load_transport(args.config)
    cfg = with_model(cfg)
    resolve_bases(cfg, args.weights)  # the same check RolloutService makes
    return cfg, transport


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg, transport = checked_config(args)
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
