"""A learner rank as a service: sample from the replay buffer, update, publish adapters, checkpoint.

``teamrl learner --buffer tcp://buffer:5556 --publish tcp://0.0.0.0:5557 --run-dir DIR`` runs::

    resume         DIR/checkpoints/step-N with a DONE marker -> load it (DeepSpeed state of every
                   adapter engine, RNG states), continue at step N with version V (never backwards;
                   teamrl.learner.resume)
    every step     SampleRequest (rank, min_policy_version = version - lag) until batch_size
                   trajectories arrived (whole groups; refusals are waited out and counted)
                   -> LearnerEngine.train_step (advantages, objective, agent-by-agent update)
                   -> version + 1 -> export the LoRA adapters (PEFT safetensors) to DIR/adapters/vV
                   -> VersionAnnounce to the buffer (its only source of versions: docs/security.md)
                   -> WeightsPublished (inline chunks or the folder URI, sha256 of the payload, a
                   probe: prompt, completion, and this learner's log-probs of it) on PUB + "latest"
                   (teamrl.learner.publish)
                   -> a JSON line in DIR/metrics.jsonl, Prometheus metrics
    every k steps  checkpoint (all ranks), then the DONE marker (rank 0); older ones pruned
    SIGTERM        finish the step in progress, checkpoint, exit 0

Ranks: ``RANK``/``WORLD_SIZE`` (``deepspeed`` launcher, torchrun, or a StatefulSet) make several
ranks; each asks the buffer for its own samples under its rank id (the buffer never hands two ranks
the same group), DeepSpeed averages their gradients, and only rank 0 exports, publishes and writes
metrics. Every rank keeps the same step and version counters.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from teamrl.learner import metrics as M
from teamrl.learner.config import LearnerConfig, LearnerConfigError, load_learner_config

# BF16_EPS and probe_atol are re-exported: tests and benches import them from here
from teamrl.learner.publish import BF16_EPS, AdapterPublisher, announce_version, probe_atol  # noqa: F401
from teamrl.learner.resume import RunCheckpoints
from teamrl.learner.settings import EngineSettings
from teamrl.learner.step_metrics import gauge_step, observe_lags, sample_row
from teamrl.protocol.config import (
    TRANSPORT_EPILOG,
    NoKeys,
    TransportConfig,
    add_insecure_flag,
    transport_mode,
)
from teamrl.protocol.timeline import Timeline

log = logging.getLogger("teamrl.learner")

SAMPLE_POLL_S = 0.05


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a CUDA device, else ``cpu``; ``cpu``/``cuda`` unchanged."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def drop_rows_from(path: Path, step: int) -> int:
    """Rewrite a metrics JSONL without the rows of ``step`` and later (a resumed learner redoes
    them); atomic (temp file + rename). Returns the rows dropped; a missing file drops nothing."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line).get("step", -1)
        except (json.JSONDecodeError, AttributeError):
            row_step = -1  # a torn last line from a kill: dropped with the redone steps
            dropped += 1
            continue
        if isinstance(row_step, int) and row_step >= step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(x + "\n" for x in kept))
        os.replace(tmp, path)
        log.info(
            "metrics.jsonl: dropped %d row(s) from step %d on (they are redone after the resume)",
            dropped,
            step,
        )
    return dropped


