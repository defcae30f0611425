"""Replay buffer core: admission by staleness, episode groups, a Reverb-style rate limiter, three
samplers, and crash-safe persistence. In-process and single-threaded; ``buffer_service`` wraps it
in ZeroMQ. ``ReplayBuffer`` is assembled from parts in modules beside this one: ``buffer_groups``
(items, pending and held groups, sampler order), ``buffer_views`` (views, rank rounds),
``buffer_versions`` (per-base versions, staleness), ``buffer_ratelimit`` (the rate limiter),
``buffer_sources`` (the (incarnation, seq) table), ``buffer_state`` (its checkpoint state),
``buffer_segments`` (the segment store) and ``buffer_errors``.

Design decisions:

* **Groups are the unit of sampling.** GRPO-style learners compute a baseline over the episodes of
  one ``group_id`` (same task, sampled together), so a group is held back until ``group_size``
  episodes arrived (or ``group_timeout_s`` passed: then it is released as it is and counted), and
  a sample hands out whole groups. ``batch_size`` counts trajectories; groups are added in sampler
  order while they fit, so a batch never exceeds ``batch_size`` unless one group alone does. With
  ``group_size == 1`` every episode is its own group.
* **Staleness (SEED RL / IMPALA policy lag), per base model.** Each base model (step
  ``model_id``) has its own adapter-version sequence, so ``current_versions[model_id]`` is the
  version that base's learner announced (``announce``; a learner announces before it publishes, so
  a step or a hint above it is a false claim and refused: ``buffer_versions``, docs/security.md).
  With ``versions_from_data`` (in-process use, older tests) it is instead the highest step
  ``policy_version`` seen on that base, raised by a learner's hint
  ``min_policy_version + max_policy_lag`` for the request's ``model_id`` (a hint without one
  raises every base). Only the ids the plan names are admitted (``buffer_ids``). A trajectory's lag is the largest, over its bases, of that base's current
  version minus its oldest step on that base; past ``max_policy_lag`` it is refused at admission
  (``drop``) or kept with weight ``stale_decay ** (lag - max_policy_lag)`` (``downweight``). With
  one base this is the plain SEED RL rule. ``current_version`` (the highest of all) bounds the
  ``policy_version_window`` and judges requests without ``model_id`` as before: at sample time groups
  whose oldest step lags too far are evicted. A request with ``model_id`` judges only that base,
  and a group stale for it is given up by its view alone (counted ``evicted{reason="stale"}``):
  other views still get it (docs/architecture.md, "The replay buffer").
* **Rate limiting = Reverb's ``SampleToInsertRatio``.** With ``spi`` samples per insert the
  limiter keeps ``diff = inserts * spi - samples`` within ``min_size * spi +- error_buffer``:
  sampling that would push ``diff`` below the floor is refused (``rate_limited``), inserting that
  would push it above the ceiling must wait (the service then stops reading frames, so producers
  block on their credit window). Below ``min_size`` held items nothing is sampled.
* **Samplers.** ``fifo`` (oldest group first), ``uniform``, and ``prioritized`` (Schaul et al.
  2016, eq. 1: P(g) ~ p_g ** alpha, importance weight (N P(g)) ** -beta normalised by its max)
  with p_g = mean_i |r_i - mean(r)| + eps over the group's trajectory rewards: a group whose
  rewards are all equal carries no GRPO advantage, so it is sampled least.
* **Views.** A request reads one *view*: whole trajectories (``WHOLE``), or the trajectories in
  which any of a set of agents acted (one learner group's agents), named by the sorted ids joined
  by ``VIEW_SEP`` (one agent: its id). Each item counts its samples per view, and views share
  nothing else (counts, rank rounds), so one learner group's sampling never consumes or blocks
  another's. An item leaves the buffer once the whole view used it ``max_times_sampled`` times,
  or once every agent that acted in it belongs to some view that did (or gave it up as stale).
* **Ranks.** Each request of a rank opens that rank's next round of its view; a group handed out
  in round r is marked taken by that rank for that view, and no other rank of the view gets it in
  its own round r, so data-parallel ranks in lock step never train on the same trajectory in one
  step (kept for ``ROUND_WINDOW`` rounds behind the fastest rank). With ``max_times_sampled == 1``
  a handed-out item is gone from the view anyway.
* **Persistence.** Every admitted trajectory is appended to an Arrow IPC stream *segment* and
  fsync'ed; a *checkpoint* (JSON state: counters, limiter, per-base versions, the (incarnation,
  seq) table, which keys are held and how often each view sampled them, the segments it needs)
  becomes valid only once
  its ``DONE`` marker exists. The service acks frames only after the checkpoint that covers them,
  so after a crash the state is exactly the last complete checkpoint and producers resend the
  rest (docs/reliability.md R-kill-buffer). Segment rows past a checkpoint are never read back.
"""

