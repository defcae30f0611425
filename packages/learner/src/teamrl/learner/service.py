"""A learner rank as a service: sample from the replay buffer, update, publish adapters, checkpoint.

``teamrl learner --buffer tcp://buffer:5556 --publish tcp://0.0.0.0:5557 --run-dir DIR`` runs::

    resume         DIR/checkpoints/step-N with a DONE marker -> load it (DeepSpeed state of every
                   adapter engine, RNG states), continue at step N with version V (never backwards)
    every step     SampleRequest (rank, min_policy_version = version - lag) until batch_size
                   trajectories arrived (whole groups; refusals are waited out and counted)
                   -> LearnerEngine.train_step (advantages, objective, agent-by-agent update)
                   -> version + 1 -> export the LoRA adapters (PEFT safetensors) to DIR/adapters/vV
                   -> WeightsPublished (inline chunks or the folder URI, sha256 of the payload, a
                   probe: prompt, completion, and this learner's log-probs of it) on PUB + "latest"
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
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from teamrl.learner import metrics as M
from teamrl.learner.config import LearnerConfig, LearnerConfigError, load_learner_config
from teamrl.protocol.config import TransportConfig

log = logging.getLogger("teamrl.learner")

DONE = "DONE"
SAMPLE_POLL_S = 0.05

# bfloat16's machine epsilon (torch.finfo(torch.bfloat16).eps = 2**-7): 8 significand bits, so a
# value is stored to within half of it relative to itself.
BF16_EPS = 2.0**-7


def probe_atol(dtype: str) -> float:
    """Tolerance the receiver's probe log-probs must meet, by the learner's model ``dtype``.

    float32: 1e-3 (the two sides run the same weights through different kernels). bfloat16: 8 eps
    (0.0625). bf16 keeps 8 significand bits, so a logit of magnitude 2-4 is only known to within
    2**-6, and the learner (DeepSpeed casts the LoRA weights to bf16) and a receiver computing the same
    adapter with other kernels (PEFT keeps LoRA weights in float32) differ by a few such steps:
    measured on an H200 with a Qwen2.5-0.5B-shaped model, up to 0.029 on log-probs near -12
    (``tests/bench/learner.py``, README). A wrong or stale adapter moves log-probs by more.
    """
    return 8 * BF16_EPS if dtype == "bfloat16" else 1e-3


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
        from teamrl.protocol.zmq_transport import RpcClient, WeightsPublisher, latest_endpoint_for

        self.cfg = cfg
        self.run_dir = run_dir
        self.sample_timeout_s = sample_timeout_s
        self.rank, self.world = init_distributed(device)
        if model is None and not cfg.base_model:
            from teamrl.learner.modelbuild import build

            model = str(build())
        self.model = model or cfg.base_model
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            (run_dir / "learner_config.json").write_text(
                json.dumps({**cfg.model_dump(mode="json"), "model": self.model}, indent=1) + "\n"
            )
        self.engine = LearnerEngine(self.model, device=device, **cfg.engine_kwargs())
        # CURVE from [transport] (None when off): the learner key to the buffer's RPC socket; the
        # learner's own pair and the rollout/admin allow-list on its weights PUB and "latest" sockets
        transport = transport or TransportConfig()
        self.rpc = RpcClient(buffer, timeout_ms=10_000, curve=transport.client_curve("learner", "buffer_rpc"))
        self.publisher = (
            WeightsPublisher(
                publish, latest_endpoint_for(publish), curve=transport.server_curve("learner_weights")
            )
            if self.rank == 0
            else None
        )
        self.step = 0
        self.version = 0
        self.stop_reason: str | None = None
        self._request_id = 0
        self.profiles = None
        if cfg.profile_interval and self.rank == 0:
            from teamrl.learner.profile_round import ProfileRound, judge_from_engine

            self.profiles = ProfileRound(
                run_dir / "profiles",
                judge_from_engine(self.engine, self.model, cfg.profile_max_new_tokens, cfg.seed),
                cfg.profile_interval,
                initial=cfg.profiles,
                max_staleness=cfg.profile_max_staleness,
            )
        self.tb = None
        if tensorboard is not None and self.rank == 0:
            from teamrl.learner.tensorboard import EventWriter

            self.tb = EventWriter(tensorboard)
        self._resume()

    # --- checkpoints --------------------------------------------------------------------------

    def _checkpoints(self) -> list[Path]:
        root = self.run_dir / "checkpoints"
        if not root.is_dir():
            return []
        done = [p for p in root.iterdir() if p.name.startswith("step-") and (p / DONE).is_file()]
        return sorted(done, key=lambda p: int(p.name.split("-")[1]))

    def _resume(self) -> None:
        ckpts = self._checkpoints()
        if not ckpts:
            return
        last = ckpts[-1]
        state = json.loads((last / "state.json").read_text())
        self.engine.load_checkpoint(last)
        self.step = int(state["step"])
        self.version = int(state["version"])
        # Versions published after this checkpoint (before a kill) are never issued again with
        # other weights: go on from the highest version ever exported.
        published = [
            int(p.name[1:])
            for p in (self.run_dir / "adapters").glob("v*")
            if p.name[1:].isdigit() and (p / self.cfg.adapters[0]).is_dir()
        ]
        skipped = max([self.version, *published]) - self.version
        self.version += skipped
        log.info(
            "resumed from %s: step %d, version %d%s",
            last,
            self.step,
            self.version,
            f" (skipping {skipped} version(s) published after the checkpoint)" if skipped else "",
        )
        M.VERSION.set(self.version)

    def checkpoint(self) -> None:
        import torch.distributed as dist

        folder = self.run_dir / "checkpoints" / f"step-{self.step:06d}"
        if self.rank == 0 and folder.exists():
            shutil.rmtree(folder)
        if self.world > 1:
            dist.barrier()
        folder.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(folder)
        if self.world > 1:
            dist.barrier()
        if self.rank == 0:
            (folder / "state.json").write_text(json.dumps({"step": self.step, "version": self.version}))
            (folder / DONE).write_text("")  # only now does the checkpoint count
            M.CHECKPOINTS.inc()
            for old in self._checkpoints()[: -self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
            log.info("checkpoint %s", folder)

    # --- data ---------------------------------------------------------------------------------

    def sample(self) -> tuple[list[Any], float]:
        """At least ``batch_size`` trajectories from the buffer (whole groups); returns (them, wait s).

        Their sample weights (``SampleReply.weights``, 1 where a reply carries none) are left in
        ``self.sample_weights`` for the train step."""
        from teamrl.protocol.codec import decode_trajectories
        from teamrl.protocol.control import ErrorReply, SampleReply, SampleRequest
        from teamrl.protocol.errors import PeerTimeout

        lag = self.cfg.min_policy_version_lag
        min_version = self.version - lag if lag >= 0 else -1
        got: list[Any] = []
        self.sample_weights: list[float] = []
        t0 = time.monotonic()
        while len(got) < self.cfg.batch_size:
            if self.stop_reason is not None and not got:
                raise _Stopping
            if time.monotonic() - t0 > self.sample_timeout_s:
                raise TimeoutError(f"no data from the buffer for {self.sample_timeout_s:.0f} s")
            self._request_id += 1
            req = SampleRequest(
                request_id=self._request_id,
                batch_size=self.cfg.batch_size - len(got),
                rank=self.rank,
                min_policy_version=min_version,
            )
            try:
                reply = self.rpc.call(req)
            except PeerTimeout:
                M.SAMPLE_ERRORS.labels("timeout").inc()
                log.warning(
                    "no reply from the buffer at %s: waiting %.0f s for %d more trajectories",
                    self.rpc.endpoint,
                    time.monotonic() - t0,
                    self.cfg.batch_size - len(got),
                )
                continue
            if isinstance(reply, SampleReply):
                batch = decode_trajectories(reply.trajectories)
                got.extend(batch)
                w = reply.weights if len(reply.weights) == len(batch) else [1.0] * len(batch)
                self.sample_weights.extend(float(x) for x in w)
            elif isinstance(reply, ErrorReply):
                M.SAMPLE_ERRORS.labels(reply.reason).inc()
                time.sleep(SAMPLE_POLL_S)
        return got, time.monotonic() - t0

    # --- publishing ---------------------------------------------------------------------------

    def publish(self, trajectories: list[Any]) -> dict[str, float]:
        """Export the adapters as version ``self.version`` and announce them (rank 0)."""
        from teamrl.protocol.adapters import folder_payload, payload_sha256
        from teamrl.protocol.control import InlineWeights, Probe, UriWeights, WeightsPublished

        assert self.publisher is not None
        t0 = time.perf_counter()
        folder = self.run_dir / "adapters" / f"v{self.version}"
        self.engine.export_adapters(folder)
        payload = folder_payload(folder)
        sha = payload_sha256(payload)
        probes = {  # every adapter gets its own probe: a rollout verifies each before using the version
            a: Probe(
                prompt_ids=list(self.cfg.probe_prompt),
                completion_ids=list(self.cfg.probe_completion),
                expected_logprobs=self.engine.completion_logprobs(
                    a, self.cfg.probe_prompt, self.cfg.probe_completion
                ),
                atol=probe_atol(self.engine.dtype),
            )
            for a in self.cfg.adapters
        }
        if self.cfg.publish_mode == "inline" and len(payload) <= self.cfg.inline_max_bytes:
            n = self.cfg.chunk_bytes
            location: Any = InlineWeights(chunks=[payload[i : i + n] for i in range(0, len(payload), n)])
        else:
            location = UriWeights(uri=str(folder.resolve()))
        msg = WeightsPublished(
            announce_seq=0,
            version=self.version,
            adapters={a: a for a in self.cfg.adapters},
            location=location,
            sha256=sha,
            probe=probes[self.cfg.adapters[0]],
            base_model=self.model,
            probes=probes,
            final=self.step >= self.cfg.max_steps,
        )
        self.publisher.publish(msg)
        dt = time.perf_counter() - t0
        M.PUBLISH_SECONDS.observe(dt)
        M.VERSION.set(self.version)
        self._prune_adapters()
        return {"publish_seconds": dt, "payload_bytes": float(len(payload))}

    def _prune_adapters(self, keep: int = 8) -> None:
        root = self.run_dir / "adapters"
        olds = sorted(
            (p for p in root.iterdir() if p.name.startswith("v") and p.name[1:].isdigit()),
            key=lambda p: int(p.name[1:]),
        )
        for p in olds[:-keep]:
            shutil.rmtree(p, ignore_errors=True)

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
            self.publish([])  # a resumed learner re-announces its version: rollouts may have restarted
        if self.publisher is not None and self.profiles is not None:
            latest = self.profiles.latest()
            if latest is not None and latest.version > 0:
                self.publisher.publish_profiles(latest)  # served on the latest endpoint too
        try:
            while self.step < self.cfg.max_steps and self.stop_reason is None:
                try:
                    row = self.one_step(t_begin)
                except _Stopping:
                    break
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
            if self.step >= self.cfg.max_steps and self.publisher is not None:
                self.linger()
        finally:
            if self.step > 0 and not (self.run_dir / "checkpoints" / f"step-{self.step:06d}" / DONE).exists():
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
        while self.stop_reason is None and time.monotonic() < deadline:
            time.sleep(0.2)

    def one_step(self, t_begin: float) -> dict[str, Any]:
        t0 = time.perf_counter()
        trajectories, waited = self.sample()
        M.SAMPLE_WAIT_SECONDS.observe(waited)
        for t in trajectories:
            for s in t.steps:
                M.VERSION_LAG.observe(max(0, self.version - s.policy_version))
        # the weights held now are exactly version ``self.version`` only right after a publish
        fresh = self.version if self.step % self.cfg.publish_interval == 0 else None
        metrics_of_step: dict[str, Any] = {}
        if self.cfg.train_weights:
            metrics_of_step = self.engine.train_step(
                trajectories,
                self.step,
                self.version,
                fresh_version=fresh,
                weights=getattr(self, "sample_weights", None),
            ).metrics
        self.step += 1
        pub: dict[str, float] = {}
        profile_row: dict[str, float] = {}
        if self.profiles is not None:
            new_profiles = self.profiles.maybe_run(self.step, trajectories)
            if new_profiles is not None and self.publisher is not None:
                self.publisher.publish_profiles(new_profiles)
            profile_row["profile_version"] = float(getattr(self.profiles.latest(), "version", 0))
        if self.cfg.train_weights and self.step % self.cfg.publish_interval == 0:
            self.version += 1
            if self.publisher is not None:
                pub = self.publish(trajectories)
        dt = time.perf_counter() - t0
        M.STEPS.inc()
        M.STEP_SECONDS.observe(dt)
        M.DATA_WAIT_RATIO.set(waited / dt if dt > 0 else 0.0)
        M.TOKENS_PER_SECOND.set(metrics_of_step.get("tokens_per_s", 0.0))
        for key, value in metrics_of_step.items():
            head, _, agent = key.partition("/")
            if agent and head in M.PER_AGENT and math.isfinite(value):
                M.PER_AGENT[head].labels(agent).set(value)
        by_agent: dict[str, list[float]] = {}
        lags = []
        for t in trajectories:
            for s in t.steps:
                by_agent.setdefault(s.agent_id, []).append(float(s.reward))
                lags.append(self.version - 1 - s.policy_version)
        return {
            "step": self.step - 1,
            "time": time.time() - t_begin,
            "version": self.version,
            "episodes": len(trajectories),
            "reward_mean": float(sum(t.reward for t in trajectories) / len(trajectories)),
            **{f"reward/{a}": sum(v) / len(v) for a, v in by_agent.items()},
            "version_lag_mean": sum(lags) / len(lags) if lags else 0.0,
            "version_lag_max": float(max(lags)) if lags else 0.0,
            "sample_wait_seconds": waited,
            "step_seconds": dt,
            **pub,
            **profile_row,
            **{k: v for k, v in metrics_of_step.items() if isinstance(v, (int, float))},
        }

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        self.rpc.close()
        if self.publisher is not None:
            time.sleep(0.2)  # let the last announcement leave
            self.publisher.close()


class _Stopping(Exception):
    """A stop was asked for while waiting for data: leave the loop without a partial step."""


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
        "set (torchrun, the deepspeed launcher, or a StatefulSet).",
    )
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
    buffer and rollouts read (``teamrl.protocol.config.TransportConfig``; README, "Security").
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
        cfg = load_learner_config(args.config, args.set)
        transport = load_transport(args.config)
    except LearnerConfigError as e:
        print(f"teamrl learner: {e}", file=sys.stderr)
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