class LearnerService:
    """One learner rank. ``LearnerService(cfg, ...).run()`` returns the exit code."""

    def __init__(
        self,
        cfg: LearnerConfig,
        *,
        buffer: str,
        publish: str,
        run_dir: Path,
        model: str | None = None,
        device: str = "cpu",
        sample_timeout_s: float = 600.0,
        tensorboard: Path | None = None,
        transport: TransportConfig | None = None,
    ) -> None:
        from teamrl.learner.engine import LearnerEngine, init_distributed

        self.cfg = cfg
        self.run_dir = run_dir
        self.sample_timeout_s = sample_timeout_s
        self.rank, self.world = init_distributed(device)
        # where the time goes: RUN/timeline.jsonl under `teamrl run` (teamrl.protocol.timeline)
        self.timeline = Timeline.from_env(f"learner{'-' + cfg.group if cfg.group else ''}", str(self.rank))
        self.timeline.enter("setup")
        if model is None and not cfg.base_model:
            from teamrl.learner.modelbuild import build

            model = str(build())
        self.model = model or cfg.base_model
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            (run_dir / "learner_config.json").write_text(
                json.dumps({**cfg.model_dump(mode="json"), "model": self.model}, indent=1) + "\n"
            )
        self.engine = LearnerEngine(self.model, cfg.adapters, EngineSettings.from_config(cfg), device=device)
        self.engine.timeline = self.timeline  # forward_backward / optimiser within a step
        self._connect(buffer, publish, transport or TransportConfig())
        self.step = 0
        self.version = 0
        self.stop_reason: str | None = None
        self.out_of_time = False  # the time budget (max_seconds) ran out: the last step was the final one
        self._request_id = 0
        self._rank0_extras(tensorboard)
        self.checkpoints = RunCheckpoints(
            run_dir, self.engine, rank=self.rank, world=self.world, keep=cfg.keep_checkpoints
        )
        resumed = self.checkpoints.resume(cfg.adapters[0])  # None: a fresh run
        if resumed is not None:
            self.step, self.version = resumed

    def _connect(self, buffer: str, publish: str, transport: TransportConfig) -> None:
        """The buffer's RPC client, and on rank 0 the weights PUB and "latest" sockets.

        CURVE from [transport] (None when off): the learner key to the buffer's RPC socket; the
        learner's own pair and the rollout/admin allow-list on its weights PUB and "latest" sockets."""
        from teamrl.protocol.zmq_transport import RpcClient, WeightsPublisher, latest_endpoint_for

        self.rpc = RpcClient(buffer, timeout_ms=10_000, curve=transport.client_curve("learner", "buffer_rpc"))
        self.publisher: AdapterPublisher | None = None
        if self.rank == 0:
            socket = WeightsPublisher(
                publish, latest_endpoint_for(publish), curve=transport.server_curve("learner_weights")
            )
            self.publisher = AdapterPublisher(
                socket, self.engine, self.cfg, self.run_dir, self.model, timeline=self.timeline
            )

    def _rank0_extras(self, tensorboard: Path | None) -> None:
        """Rank 0 only: the LangMARL profile round (``profile_interval``) and TensorBoard files."""
        cfg = self.cfg
        self.profiles = None
        if cfg.profile_interval and self.rank == 0:
            from teamrl.learner.profile_round import ProfileRound

            self.profiles = ProfileRound.from_config(cfg, self.engine, self.model, self.run_dir / "profiles")
        self.tb = None
        if tensorboard is not None and self.rank == 0:
            from teamrl.learner.tensorboard import EventWriter

            self.tb = EventWriter(tensorboard)

    # --- checkpoints (teamrl.learner.resume) ---------------------------------------------------

    def checkpoint(self) -> None:
        with self.timeline.state("checkpoint"):
            self.checkpoints.save(self.step, self.version)

    # --- data ---------------------------------------------------------------------------------

    def sample(
        self, on_reply: Callable[[list[Any], list[float]], Any] | None = None
    ) -> tuple[list[Any], list[float], float]:
        """At least ``batch_size`` trajectories from the buffer (whole groups); returns (them, their
        sample weights, wait s).

        Each reply's Arrow frame is validated once, on arrival, into ``TrajectoryBatch`` es that
        stay columnar down to the tensors (``rows.build_rows``). The weights are one per trajectory
        (``SampleReply.weights``, 1 where a reply carries none), for the train step. A reply that
        fails its checks is counted and asked for again. ``on_reply(batches, weights)`` runs on each
        reply as it arrives (a streaming step trains there); its time is not counted as waiting."""
        got: list[Any] = []
        weights_got: list[float] = []
        n_got, busy = 0, 0.0
        t0 = time.monotonic()
        while n_got < self.cfg.batch_size:
            self.timeline.enter("sample_wait")
            if self.stop_reason is not None and not got:
                raise _Stopping
            if time.monotonic() - t0 - busy > self.sample_timeout_s:
                raise TimeoutError(f"no data from the buffer for {self.sample_timeout_s:.0f} s")
            answer = self._ask(self.cfg.batch_size - n_got, t0)
            if answer is None:
                continue
            batches, weights = answer
            got.extend(batches)
            n_got += len(weights)
            weights_got.extend(weights)
            if on_reply is not None:
                t = time.monotonic()
                self.timeline.enter("forward_backward")
                on_reply(batches, weights)
                busy += time.monotonic() - t
        return got, weights_got, time.monotonic() - t0 - busy

    def _ask(self, n: int, t0: float) -> tuple[list[Any], list[float]] | None:
        """One ``SampleRequest`` for ``n`` more trajectories: (batches, one weight per trajectory), or
        None when none came (a refusal, a timeout, an unreadable reply: counted, and waited out)."""
        from teamrl.protocol.control import SampleRequest

        lag = self.cfg.min_policy_version_lag
        self._request_id += 1
        req = SampleRequest(  # a learner group: its own agents' steps, staleness by its own versions
            request_id=self._request_id,
            batch_size=n,
            rank=self.rank,
            min_policy_version=self.version - lag if lag >= 0 else -1,
            agent_ids=list(self.cfg.group_agents) or None,
            model_id=self.cfg.group or None,
        )
        return ask_buffer(self.rpc, req, t0)

    # --- publishing (teamrl.learner.publish) ---------------------------------------------------

    def publish(self) -> dict[str, float]:
        """Export the adapters as version ``self.version`` and announce them (rank 0): to the buffer
        first, so no rollout can send data of a version the buffer has not heard of."""
        assert self.publisher is not None
        self.announce()
        return self.publisher.publish(self.version, final=self.finished)

    @property
    def finished(self) -> bool:
        """The steps or the time budget are spent: the latest version is the final one."""
        return self.step >= self.cfg.max_steps or self.out_of_time

    def announce(self) -> None:
        """Tell the buffer this base's version (``publish.announce_version``)."""
        announce_version(self.rpc, self.cfg.group or None, list(self.cfg.group_agents), self.version)

    # --- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        def on_signal(signum: int, _frame: Any) -> None:
            log.info("%s received: finishing the current step, then checkpoint and exit", signum)
            self.stop_reason = signal.Signals(signum).name

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        if self.rank == 0:
            drop_rows_from(
                self.run_dir / "metrics.jsonl", self.step
            )  # steps redone after a resume: once each
        metrics_f = (self.run_dir / "metrics.jsonl").open("a") if self.rank == 0 else None
        t_begin = float(os.environ.get("TEAMRL_RUN_T0", time.time()))
        if self.publisher is not None and self.version > 0:
            self.publish()  # a resumed learner re-announces its version: rollouts may have restarted
        elif self.publisher is not None:
            self.announce()  # the buffer learns this base's version (and, without a plan, its ids)
        if self.publisher is not None and self.profiles is not None:
            latest = self.profiles.latest()
            if latest is not None and latest.version > 0:
                self.publisher.publish_profiles(latest)  # served on the latest endpoint too
        try:
            while not self.finished and self.stop_reason is None:
                try:
                    row = self.one_step(t_begin)
                except _Stopping:
                    break
                self.timeline.enter("metrics")
                if metrics_f is not None:
                    metrics_f.write(json.dumps(row) + "\n")
                    metrics_f.flush()
                if self.tb is not None:
                    self.tb.scalars(row["step"], {k: v for k, v in row.items() if k not in ("step", "time")})
                if self.rank == 0:  # one line per step, with or without --tensorboard
                    log.info(
                        "step %d v%d reward %.3f (%.1f s, waited %.1f s for data)",
                        row["step"],
                        self.version,
                        row.get("reward_mean", math.nan),
                        row["step_seconds"],
                        row["sample_wait_seconds"],
                    )
                if self.step % self.cfg.checkpoint_interval == 0:
                    self.checkpoint()
            if self.finished and self.publisher is not None:
                self.linger()
        finally:
            if self.step > 0 and not self.checkpoints.is_complete(self.step):
                self.checkpoint()
            if metrics_f is not None:
                metrics_f.close()
            self.close()
        log.info("learner stopped at step %d, version %d (%s)", self.step, self.version, self.stop_reason)
        return 0

    def linger(self) -> None:
        """Serve the final version (latest endpoint, a background thread) for ``linger_s`` or until a
        signal, after the last step."""
        if self.cfg.linger_s > 0:
            log.info("done: serving v%d for up to %.0f s (until SIGTERM)", self.version, self.cfg.linger_s)
        deadline = time.monotonic() + self.cfg.linger_s
        self.timeline.enter("idle")
        while self.stop_reason is None and time.monotonic() < deadline:
            time.sleep(0.2)

    def one_step(self, t_begin: float) -> dict[str, Any]:
        """Sample, train, maybe run a profile round and publish; the step's metrics row."""
        from teamrl.learner.rows import StepColumns

        t0 = time.perf_counter()
        trajectories, waited, metrics_of_step = self._sample_and_train()
        M.SAMPLE_WAIT_SECONDS.observe(waited)
        steps = StepColumns.of(trajectories)  # TrajectoryBatch es: columns, no object per step
        own = steps.versions_of(self.cfg.group_agents or None)  # a group: its base's versions only
        observe_lags(own, self.version)
        self.step += 1
        self.out_of_time = budget_spent(self.cfg.max_seconds, t_begin)
        self.timeline.enter("profile")
        profile_row = self._profile_round(trajectories)
        pub: dict[str, float] = {}
        if self.cfg.train_weights and (self.step % self.cfg.publish_interval == 0 or self.finished):
            self.version += 1
            if self.publisher is not None:
                pub = self.publish()
        dt = time.perf_counter() - t0
        gauge_step(dt, waited, metrics_of_step)
        return {
            "step": self.step - 1,
            "time": time.time() - t_begin,
            "version": self.version,
            **sample_row(steps, own, self.version - 1),
            "sample_wait_seconds": waited,
            "step_seconds": dt,
            **pub,
            **profile_row,
            **{k: v for k, v in metrics_of_step.items() if isinstance(v, (int, float))},
            **({"final": 1} if self.finished else {}),  # the launcher's end, by steps or by time
        }

    def _sample_and_train(self) -> tuple[list[Any], float, dict[str, Any]]:
        """Sample and train one step (no training with ``train_weights`` off): the sample, the time
        spent waiting for it, the step's metrics. With ``stream_micro_batches`` the first
        micro-batches train while the rest of the sample arrives (teamrl.learner.streaming)."""
        # the weights held now are exactly version ``self.version`` only right after a publish
        fresh = self.version if self.step % self.cfg.publish_interval == 0 else None
        if not self.cfg.train_weights:
            trajectories, _, waited = self.sample()
            return trajectories, waited, {}
        if self.cfg.stream_micro_batches:
            from teamrl.learner.streaming import StreamingStep

            stream = StreamingStep(self.engine, self.step, self.version, fresh)
            trajectories, _, waited = self.sample(stream.add)  # the stream took each reply's weights
            self.timeline.enter("forward_backward")
            return trajectories, waited, stream.finish().metrics
        trajectories, weights, waited = self.sample()
        self.timeline.enter("forward_backward")
        res = self.engine.train_step(
            trajectories, self.step, self.version, fresh_version=fresh, weights=weights
        )
        return trajectories, waited, res.metrics

    def _profile_round(self, trajectories: list[Any]) -> dict[str, float]:
        """A LangMARL profile round when one is due (published on rank 0); the profile version."""
        if self.profiles is None:
            return {}
        new_profiles = self.profiles.maybe_run(self.step, trajectories)
        if new_profiles is not None and self.publisher is not None:
            self.publisher.publish_profiles(new_profiles)
        return {"profile_version": float(getattr(self.profiles.latest(), "version", 0))}

    def close(self) -> None:
        self.timeline.close()
        if self.tb is not None:
            self.tb.close()
        self.rpc.close()
        if self.publisher is not None:
            self.publisher.close()


