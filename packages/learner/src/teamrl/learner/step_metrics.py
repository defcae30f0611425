"""What a learner step reports about itself: the sample's columns of its ``metrics.jsonl`` row, and
its Prometheus series (``teamrl.learner.metrics``). ``LearnerService.one_step`` calls these once a
step; only their numbers, not the training, depend on them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from teamrl.learner import metrics as M

if TYPE_CHECKING:
    from teamrl.learner.rows import StepColumns


def sample_row(steps: StepColumns, own_versions: np.ndarray, behind: int) -> dict[str, float]:
    """The sample's columns of a step's row: episodes, the team's mean reward and each agent's, and
    how far the learner's own steps (``own_versions``) lag behind version ``behind``."""
    lags = behind - own_versions
    return {
        "episodes": len(steps.traj_reward),
        "reward_mean": float(steps.traj_reward.mean()),
        **{f"reward/{a}": v for a, v in steps.mean_reward_by_agent().items()},
        "version_lag_mean": float(lags.mean()) if lags.size else 0.0,
        "version_lag_max": float(lags.max()) if lags.size else 0.0,
    }


def observe_lags(own_versions: np.ndarray, version: int) -> None:
    """Each sampled step's version lag (versions behind ``version``) into the histogram; a learner
    group passes its own agents' steps (their versions are of its base)."""
    lag_values, lag_counts = np.unique(np.maximum(0, version - own_versions), return_counts=True)
    for lag, count in zip(lag_values.tolist(), lag_counts.tolist(), strict=True):
        for _ in range(count):
            M.VERSION_LAG.observe(lag)


def gauge_step(dt: float, waited: float, metrics_of_step: dict[str, Any]) -> None:
    """Prometheus: the step's time, its share spent waiting for data, throughput, per-agent values."""
    M.STEPS.inc()
    M.STEP_SECONDS.observe(dt)
    M.DATA_WAIT_RATIO.set(waited / dt if dt > 0 else 0.0)
    M.TOKENS_PER_SECOND.set(metrics_of_step.get("tokens_per_s", 0.0))
    for key, value in metrics_of_step.items():
        head, _, agent = key.partition("/")
        if agent and head in M.PER_AGENT and math.isfinite(value):
            M.PER_AGENT[head].labels(agent).set(value)
