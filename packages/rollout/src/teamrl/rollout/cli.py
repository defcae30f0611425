"""``teamrl rollout``: the command line of one rollout service.

Arguments are parsed, and the config, the model folder and the bases checked
(:func:`checked_config`), before logging starts or an engine is built: a bad config exits 2 in under
a second. Then ``asyncio.run(RolloutService(...).main())`` (``teamrl.rollout.service``) runs until
SIGTERM and its exit code is the command's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

from teamrl.protocol.config import (
    TRANSPORT_EPILOG,
    NoKeys,
    TransportConfig,
    add_insecure_flag,
    transport_mode,
)
from teamrl.rollout.config import (
    DEFAULT_WEIGHTS,
    RolloutConfig,
    RolloutConfigError,
    load_config,
    load_transport,
    resolve_bases,
    with_model,
)
from teamrl.rollout.service import RolloutService


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="teamrl rollout",
        description="Run one rollout service: multi-agent workflow episodes on vLLM with per-agent LoRA "
        "adapters, published as Arrow graph trajectories over ZeroMQ to the replay buffer; adapter "
        "versions from the learner are verified before use. SIGTERM drains without losing data.",
        epilog="Every knob is a field of the [rollout] table (teamrl.rollout.config.RolloutConfig), "
        "settable with --set KEY=VALUE. " + TRANSPORT_EPILOG,
    )
    add_insecure_flag(p)
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
        print(transport_mode("teamrl rollout", transport, args.insecure), file=sys.stderr, flush=True)
    except (RolloutConfigError, NoKeys) as e:
        print(e if isinstance(e, NoKeys) else f"teamrl rollout: {e}", file=sys.stderr)
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