def budget_spent(max_seconds: float, t_begin: float) -> bool:
    """Whether the time budget (``max_seconds`` since ``t_begin``; 0: none) ran out, agreed by every
    rank (rank 0's clock is not theirs)."""
    if max_seconds <= 0:
        return False
    from teamrl.learner.distributed import _all_reduce_max

    over = int(time.time() - t_begin >= max_seconds)
    return bool(_all_reduce_max([over])[0])


class _Stopping(Exception):
    """A stop was asked for while waiting for data: leave the loop without a partial step."""


def ask_buffer(rpc: Any, req: Any, t0: float) -> tuple[list[Any], list[float]] | None:
    """Send one ``SampleRequest``: (batches, one weight per trajectory), or None when none came (a
    refusal, a timeout, an unreadable reply: counted, and waited out). ``t0``: when the step began
    asking (for the log line)."""
    from teamrl.protocol.codec import decode_batches
    from teamrl.protocol.control import ErrorReply, SampleReply
    from teamrl.protocol.errors import PeerTimeout, ProtocolError

    try:
        reply = rpc.call(req)
        batches = decode_batches(reply.trajectories) if isinstance(reply, SampleReply) else []
    except PeerTimeout:
        M.SAMPLE_ERRORS.labels("timeout").inc()
        log.warning(
            "no reply from the buffer at %s: waiting %.0f s for %d more trajectories",
            rpc.endpoint,
            time.monotonic() - t0,
            req.batch_size,
        )
        return None
    except ProtocolError as e:  # counted by the codec; the buffer keeps the rows' groups
        M.SAMPLE_ERRORS.labels(e.reason).inc()
        log.warning("unreadable sample reply from the buffer (%s): %s; asking again", e.reason, e)
        time.sleep(SAMPLE_POLL_S)
        return None
    if isinstance(reply, SampleReply):
        k = sum(len(b) for b in batches)
        w = reply.weights if len(reply.weights) == k else [1.0] * k
        return batches, [float(x) for x in w]
    if isinstance(reply, ErrorReply):
        M.SAMPLE_ERRORS.labels(reply.reason).inc()
        time.sleep(SAMPLE_POLL_S)
    return None


