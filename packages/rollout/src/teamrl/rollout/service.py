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
being served, the engine is up and the service is not draining): ``teamrl.rollout.probe_server``.

The ``[rollout]`` table and the bases are ``teamrl.rollout.config``; the sender thread
``teamrl.rollout.sender``; the command line
``teamrl.rollout.cli``. Several base models (``[rollout.models]``): one engine per base, each
following its own learner group's weights endpoint (``teamrl.rollout.config``, docs/architecture.md §3).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import signal
import time
import uuid
from collections.abc import Sequence
from typing import Any

from teamrl.protocol.config import TransportConfig
from teamrl.protocol.timeline import Timeline
from teamrl.rollout import metrics as M
from teamrl.rollout.bases import Bases
from teamrl.rollout.config import RolloutConfig, RolloutConfigError, resolve_bases
from teamrl.rollout.evaluation import Evaluator
from teamrl.rollout.heartbeat import heartbeats
from teamrl.rollout.probe_server import ProbeServer
from teamrl.rollout.runner import WorkflowRunner
from teamrl.rollout.sender import Sender

log = logging.getLogger("teamrl.rollout")


def failure_exit_code(e: BaseException) -> tuple[int, str]:
    """(exit code, reason) of an episode failure that every later episode would meet too, else (0, ""):
    a dead vLLM engine (it cannot recover; 3: a supervisor restarts the service), or a request vLLM
    refuses as invalid (a sampling setting out of its range: 2, the code of a config error, which
    `teamrl run` does not restart: docs/reliability.md). Failures of one episode (a reward, a tool)
    return 0: the service logs them, counts the group abandoned and goes on."""
    name = type(e).__name__
    if name == "EngineDeadError":
        return 3, "a vLLM engine died"
    if name == "VLLMValidationError":
        return 2, "vLLM refuses the workflow's requests (a config error: no restart can fix it)"
    return 0, ""


class VersionBudget:
    """AReaL's staleness control on the producer side: the rollout stays at most ``per_version``
    groups ahead of the learner. It may start that many; each version a learner advanced (with
    several bases, the one that advanced most) lets ``refill`` more start, up to ``per_version``
    unstarted at a time. With ``refill`` one learner step's groups, production follows consumption:
    a rollout faster than the learner waits (``budget_wait``) instead of making data the buffer
    drops as stale or evicts unread (measured: 45 % of the episodes of an async addition-duo run at
    max lag 2 when every version refilled the whole budget; docs/running.md). Slow, restarting or
    finished learners leave the rollout idle; any base's new version refills, so one learner group
    that is down does not stop the others' data. A learner that died lost the batch it was training
    on, and with it one step of the rollout's lead: each restart seen (``restarts``, counted by the
    weights links) grants one refill more, or the learner would wait for every step's data from then
    on (measured: steps of 120-140 s instead of 45-70 s after one restart; docs/reliability.md
    R-restart-lead).
    ``refill = 0``: every new version refills the whole budget. ``per_version = 0``: no limit."""

    def __init__(self, per_version: int, refill: int = 0) -> None:
        self.per_version, self.refill = per_version, refill
        self.version: Any = None
        self.tokens = per_version  # groups that may start now
        self.refused = False  # the last take was refused: new groups wait for a new version
        self.restarts = 0  # learner restarts already refilled for

    def take(self, version: Any, restarts: int = 0) -> bool:
        """True (and counted) if one more group may start at ``version`` (the live versions);
        ``restarts``: learner restarts seen so far (each refills once)."""
        if restarts > self.restarts:
            grant = (restarts - self.restarts) * (self.refill or self.per_version)
            self.tokens, self.restarts = min(self.per_version, self.tokens + grant), restarts
        if version != self.version:
            if self.version is not None:
                grant = self.refill * _advanced(self.version, version) if self.refill else self.per_version
                self.tokens = min(self.per_version, self.tokens + grant)
            self.version = version
        self.refused = bool(self.per_version and self.tokens <= 0)
        M.WAITING_FOR_VERSION.set(int(self.refused))
        self.tokens -= not self.refused
        return not self.refused


def _advanced(old: Any, new: Any) -> int:
    """Steps gone by from ``old`` to ``new`` (ints, or tuples of one int per base: the base that
    advanced most, as every learner group trains on the same episodes); at least 1."""
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        return max([1, *(int(n) - int(o) for o, n in zip(old, new, strict=True))])
    if isinstance(old, int) and isinstance(new, int):
        return max(1, new - old)
    return 1


