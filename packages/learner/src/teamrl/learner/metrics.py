"""Prometheus metrics of a learner rank (``teamrl_learner_*``).

The autoscaler and the dashboard read these names (deploy/monitoring); tests/unit/deploy checks that
every name they use is defined here. Per-agent series carry the label ``agent`` (the adapter name).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

STEPS = Counter("teamrl_learner_steps", "Learner updates finished")
STEP_SECONDS = Histogram(
    "teamrl_learner_step_seconds",
    "Wall time of one learner step: sampling wait + update + publish",
    buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128),
)
SAMPLE_WAIT_SECONDS = Histogram(
    "teamrl_learner_sample_wait_seconds",
    "Time a learner step waited for the replay buffer to hand out enough data",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
)
DATA_WAIT_RATIO = Gauge(
    "teamrl_learner_data_wait_ratio", "Fraction of the last step's wall time spent waiting for data"
)
VERSION_LAG = Histogram(
    "teamrl_learner_version_lag",
    "Policy versions between the learner and the data it trained on (per sampled step)",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
)
VERSION = Gauge("teamrl_learner_policy_version", "Latest policy version this learner published")
TOKENS = Counter("teamrl_learner_tokens", "Prompt + response tokens trained on", ["agent"])
LOSS = Gauge("teamrl_learner_loss", "Policy loss of the last step", ["agent"])
GRAD_NORM = Gauge("teamrl_learner_grad_norm", "Gradient norm of the last step", ["agent"])
CLIP_FRACTION = Gauge("teamrl_learner_clip_fraction", "PPO clip fraction of the last step", ["agent"])
KL = Gauge("teamrl_learner_kl", "KL to the reference (adapters off) in the last step", ["agent"])
IS_RATIO_MEAN = Gauge("teamrl_learner_is_ratio_mean", "Mean importance ratio of the last step", ["agent"])
IS_RATIO_MAX = Gauge("teamrl_learner_is_ratio_max", "Largest importance ratio of the last step", ["agent"])
ADV_MEAN = Gauge("teamrl_learner_advantage_mean", "Advantage mean of the last step", ["agent"])
ADV_STD = Gauge("teamrl_learner_advantage_std", "Advantage std of the last step", ["agent"])
TOKENS_PER_SECOND = Gauge("teamrl_learner_tokens_per_second", "Update throughput of the last step")
PUBLISH_SECONDS = Histogram(
    "teamrl_learner_publish_seconds",
    "Export + pack + announce time of one adapter version",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8),
)
SAMPLE_ERRORS = Counter(
    "teamrl_learner_sample_refusals",
    "Sample requests that brought no data, by reason (a buffer refusal, timeout, an unreadable reply)",
    ["reason"],
)
CHECKPOINTS = Counter("teamrl_learner_checkpoints", "Checkpoints completed (DONE marker written)")

# LearnerEngine metric key prefix -> per-agent gauge
PER_AGENT = {
    "loss": LOSS,
    "grad_norm": GRAD_NORM,
    "clip_frac": CLIP_FRACTION,
    "kl": KL,
    "ratio_mean": IS_RATIO_MEAN,
    "ratio_max": IS_RATIO_MAX,
    "advantage_mean": ADV_MEAN,
    "advantage_std": ADV_STD,
}