# --------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="teamrl learner",
        description="Run a learner rank: sample graph trajectories from the replay buffer, update one "
        "LoRA adapter per agent with DeepSpeed (off-policy corrected, agent by agent), publish the "
        "adapters to rollouts, checkpoint. Restarted on the same --run-dir, it resumes.",
        epilog="Every training knob is a field of the [learner] table (teamrl.learner.config.LearnerConfig), "
        "settable with --set KEY=VALUE. Several ranks: launch with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT "
        "set (torchrun, the deepspeed launcher, or a StatefulSet). " + TRANSPORT_EPILOG,
    )
    add_insecure_flag(p)
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with a [learner] table")
    p.add_argument(
        "--set", metavar="KEY=VALUE", action="append", default=[], help="override a [learner] field"
    )
    p.add_argument(
        "--buffer", default="tcp://127.0.0.1:5556", help="the buffer's sample endpoint (default %(default)s)"
    )
    p.add_argument(
        "--publish",
        default="tcp://127.0.0.1:5557",
        help="weights PUB endpoint to bind; the 'latest' RPC endpoint binds the next port (default %(default)s)",
    )
    p.add_argument("--run-dir", default="runs/learner", help="metrics.jsonl, adapters/, checkpoints/")
    p.add_argument(
        "--group",
        metavar="MODEL_ID",
        default="",
        help="a learner group of a team of different models: [learner] with [groups.MODEL_ID] over it",
    )
    p.add_argument("--model", default=None, help="model folder (default: [learner] base_model or embedded)")
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto (default): cuda when torch sees a GPU, else cpu",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port, 0 = off")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--sample-timeout", type=float, default=600.0, help="seconds without data before failing")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="also write metrics as TensorBoard event files here",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def load_transport(path: str | None) -> TransportConfig:
    """The ``[transport]`` table of ``--config`` (none: defaults, CURVE off), the same table the
    buffer and rollouts read (``teamrl.protocol.config.TransportConfig``; docs/transport-security.md).
    With CURVE on, the key files are read here, so a missing key fails before any model loads."""
    from teamrl.protocol.configfile import load_section
    from teamrl.protocol.curve import CurveKeyError

    transport = load_section(TransportConfig, path, "transport", flags={}, error=LearnerConfigError)
    try:
        transport.client_curve("learner", "buffer_rpc")
        transport.server_curve("learner_weights")
    except (CurveKeyError, OSError, ValueError) as e:
        raise LearnerConfigError(f"{path} [transport]: {e}") from None
    return transport


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_learner_config(args.config, args.set, group=args.group)
        transport = load_transport(args.config)
        print(transport_mode("teamrl learner", transport, args.insecure), file=sys.stderr, flush=True)
    except (LearnerConfigError, NoKeys) as e:
        print(e if isinstance(e, NoKeys) else f"teamrl learner: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    if args.metrics_port > 0:  # every rank: its probes and Prometheus target need a live endpoint
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)
    svc = LearnerService(
        cfg,
        buffer=args.buffer,
        publish=args.publish,
        run_dir=Path(args.run_dir),
        model=args.model,
        device=resolve_device(args.device),
        sample_timeout_s=args.sample_timeout,
        tensorboard=Path(args.tensorboard) if args.tensorboard else None,
        transport=transport,
    )
    rc = svc.run()
    _end_process(rc)
    return rc  # not reached


def _end_process(rc: int) -> None:
    """End the learner process once ``run`` has returned.

    By then everything the learner owes is durable: the last checkpoint has its DONE marker,
    ``metrics.jsonl`` is closed, the adapters are published and the sockets closed. The interpreter's
    own teardown (torch.distributed with DeepSpeed's shared-memory op, their threads) once hung after
    "learner stopped" was logged, until the launcher's SIGKILL 60 s later turned a finished run into a
    failed one; so the process group is destroyed here and the process ends without that teardown."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001  (ending anyway: this is only tidiness)
        log.warning("destroying the process group failed: %s", e)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
