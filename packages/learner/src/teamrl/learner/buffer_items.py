"""One admitted trajectory (``Item``) and the episode group it belongs to (``Group``): the records
the replay buffer's parts share (``buffer_groups``, ``buffer_views``, ``buffer_state``); the rules
are in ``teamrl.learner.buffer``'s module docstring ("Groups are the unit of sampling").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from teamrl.protocol.codec import TrajectoryRow


@dataclass(eq=False)
class Item:
    key: int  # admission order; row `key` of the segment log
    row: TrajectoryRow  # the trajectory, kept in its Arrow batch
    min_version: int
    max_version: int
    steps_per_agent: dict[str, int]
    sampled: dict[str, int] = field(default_factory=dict)  # view -> times sampled, or CONSUMED
    models: dict[str, tuple[int, int]] = field(default_factory=dict)  # base model -> (min, max) version


@dataclass(eq=False)
class Group:
    group_id: str
    items: list[Item]
    born: float  # monotonic time its first episode arrived
    priority: float = 1.0  # p_g ** alpha (prioritized sampler)
    taken: dict[str, dict[int, int]] = field(default_factory=dict)  # view -> round -> the rank it went to
    serial: int = -1  # release order; its key in HeldGroups.groups once released

    @property
    def min_version(self) -> int:
        return min(it.min_version for it in self.items)


def item_versions(row: TrajectoryRow, default: int) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """(min, max, per base model) of the policy versions that can make ``row`` stale: those of its
    trained steps (sampled with an adapter). A step on base weights records version 0 however late it
    ran, and its policy is one no update changes, so it never lags: counted, it made every episode of a
    team with an untrained agent stale once the learner passed version ``max_policy_lag`` + 1 (a verifier
    trained beside a base-weights planner and solver, docs/real-model.md). A row without a trained step
    is judged by all its steps, ``default`` without any (``TrajectoryRow.versions``). Claims (a version
    above the announced one) are still checked on every step (``buffer_claims.check_frame``)."""
    per = row.versions_per_model(trained_only=True)
    if not per:
        lo, hi = row.versions(default)
        return lo, hi, row.versions_per_model()
    return min(v[0] for v in per.values()), max(v[1] for v in per.values()), per
