"""What the replay buffer holds: its items and episode groups (``buffer_items``), the groups
still waiting for episodes (``PendingGroups``), the released ones samples draw from
(``HeldGroups``), and the order a sampler takes them in (``GroupOrder``). The rules are in
``teamrl.learner.buffer``'s module docstring ("Groups are the unit of sampling", "Samplers") and
docs/architecture.md, "The replay buffer".
"""

from __future__ import annotations

import logging
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Literal

import numpy as np

from teamrl.learner.buffer_items import Group, Item
from teamrl.learner.buffer_views import Views

log = logging.getLogger("teamrl.learner.buffer")  # the buffer's log, whichever module writes

PRIORITY_EPS = 1e-2  # keeps zero-advantage groups sampleable (Schaul et al. 2016, eq. 1's epsilon)


class PendingGroups:
    """Groups still waiting for episodes, oldest first: a group is released once ``group_size``
    episodes arrived (at once with ``group_size`` 1), once ``timeout_s`` passed, or when a new
    group would be one more than ``max_groups`` (then the oldest goes, incomplete)."""

    def __init__(self, group_size: int, timeout_s: float, max_groups: int) -> None:
        self.group_size = group_size
        self.timeout_s = timeout_s
        self.max_groups = max_groups
        self.groups: OrderedDict[str, Group] = OrderedDict()  # group_id -> incomplete group, oldest first

    def add(self, item: Item, now: float) -> list[tuple[Group, bool]]:
        """Put ``item`` in its group; the groups to release now, each with whether it timed out."""
        if self.group_size == 1:  # every episode is its own group
            return [(Group(item.row.group_id, [item], now), False)]
        out = []
        gid = item.row.group_id
        g = self.groups.get(gid)
        if g is None:
            if len(self.groups) >= self.max_groups:
                oldest = next(iter(self.groups))
                log.warning("more than %d groups pending: releasing %r incomplete", self.max_groups, oldest)
                out.append((self.groups.pop(oldest), True))
            g = self.groups[gid] = Group(gid, [], now)
        g.items.append(item)
        if len(g.items) >= self.group_size:
            out.append((self.groups.pop(gid), False))
        return out

    def expired(self, now: float) -> list[Group]:
        """Take out the groups older than ``timeout_s``, oldest first."""
        out = []
        while self.groups:
            gid, g = next(iter(self.groups.items()))
            if now - g.born < self.timeout_s:
                break
            log.info("group %r timed out with %d of %d episodes", gid, len(g.items), self.group_size)
            out.append(self.groups.pop(gid))
        return out

    def items(self) -> list[Item]:
        return [it for g in self.groups.values() for it in g.items]


class HeldGroups:
    """The released groups, in release order: what samples draw from. ``size`` counts the
    trajectories held and ``steps`` their steps per agent id."""

    def __init__(self, priority: Callable[[Group], float]) -> None:
        self.priority = priority  # the sampler's p_g ** alpha, set on every group held
        self.groups: OrderedDict[int, Group] = OrderedDict()  # release serial -> group (fifo order)
        self.serial = 0  # the next release's
        self.size = 0
        self.steps: Tally[str] = Tally()

    def release(self, g: Group) -> None:
        """Hold ``g`` as the newest group."""
        g.serial = self.serial
        self.serial += 1
        self.hold(g)

    def hold(self, g: Group) -> None:
        """Hold ``g`` under its serial (a released or a restored group), with its priority."""
        g.priority = self.priority(g)
        self.groups[g.serial] = g
        for it in g.items:
            self.steps.update(it.steps_per_agent)
        self.size += len(g.items)

    def evict(self, serial: int) -> int:
        """Remove a whole group; returns how many trajectories went with it."""
        g = self.groups.pop(serial)
        for it in g.items:
            self._forget(it)
        return len(g.items)

    def drop_exhausted(self, g: Group, views: Views) -> None:
        """Remove the items of ``g`` that every view is done with, and ``g`` once it is empty."""
        keep = []
        for it in g.items:
            if views.exhausted(it):
                self._forget(it)
            else:
                keep.append(it)
        g.items = keep
        if not keep:
            del self.groups[g.serial]

    def _forget(self, it: Item) -> None:
        self.size -= 1
        self.steps.subtract(it.steps_per_agent)

    def items(self) -> list[Item]:
        return [it for g in self.groups.values() for it in g.items]

    def version_range(self) -> tuple[int, int]:
        """(min, max) step policy version over the items; (-1, -1) when empty."""
        items = self.items()
        if not items:
            return -1, -1
        return min(it.min_version for it in items), max(it.max_version for it in items)

    def clear(self) -> None:
        self.groups.clear()
        self.steps.clear()
        self.size = 0


class GroupOrder:
    """The order a sample takes candidate groups in: ``fifo`` (oldest first), ``uniform``, or
    ``prioritized`` (Schaul et al. 2016, eq. 1: P(g) ~ p_g ** alpha, importance weight
    (N P(g)) ** -beta normalised by its max) with p_g = mean_i |r_i - mean(r)| + eps over the
    group's trajectory rewards."""

    def __init__(
        self, kind: Literal["fifo", "uniform", "prioritized"], alpha: float, beta: float, seed: int
    ) -> None:
        self.kind = kind
        self.alpha = alpha
        self.beta = beta
        self.rng = np.random.default_rng(seed)

    def priority(self, g: Group) -> float:
        """p_g ** alpha."""
        rewards = np.array([it.row.reward for it in g.items], dtype=np.float64)
        return (float(np.mean(np.abs(rewards - rewards.mean()))) + PRIORITY_EPS) ** self.alpha

    def order(self, candidates: list[Group]) -> tuple[Iterable[int], np.ndarray | None]:
        """Indices into ``candidates`` in the order to take them, plus each one's importance weight
        (None but for ``prioritized``)."""
        n = len(candidates)
        if self.kind == "fifo":
            return range(n), None
        if self.kind == "uniform":
            return self.rng.permutation(n).tolist(), None
        pr = np.array([g.priority for g in candidates], dtype=np.float64)
        probs = pr / pr.sum()
        # Sampling without replacement, P ~ priority: the Gumbel-top-k trick orders all candidates.
        keys = np.log(probs) + self.rng.gumbel(size=n)
        iw = (n * probs) ** -self.beta
        return np.argsort(-keys, kind="stable").tolist(), iw / iw.max()


def fill(order: Iterable[int], sizes: list[int], batch_size: int) -> tuple[list[int], int]:
    """Candidates in ``order`` while they fit in ``batch_size`` (the first always): (chosen, total)."""
    chosen: list[int] = []
    total = 0
    for i in order:
        if chosen and total + sizes[i] > batch_size:
            continue
        chosen.append(i)
        total += sizes[i]
        if total >= batch_size:
            break
    return chosen, total
