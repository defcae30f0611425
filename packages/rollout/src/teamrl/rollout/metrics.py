"""Prometheus metrics of a rollout service (``teamrl_rollout_*``), served on /metrics.

The dashboard and the autoscalers read these names (deploy/monitoring); tests/unit/deploy checks
that each name they use is defined here. Per-agent series carry the label ``agent`` (the adapter
versions: the adapter's name); the version lag carries ``model``, the base model it is of.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Summary

EPISODES = Counter("teamrl_rollout_episodes", "Episodes finished and queued for publishing", ["workflow"])
ABANDONED = Counter(
    "teamrl_rollout_episodes_abandoned", "Episodes cancelled on drain or failed; never published", ["reason"]
)
STEPS = Counter("teamrl_rollout_steps", "Agent steps generated", ["agent"])
TOKENS = Counter("teamrl_rollout_tokens", "Response tokens generated", ["agent"])
REWARD = Summary("teamrl_rollout_reward", "Step reward of each agent step", ["agent"])
THROUGHPUT = Gauge("teamrl_rollout_tokens_per_second", "Generated tokens per second over the last interval")
POLICY_VERSION = Gauge("teamrl_rollout_policy_version", "Adapter version in use for new requests", ["agent"])
# Labelled by base model (one engine and one learner group each, docs/architecture.md §3); no
# dashboard or alert in deploy/monitoring reads this series.
VERSION_LAG = Gauge(
    "teamrl_rollout_version_lag", "Versions between the newest announced and the one in use", ["model"]
)
WAITING_FOR_VERSION = Gauge(
    "teamrl_rollout_waiting_for_version",
    "1 while max_groups_per_version groups were started at the live version and no newer one is live",
)
INFLIGHT = Gauge("teamrl_rollout_inflight_episodes", "Episodes being generated now")
PUBLISH_QUEUE = Gauge(
    "teamrl_rollout_publish_queue_depth", "Frames waiting to be sent or acknowledged by the buffer"
)
FRAMES_SENT = Counter("teamrl_rollout_frames_sent", "Trajectory frames handed to the transport")
FRAMES_ACKED = Counter("teamrl_rollout_frames_acked", "Trajectory frames the buffer acknowledged as durable")
ADAPTER_LOADS = Counter("teamrl_rollout_adapter_loads", "Adapter versions loaded and verified")
ADAPTER_FAILURES = Counter(
    "teamrl_rollout_adapter_load_failures", "Adapter versions refused, by reason", ["reason"]
)
READY = Gauge("teamrl_rollout_ready", "1 while the service takes new work (what /readyz reports)")
