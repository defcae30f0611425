"""The replay buffer's policy versions, one sequence per base model, and the staleness judged
against them (``teamrl.learner.buffer``'s module docstring, "Staleness"; docs/architecture.md,
"The replay buffer"; docs/security.md, "Versions").

A version has one source: the learner of its base, which announces each version (``VersionAnnounce``)
before it publishes the adapters to rollouts. So by default (``from_data`` False) nothing else moves a
version: a frame's steps and a sample's ``min_policy_version`` are *claims*, checked against the
announced version and refused above it, whoever sends them (the CURVE ``learner`` key included). An
announcement itself may move a base forward by at most ``version_window`` (so not to 2**62 even
with the learner's key) and never backwards; the checkpoint holds only announced versions. With
``from_data`` (in-process use and older tests) versions rise with admitted steps and learners'
hints as they used to.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from teamrl.learner.buffer_errors import VersionOutOfRange, VersionUnpublished
from teamrl.learner.buffer_groups import HeldGroups
from teamrl.learner.buffer_items import Group, Item
from teamrl.learner.buffer_views import Views


class PolicyVersions:
    """The current version of every base and the lag rule (SEED RL / IMPALA policy lag) with
    ``max_policy_lag``, ``stale_action`` and ``stale_decay``. ``current`` (the highest of all) bounds
    the ``version_window``. Versions come from ``announce`` (or, ``from_data``, also from admitted
    steps and hints: see the module docstring)."""

    def __init__(
        self,
        max_policy_lag: int | None,
        stale_action: Literal["drop", "downweight"],
        stale_decay: float,
        version_window: int | None,
        from_data: bool = False,
    ) -> None:
        self.max_policy_lag = max_policy_lag
        self.stale_action = stale_action
        self.stale_decay = stale_decay
        self.version_window = version_window
        self.from_data = from_data
        self.current = -1  # highest version of any base
        self.per_base: dict[str, int] = {}  # base model id -> its current version
        self.hint = -1  # announced (or, from_data, hinted) without model_id: every base's, known or not

    def of(self, model_id: str) -> int:
        """The version staleness on base ``model_id`` is judged against (-1: nothing known)."""
        return self.per_base.get(model_id, self.hint)

    def ceiling(self) -> float:
        """The highest policy version a frame or an untrusted sample hint may carry."""
        if self.version_window is None:
            return math.inf
        return max(self.current, 0) + self.version_window

    def check(self, version: int, what: str) -> None:
        """Raise ``VersionOutOfRange`` for a ``version`` above ``ceiling()``; ``what`` names it."""
        if version > self.ceiling():
            raise VersionOutOfRange(
                f"{what} {version} is more than version_window={self.version_window} "
                f"above the current version {self.current}"
            )

    def announced(self, model_id: str | None) -> bool:
        """Whether a learner announced a version of base ``model_id`` (None: of any base)."""
        if model_id is None:
            return self.current >= 0 and not self.from_data
        return not self.from_data and (model_id in self.per_base or self.hint >= 0)

    def check_claims(self, models: Iterable[Mapping[str, tuple[int, int]]]) -> None:
        """Raise ``VersionUnpublished`` for a step above its base's announced version (bases no learner
        announced yet are judged by ``check`` alone)."""
        for per_model in models:
            for m, (_, top) in per_model.items():
                if self.announced(m) and top > self.of(m):
                    raise VersionUnpublished(
                        f"a step on base {m!r} claims policy version {top}; its learner announced {self.of(m)}"
                    )

    def check_hint(self, model_id: str | None, min_policy_version: int) -> None:
        """Raise ``VersionUnpublished`` for a sample's ``min_policy_version`` above the version announced
        for ``model_id`` (None: the highest announced); nothing announced: ``check`` alone judges."""
        if self.from_data or min_policy_version <= 0 or not self.announced(model_id):
            return
        top = self.current if model_id is None else self.of(model_id)
        if min_policy_version > top:
            raise VersionUnpublished(
                f"min_policy_version {min_policy_version} is above the announced version {top}"
                + (f" of base {model_id!r}" if model_id is not None else "")
            )

    def announce(self, model_id: str | None, version: int) -> bool:
        """Base ``model_id`` (None: every base) is published at ``version``: at most ``version_window``
        above what it was (else ``VersionOutOfRange``), never backwards. True when it moved."""
        was = self.hint if model_id is None else self.of(model_id)
        if self.version_window is not None and version > max(was, 0) + self.version_window:
            raise VersionOutOfRange(
                f"announced version {version} is more than version_window={self.version_window} "
                f"above the announced {was}"
            )
        if version <= was and (model_id is None or model_id in self.per_base):
            return False
        self.current = max(self.current, version)
        if model_id is None:
            self.hint = max(self.hint, version)
            self.per_base = {m: max(v, version) for m, v in self.per_base.items()}
        else:
            self.per_base[model_id] = max(was, version)
        return True

    def listed(self, bases: Iterable[str] = ()) -> dict[str, int]:
        """Each base's version for a report: the announced bases and ``bases`` (the plan's, which a
        one-base learner's announcement covers all at once), those with a version."""
        out = {m: self.of(m) for m in bases} | self.per_base
        return {m: v for m, v in out.items() if v >= 0}

    def observe(self, top: int, models: Mapping[str, tuple[int, int]]) -> None:
        """A trajectory arrived: ``top`` its newest step's version, ``models`` its (min, max) per base.
        Moves versions only ``from_data``."""
        if not self.from_data:
            return
        self.current = max(self.current, top)
        for m, (_, top_m) in models.items():
            self.per_base[m] = max(self.of(m), top_m)

    def take_hint(self, model_id: str | None, min_policy_version: int, trusted: bool) -> None:
        """``from_data`` only: a learner's ``min_policy_version`` raises the current version (of its
        base, or of all). Otherwise a hint moves nothing: ``check_hint`` bounded it by the announced
        version, and it only says which data the request finds too old."""
        if not self.from_data or min_policy_version < 0 or self.max_policy_lag is None:
            return
        hint = min_policy_version + self.max_policy_lag
        self.current = max(self.current, hint)
        if model_id is not None:
            # only data or a trusted learner adds a base: untrusted names cannot grow the table
            if trusted or model_id in self.per_base:
                self.per_base[model_id] = max(self.of(model_id), hint)
        else:
            self.hint = max(self.hint, hint)
            self.per_base = {m: max(v, hint) for m, v in self.per_base.items()}

    def lag(self, models: Mapping[str, tuple[int, int]]) -> int:
        """Versions the oldest step lags behind its own base, the largest over the bases (0 for none)."""
        return max((max(0, self.of(m) - lo) for m, (lo, _) in models.items()), default=0)

    def too_stale(self, lag: int) -> bool:
        return self.max_policy_lag is not None and lag > self.max_policy_lag

    def refuses(self, lag: int) -> bool:
        """Admission drops a trajectory that lags ``lag`` versions (``stale_action`` "drop")."""
        return self.too_stale(lag) and self.stale_action == "drop"

    def expired(self, oldest: int, min_policy_version: int, current: int) -> bool:
        """Data whose oldest step is ``oldest`` goes at sample time: older than the request's
        ``min_policy_version``, or (``drop``) lagging too far behind ``current``."""
        drop_lagging = self.stale_action == "drop" and self.max_policy_lag is not None
        return oldest < min_policy_version or (drop_lagging and self.too_stale(current - oldest))

    def weight(self, it: Item, model_id: str | None = None) -> float:
        """``stale_decay ** (lag - max_policy_lag)`` with ``downweight`` (lag on ``model_id``'s base,
        or behind ``current`` without one), else 1."""
        if self.stale_action != "downweight" or self.max_policy_lag is None:
            return 1.0
        if model_id is None:
            over = self.current - it.min_version - self.max_policy_lag
        elif model_id in it.models:
            over = self.of(model_id) - it.models[model_id][0] - self.max_policy_lag
        else:
            return 1.0
        return self.stale_decay ** max(0, over)

    def sweep(
        self, held: HeldGroups, views: Views, view: str, model_id: str | None, min_policy_version: int
    ) -> int:
        """Take out what a sample request finds stale; returns how many trajectories went.

        Without ``model_id``: the groups whose oldest step is older than ``min_policy_version`` or
        (``drop``) lags too far behind ``current`` are evicted. With it: a group whose oldest step
        on that base (of the items ``view`` may still take) is so is given up by that view alone,
        marked ``CONSUMED`` for it; other views keep it."""
        if model_id is None:
            return self._evict_stale(held, min_policy_version)
        return self._give_up_stale(held, views, view, model_id, min_policy_version)

    def _evict_stale(self, held: HeldGroups, min_policy_version: int) -> int:
        stale = [
            s for s, g in held.groups.items() if self.expired(g.min_version, min_policy_version, self.current)
        ]
        return sum(held.evict(s) for s in stale)

    def _give_up_stale(
        self, held: HeldGroups, views: Views, view: str, model_id: str, min_policy_version: int
    ) -> int:
        current = self.of(model_id)
        n = 0
        for g in list(held.groups.values()):
            items = views.eligible(g, view)
            lo = min((it.models[model_id][0] for it in items if model_id in it.models), default=None)
            if lo is not None and self.expired(lo, min_policy_version, current):
                views.give_up(items, view)
                n += len(items)
                held.drop_exhausted(g, views)
        return n

    def state(self) -> dict[str, Any]:
        return {
            "current_version": self.current,
            "current_versions": dict(self.per_base),
            "hint_version": self.hint,
        }

    def load(self, state: Mapping[str, Any], groups: Iterable[Group]) -> None:
        """Restore ``state()``; a state from before per-base versions derives them from ``groups``."""
        self.current = int(state["current_version"])
        self.hint = int(state.get("hint_version", -1))
        if "current_versions" in state:
            self.per_base = {str(m): int(v) for m, v in state["current_versions"].items()}
            return
        self.per_base = {}  # written before per-base versions: what the held items show
        for g in groups:
            for it in g.items:
                for m, (_, top) in it.models.items():
                    self.per_base[m] = max(self.per_base.get(m, -1), top)
