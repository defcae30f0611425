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