class RolloutLane:
    """A rollout's lane of the run's timeline (teamrl.protocol.timeline), said by the produce loop:
    ``generating`` while any group generates, ``sending`` while finished groups wait for room in the
    send queue (the buffer is behind), ``budget_wait`` while the version budget holds new groups
    back (the learner is behind), ``weights_wait`` before the first weights, ``idle`` otherwise."""

    def __init__(self, replica: int) -> None:
        self.timeline = Timeline.from_env("rollout", str(replica))
        self.timeline.enter("setup")

    def update(self, inflight: int, blocked: int, budget: VersionBudget) -> None:
        if inflight > blocked:
            self.timeline.enter("generating")
        else:
            self.timeline.enter("sending" if blocked else "budget_wait" if budget.refused else "idle")


class RolloutService:
    """One rollout service. ``asyncio.run(RolloutService(cfg, ...).main())`` returns the exit code.

    ``weights``: the ``--weights`` values (one endpoint, or ``MODEL_ID=ENDPOINT`` ones; None = the default
    endpoint for one base). ``bases`` maps each base model id to its engine and weights applier
    (:func:`resolve_bases`, ``teamrl.rollout.bases``); ``engine`` and ``applier`` are the first base's.
    LangMARL profile versions are applied only from the first base's link: the learner group of the
    first base of ``[rollout.models]`` runs the profile rounds (docs/architecture.md §3)."""

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
        self.http = ProbeServer.serve(metrics_host, metrics_port, self) if metrics_port > 0 else None
        self.sender = Sender(
            buffer, self.incarnation, cfg.window, self.transport.client_curve("rollout", "buffer_data")
        )
        self.sender.flush_timeout_s = cfg.flush_timeout_s
        self.fatal = 0  # the exit code a failure no episode can survive asks for (failure_exit_code)
        self.replica, self.num_replicas, self.seed_offset = place_replica(cfg, self.incarnation)
        self.bases = Bases.build(
            plans, cfg.seed + self.seed_offset, cfg.keep_versions, cfg.kv_cache_bytes, cfg.dtype
        )
        self.runner = WorkflowRunner.for_rollout(cfg, self.bases, self.incarnation)
        self.bases.attach_appliers(self.runner, cfg.adapter_dir)
        self.evaluator = Evaluator(cfg, self.runner, self.replica)
        self.lane = RolloutLane(self.replica)

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

    def budget_view(self) -> tuple[tuple[int, ...], int]:
        """What the version budget reads: the live versions and the learner restarts seen."""
        return self.bases.live_versions(), self.bases.learner_restarts()

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
        """A failure every episode meets (:func:`failure_exit_code`) drains the service; others are logged."""
        rc, why = failure_exit_code(e)
        if rc:
            if not self.fatal:
                log.error("%s (%s): draining and exiting with code %d", why, e, rc)
            self.fatal = rc
            self.request_stop(why)
            return
        log.exception("group %d (task %s) failed: %s", group_no, task.get("id"), e)

    async def wait_for_version(self) -> None:
        """Generate nothing before every base's ``start_version`` is live on its engine (a resumed
        run's current weights): data sampled from older weights would only be dropped as stale.
        Says every few seconds what it waits for; a stop ends the wait."""
        self.lane.timeline.enter("weights_wait")
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
        budget = VersionBudget(self.cfg.max_groups_per_version, self.cfg.groups_per_version)
        try:
            while not self.stopping:
                self.last_tick = time.monotonic()
                if self.cfg.max_groups and self.groups_done + len(inflight) >= self.cfg.max_groups:
                    if not inflight:
                        break
                elif len(inflight) < self.cfg.groups_in_flight and budget.take(*self.budget_view()):
                    if not order:
                        order = tasks[:]
                        rng.shuffle(order)
                    task = order.pop()
                    seeds = [rng.randrange(2**31) for _ in range(self.cfg.group_size)]
                    t = asyncio.create_task(self.run_group(task, seeds, next(counter)))
                    inflight.add(t)
                    t.add_done_callback(inflight.discard)
                    continue
                self.lane.update(len(inflight), self.sender.blocked, budget)
                await asyncio.sleep(0.02)
        finally:
            await _drain(inflight, self.cfg.drain_timeout_s)
            self.lane.timeline.close()

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
            return self.fatal
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