from __future__ import annotations

import logging
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from prometheus_client import Counter, Gauge, Histogram

# ``NAME as NAME``: re-exported, for the service, the tests and older callers that import it from here
from teamrl.learner.buffer_claims import Request, check_frame, check_request
from teamrl.learner.buffer_config import BufferConfig
from teamrl.learner.buffer_errors import CorruptStore as CorruptStore
from teamrl.learner.buffer_errors import InvalidAgentId, InvalidView
from teamrl.learner.buffer_errors import ReplayBufferError as ReplayBufferError
from teamrl.learner.buffer_errors import UnknownId as UnknownId
from teamrl.learner.buffer_errors import VersionOutOfRange as VersionOutOfRange
from teamrl.learner.buffer_groups import PRIORITY_EPS as PRIORITY_EPS
from teamrl.learner.buffer_groups import GroupOrder, HeldGroups, PendingGroups, fill
from teamrl.learner.buffer_ids import KnownIds
from teamrl.learner.buffer_items import Group, Item, item_versions
from teamrl.learner.buffer_ratelimit import RateLimiter
from teamrl.learner.buffer_sources import Sources
from teamrl.learner.buffer_state import STATE_FORMAT as STATE_FORMAT
from teamrl.learner.buffer_state import buffer_state, load_buffer_state
from teamrl.learner.buffer_versions import PolicyVersions
from teamrl.learner.buffer_views import CONSUMED as CONSUMED
from teamrl.learner.buffer_views import MAX_AGENT_ID_CHARS as MAX_AGENT_ID_CHARS
from teamrl.learner.buffer_views import MAX_VIEW_AGENTS as MAX_VIEW_AGENTS
from teamrl.learner.buffer_views import ROUND_WINDOW as ROUND_WINDOW
from teamrl.learner.buffer_views import VIEW_SEP, Views, check_agent_ids
from teamrl.learner.buffer_views import WHOLE as WHOLE
from teamrl.learner.buffer_views import view_agents as view_agents
from teamrl.learner.buffer_views import view_name as view_name
from teamrl.protocol.codec import (
    TrajectoryBatch,
    TrajectoryRow,
    encode_rows,
)
from teamrl.protocol.trajectory import GraphTrajectory

log = logging.getLogger(__name__)

# --- metrics (names are fixed: the deploy dashboard and autoscalers query them) ------------------
BUFFER_SIZE = Gauge("teamrl_buffer_size", "Sampleable trajectories held by the replay buffer.")
GROUPS_PENDING = Gauge(
    "teamrl_buffer_groups_pending", "Groups still filling (not sampleable yet); set with each stats line."
)
INSERTED = Counter(
    "teamrl_buffer_inserted", "Trajectories that became sampleable (admitted; group complete or timed out)."
)
SAMPLED = Counter("teamrl_buffer_sampled", "Trajectories handed out to learner ranks.")
REJECTED = Counter(
    "teamrl_buffer_rejected", "Trajectories or frames refused at admission, by reason.", ["reason"]
)
EVICTED = Counter("teamrl_buffer_evicted", "Held trajectories removed before use, by reason.", ["reason"])
DUPLICATES = Counter(
    "teamrl_buffer_duplicates", "Data frames received again with an already-seen (incarnation, seq)."
)
GROUPS_TIMED_OUT = Counter(
    "teamrl_buffer_groups_timed_out",
    "Groups released incomplete (group_timeout_s passed, or too many pending).",
)
STALENESS = Histogram(
    "teamrl_buffer_staleness",
    "Policy versions between an admitted trajectory's oldest step and the current version.",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)


@dataclass
class InsertResult:
    """What ``insert`` did with one frame: ``accepted`` must be persisted before the frame is acked."""

    accepted: list[tuple[int, TrajectoryRow]]
    stale: int = 0
    duplicate: bool = False


@dataclass
class Sample:
    """A batch of whole groups: trajectories with their weights (importance x staleness).

    ``rows`` stay in Arrow; ``encode()`` makes the reply frame without building Python objects,
    ``trajectories`` builds them (in-process users, tests).
    """

    rows: list[TrajectoryRow]
    weights: list[float]
    keys: list[int]

    @property
    def trajectories(self) -> list[GraphTrajectory]:
        return [r.trajectory() for r in self.rows]

    def encode(self) -> pa.Buffer:
        return encode_rows(self.rows)


@dataclass
class Refused:
    """A sample request that cannot be served now; ``reason`` is the ErrorReply reason."""

    reason: str
    message: str = ""


def _rows(
    trajectories: TrajectoryBatch | Iterable[TrajectoryBatch] | Iterable[GraphTrajectory],
) -> list[TrajectoryRow]:
    """Rows of a decoded batch, of several, or of Python trajectories (checked as the encoder does)."""
    if isinstance(trajectories, TrajectoryBatch):
        return trajectories.rows()
    items = list(trajectories)
    if items and all(isinstance(b, TrajectoryBatch) for b in items):
        return [r for b in items for r in b.rows()]
    return TrajectoryBatch.from_trajectories(items).rows()


class ReplayBuffer:
    """Admission, groups, rate limiting and sampling, set by a ``BufferConfig`` (the one place the
    buffer's settings and their defaults are written; ``BufferConfig(capacity=10)`` builds one
    without a file).

    Call sequence::

        buf = ReplayBuffer(cfg)                    # cfg: BufferConfig
        res = buf.insert(trajs, source=(incarnation, seq), now=time.monotonic())
        store.append(res.accepted)                 # persist before acking the frame
        buf.expire_groups(time.monotonic())        # release incomplete groups past their timeout
        out = buf.sample(batch_size=8, rank=0)     # Sample, or Refused(reason)
        out = buf.sample(8, rank=0, agent_ids=["planner"], model_id="base-a", min_policy_version=v)
        state = buf.state_dict(now)                # JSON-able; load_state_dict(state, trajs, now)
    """

    def __init__(self, cfg: BufferConfig, *, versions_from_data: bool = False) -> None:
        """``cfg``: the ``[buffer]`` settings (only those of the buffer itself are read here; the
        service reads the rest). ``versions_from_data``: a base's current version is the highest
        step version seen on it (in-process use, older tests), not the one its learner announced."""
        self.capacity = cfg.capacity
        self.sampler = cfg.sampler
        self.group_size = cfg.group_size
        self.versions = PolicyVersions(
            cfg.max_policy_lag,
            cfg.stale_action,
            cfg.stale_decay,
            cfg.policy_version_window,
            versions_from_data,
        )
        self.ids = KnownIds(cfg.model_ids, cfg.agent_ids)
        self.limiter = RateLimiter(cfg.min_size, cfg.samples_per_insert, cfg.error_buffer)
        self._order = GroupOrder(cfg.sampler, cfg.priority_exponent, cfg.importance_exponent, cfg.seed)
        self._pending = PendingGroups(cfg.group_size, cfg.group_timeout_s, cfg.max_pending_groups)
        self._held = HeldGroups(self._order.priority)
        self._views = Views(cfg.max_times_sampled)
        self._sources = Sources()
        self.next_key = 0
        self.inserted = 0
        self.sampled = 0
        self.duplicates = 0
        self.groups_timed_out = 0
        self.rejected: Tally[str] = Tally()
        self.evicted: Tally[str] = Tally()

    # --- read-only views ----------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Sampleable trajectories held (pending groups excluded)."""
        return self._held.size

    @property
    def pending_groups(self) -> int:
        return len(self._pending.groups)

    @property
    def pending_trajectories(self) -> int:
        return len(self._pending.items())

    @property
    def current_version(self) -> int:
        """The highest version of any base (announced; ``versions_from_data``: steps and hints)."""
        return self.versions.current

    @property
    def current_versions(self) -> dict[str, int]:
        """Base model id -> its current version."""
        return self.versions.per_base

    def current_version_of(self, model_id: str) -> int:
        """The version staleness on base ``model_id`` is judged against (-1: nothing known)."""
        return self.versions.of(model_id)

    def version_ceiling(self) -> float:
        """The highest policy version a frame or an untrusted sample hint may carry."""
        return self.versions.ceiling()

    def per_agent(self) -> dict[str, int]:
        """Steps held per agent id (sampleable items only)."""
        return {a: n for a, n in self._held.steps.items() if n > 0}

    def policy_version_range(self) -> tuple[int, int]:
        """(min, max) step policy version over held items; (-1, -1) when empty."""
        return self._held.version_range()

    def keys(self) -> list[int]:
        """Sorted keys of every held and pending trajectory (what persistence must keep)."""
        return sorted(it.key for it in [*self._held.items(), *self._pending.items()])

    def seen(self) -> dict[str, list[int]]:
        """Every (incarnation -> seqs) delivered to ``insert``: what a restarted receiver must skip."""
        return {inc: s.seqs() for inc, s in self._sources.seen.items()}

    def can_insert(self, n: int = 1) -> bool:
        return self.limiter.can_insert(n, self.size)

    @property
    def _groups(self) -> OrderedDict[int, Group]:
        """The held groups by release serial, oldest first."""
        return self._held.groups

    # --- counting -----------------------------------------------------------------------------

    def count_rejected(self, reason: str, n: int = 1) -> None:
        """Count ``n`` refused trajectories or frames (the service calls this for invalid frames)."""
        self.rejected[reason] += n
        REJECTED.labels(reason=reason).inc(n)

    def count_duplicates(self, n: int) -> None:
        """Count frames the transport already recognised as duplicates."""
        if n:
            self.duplicates += n
            DUPLICATES.inc(n)

    def _count_evicted(self, reason: str, n: int) -> None:
        self.evicted[reason] += n
        EVICTED.labels(reason=reason).inc(n)

    # --- versions -----------------------------------------------------------------------------

    def announce(self, model_id: str | None, version: int, agent_ids: Iterable[str] = ()) -> bool:
        """A learner published ``version`` of base ``model_id`` (None: every base) for ``agent_ids``, the one
        source of versions (``buffer_versions``); True when it moved. Refusals counted, nothing changes."""
        agents = list(agent_ids)
        try:
            check_agent_ids(agents)
            self.ids.learn(model_id, agents, commit=False)  # raises before anything changes
            moved = self.versions.announce(model_id, version)
        except (VersionOutOfRange, InvalidAgentId, UnknownId) as e:
            self.count_rejected(e.reason)
            raise
        self.ids.learn(model_id, agents)
        return moved

    # --- insert -------------------------------------------------------------------------------

    def insert(
        self,
        trajectories: TrajectoryBatch | Iterable[TrajectoryBatch] | Iterable[GraphTrajectory],
        *,
        source: tuple[str, int] | None = None,
        now: float = 0.0,
    ) -> InsertResult:
        """Admit one frame's trajectories: its decoded batches (``decode_batches``), or Python
        trajectories. ``source`` = (incarnation, seq) of the frame; a source seen before is a
        duplicate and changes nothing. ``now`` is monotonic seconds (group ages)."""
        rows = _rows(trajectories)
        models = [r.versions_per_model() for r in rows]
        self._check_frame(rows, models)  # before any state changes: a refused frame is not recorded as seen
        if source is not None and not self._sources.first_delivery(*source):
            self.count_duplicates(1)
            return InsertResult([], duplicate=True)
        for r, per_model in zip(rows, models, strict=True):
            self.versions.observe(r.versions(-1)[1], per_model)
        res = InsertResult([])
        for r in rows:
            lo, hi, per_model = item_versions(r, self.current_version)  # its trained steps'
            lag = self.versions.lag(per_model)
            if self.versions.refuses(lag):
                self.count_rejected("stale")
                res.stale += 1
                continue
            STALENESS.observe(lag)
            item = Item(self.next_key, r, lo, hi, r.steps_per_agent(), models=per_model)
            self.next_key += 1
            res.accepted.append((item.key, r))
            for g, timed_out in self._pending.add(item, now):
                self._release(g, timed_out=timed_out)
        return res

    def _check_frame(self, rows: list[TrajectoryRow], models: list[dict[str, tuple[int, int]]]) -> None:
        """``buffer_claims.check_frame``, its refusal counted."""
        try:
            check_frame(rows, models, self.versions, self.ids)
        except (VersionOutOfRange, InvalidAgentId, UnknownId) as e:
            self.count_rejected(e.reason)
            raise

    def forget_source(self, incarnation: str) -> None:
        """Drop the de-duplication state of a producer incarnation the receiver evicted."""
        self._sources.seen.pop(incarnation, None)

    def expire_groups(self, now: float) -> int:
        """Release pending groups older than ``group_timeout_s`` as they are; returns how many."""
        expired = self._pending.expired(now)
        for g in expired:
            self._release(g, timed_out=True)
        return len(expired)

    def _release(self, g: Group, *, timed_out: bool) -> None:
        if timed_out:
            self.groups_timed_out += 1
            GROUPS_TIMED_OUT.inc()
        self._held.release(g)
        n = len(g.items)
        self.inserted += n
        self.limiter.inserts += n
        INSERTED.inc(n)
        while self.size > self.capacity and self._groups:
            self._count_evicted("capacity", self._held.evict(next(iter(self._groups))))
        BUFFER_SIZE.set(self.size)

    # --- sample -------------------------------------------------------------------------------

    def sample(
        self,
        batch_size: int,
        *,
        rank: int = 0,
        agent_id: str | None = None,
        agent_ids: Iterable[str] | None = None,
        model_id: str | None = None,
        min_policy_version: int = -1,
        trusted: bool = False,
    ) -> Sample | Refused:
        """Hand out whole groups, about ``batch_size`` trajectories (see the module docstring).
        ``agent_ids`` (or the one ``agent_id``) picks the view (None: whole trajectories);
        ``model_id`` the base whose versions ``min_policy_version`` counts in and whose staleness
        alone is judged (None: every base's, against ``current_version``). A bad request raises
        (``buffer_claims.check_request``), counted, before anything changes; ``trusted`` (the
        learner's key) matters only ``versions_from_data``: its hint then skips the window."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        view = self._checked_view(Request(rank, agent_id, agent_ids, model_id, min_policy_version), trusted)
        self.versions.take_hint(model_id, min_policy_version, trusted)
        self._drop_stale(view, model_id, min_policy_version)
        if self.size < self.limiter.min_size:
            return Refused(
                "not_enough_data", f"{self.size} trajectories held, min_size {self.limiter.min_size}"
            )
        rnd = self._views.round_of(view, rank)
        candidates = self._views.candidates(self._groups.values(), view, rnd, rank)
        if not candidates:
            shown = view.replace(VIEW_SEP, ",") or "whole"
            return Refused("not_enough_data", f"no group left for rank {rank} (view {shown!r})")
        order, importance = self._order.order([g for g, _ in candidates])
        chosen, total = fill(order, [len(items) for _, items in candidates], batch_size)
        why = self.limiter.refuse_sample(total, self.size)
        if why is not None:
            return Refused(why, f"{total} samples now would leave diff {self.limiter.diff - total}")
        out = Sample([], [], [])
        for i in chosen:
            g, items = candidates[i]
            self._views.take(g, items, view, rnd, rank)
            scale = 1.0 if importance is None else float(importance[i])
            out.rows.extend(it.row for it in items)
            out.keys.extend(it.key for it in items)
            out.weights.extend(self.versions.weight(it, model_id) * scale for it in items)
            self._held.drop_exhausted(g, self._views)
        self._views.close(view, rank, rnd, self._groups.values())
        self.sampled += total
        self.limiter.samples += total
        SAMPLED.inc(total)
        BUFFER_SIZE.set(self.size)
        return out

    def _checked_view(self, req: Request, trusted: bool) -> str:
        """``buffer_claims.check_request``, its refusal counted; the request's view name."""
        try:
            return check_request(req, trusted, self.versions, self.ids, self._views.rounds)
        except (InvalidView, VersionOutOfRange, UnknownId) as e:
            self.count_rejected(e.reason)
            raise

    def _drop_stale(self, view: str, model_id: str | None, min_policy_version: int) -> None:
        """What the request finds stale goes (``PolicyVersions.sweep``), counted as stale evictions."""
        n = self.versions.sweep(self._held, self._views, view, model_id, min_policy_version)
        if n:
            self._count_evicted("stale", n)
        BUFFER_SIZE.set(self.size)

    # --- state --------------------------------------------------------------------------------

    def state_dict(self, now: float) -> dict[str, Any]:
        """Everything but the trajectories themselves (they live in segments), JSON-able."""
        return buffer_state(self, now)

    def load_state_dict(
        self, state: Mapping[str, Any], trajectories: Mapping[int, TrajectoryRow], now: float
    ) -> None:
        """Restore ``state_dict`` output; ``trajectories`` maps every key it holds to its row. A
        state from before per-base versions (no ``current_versions``) derives them from the held
        items; the rounds and takes it has become the whole view's."""
        load_buffer_state(self, state, trajectories, now)
        BUFFER_SIZE.set(self.size)
