"""Replay buffer core: admission by staleness, episode groups, a Reverb-style rate limiter, three
samplers, and crash-safe persistence. In-process and single-threaded; ``buffer_service`` wraps it
in ZeroMQ.

Design decisions:

* **Groups are the unit of sampling.** GRPO-style learners compute a baseline over the episodes of
  one ``group_id`` (same task, sampled together), so a group is held back until ``group_size``
  episodes arrived (or ``group_timeout_s`` passed: then it is released as it is and counted), and
  a sample hands out whole groups. ``batch_size`` counts trajectories; groups are added in sampler
  order while they fit, so a batch never exceeds ``batch_size`` unless one group alone does. With
  ``group_size == 1`` every episode is its own group.
* **Staleness (SEED RL / IMPALA policy lag), per base model.** Each base model (step
  ``model_id``) has its own adapter-version sequence, so ``current_versions[model_id]`` is the
  highest step ``policy_version`` seen on that base, raised by a learner's hint
  ``min_policy_version + max_policy_lag`` for the request's ``model_id`` (a hint without one
  raises every base). A trajectory's lag is the largest, over its bases, of that base's current
  version minus its oldest step on that base; past ``max_policy_lag`` it is refused at admission
  (``drop``) or kept with weight ``stale_decay ** (lag - max_policy_lag)`` (``downweight``). With
  one base this is the plain SEED RL rule. ``current_version`` (the highest of all) bounds the
  ``version_window`` and judges requests without ``model_id`` as before: at sample time groups
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

import bisect
import json
import logging
import math
import os
import shutil
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from prometheus_client import Counter, Gauge, Histogram

from teamrl.protocol import schema as S
from teamrl.protocol.codec import (
    TrajectoryBatch,
    TrajectoryRow,
    decode_batches,
    encode_rows,
    rows_record_batch,
)
from teamrl.protocol.errors import ProtocolError
from teamrl.protocol.trajectory import GraphTrajectory

log = logging.getLogger(__name__)

WHOLE = ""  # the view of whole-trajectory sampling; agent views are named by agent id
VIEW_SEP = "\x1f"  # joins the sorted ids of a several-agent view; admission refuses ids holding it
CONSUMED = -1  # an item's count for a view that gave it up (stale for the view's base model)
PRIORITY_EPS = 1e-2  # keeps zero-advantage groups sampleable (Schaul et al. 2016, eq. 1's epsilon)
STATE_FORMAT = 1
ROUND_WINDOW = 64  # rounds a rank may lag the fastest one and still be kept apart from it

# --- metrics (names are fixed: the deploy dashboard and autoscalers query them) ------------------
BUFFER_SIZE = Gauge("teamrl_buffer_size", "Sampleable trajectories held by the replay buffer.")
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


class ReplayBufferError(Exception):
    """Base of the buffer's errors."""


class CorruptStore(ReplayBufferError):
    """The buffer folder holds a complete checkpoint whose data cannot be read back."""


class VersionOutOfRange(ReplayBufferError):
    """A policy version (in a frame, or a sample's ``min_policy_version``) lies more than
    ``version_window`` above the current version: refused, counted, nothing changes."""

    reason = "policy_version_out_of_range"


MAX_AGENT_ID_CHARS = 256  # as teamrl.protocol.control.Id (BufferStats.per_agent keys, SampleRequest)
MAX_VIEW_AGENTS = 256  # as teamrl.protocol.control.MAX_SAMPLE_AGENTS


def _nameable(agent_id: str) -> bool:
    return 1 <= len(agent_id) <= MAX_AGENT_ID_CHARS and VIEW_SEP not in agent_id


class InvalidAgentId(ReplayBufferError):
    """A step's agent id is empty, longer than ``MAX_AGENT_ID_CHARS``, or holds ``VIEW_SEP``: no
    control message could name it (one such frame made every later BufferStats reply fail its
    schema), or its name could be taken for a view of several agents, so the frame is refused,
    counted, and nothing changes."""

    reason = "invalid_agent_id"


class InvalidView(ReplayBufferError):
    """A sample request names its agents wrongly: both ``agent_id`` and ``agent_ids``, an empty
    list, more than ``MAX_VIEW_AGENTS`` ids, or an id no admitted step can carry. Refused and
    counted before anything changes."""

    reason = "invalid_agent_ids"


def view_name(agent_id: str | None = None, agent_ids: Iterable[str] | None = None) -> str:
    """The view a request reads: ``WHOLE`` (no agents; ``agent_id`` "" too, as before), one
    agent's id, or the sorted distinct ids joined by ``VIEW_SEP``. Raises ``InvalidView``."""
    if agent_ids is None:
        if not agent_id:
            return WHOLE
        ids = [agent_id]
    elif agent_id is not None:
        raise InvalidView("set agent_id or agent_ids, not both")
    elif isinstance(agent_ids, str):
        raise InvalidView("agent_ids is a list of agent ids, not one id")
    else:
        ids = sorted(set(agent_ids))
        if not ids:
            raise InvalidView("agent_ids is empty (None asks for whole trajectories)")
        if len(ids) > MAX_VIEW_AGENTS:
            raise InvalidView(f"{len(ids)} agent ids: at most {MAX_VIEW_AGENTS}")
    bad = next((a for a in ids if not _nameable(a)), None)
    if bad is not None:
        raise InvalidView(
            f"agent id of {len(bad)} characters (1..{MAX_AGENT_ID_CHARS} allowed, without {VIEW_SEP!r})"
        )
    return VIEW_SEP.join(ids)


@lru_cache(maxsize=4096)
def view_agents(view: str) -> frozenset[str]:
    """The agent ids of a view name (empty for ``WHOLE``)."""
    return frozenset(view.split(VIEW_SEP)) if view else frozenset()


# --------------------------------------------------------------------------------------------
# rate limiter


class RateLimiter:
    """Reverb's ``SampleToInsertRatio`` (plus its ``MinSize``) over trajectory counts.

    ``inserts``/``samples`` only grow; ``size`` is what is held now. Invariant kept (once
    ``min_size`` is reached): ``min_diff <= inserts * spi - samples <= max_diff`` up to one
    insert's overshoot, which ``error_buffer >= max(1, spi) * group_size`` absorbs.
    """

    def __init__(self, min_size: int, samples_per_insert: float | None, error_buffer: float) -> None:
        self.min_size = min_size
        self.spi = samples_per_insert
        self.error_buffer = error_buffer
        self.inserts = 0
        self.samples = 0
        if samples_per_insert is not None:
            self.min_diff = min_size * samples_per_insert - error_buffer
            self.max_diff = min_size * samples_per_insert + error_buffer

    @property
    def diff(self) -> float:
        return self.inserts * (self.spi or 0.0) - self.samples

    def can_insert(self, n: int, size: int) -> bool:
        if self.spi is None or size + n <= self.min_size:
            return True
        return (self.inserts + n) * self.spi - self.samples <= self.max_diff

    def refuse_sample(self, n: int, size: int) -> str | None:
        """None when ``n`` samples may go out now, else the refusal reason."""
        if size < self.min_size:
            return "not_enough_data"
        if self.spi is not None and self.diff - n < self.min_diff:
            return "rate_limited"
        return None


# --------------------------------------------------------------------------------------------
# the buffer


class _SeqSet:
    """Seqs seen from one producer incarnation: a low watermark plus the sparse set above it."""

    def __init__(self, low: int = 0, above: Iterable[int] = ()) -> None:
        self.low = low
        self.above = set(above)

    def __contains__(self, seq: int) -> bool:
        return seq < self.low or seq in self.above

    def add(self, seq: int) -> None:
        self.above.add(seq)
        while self.low in self.above:
            self.above.discard(self.low)
            self.low += 1

    def seqs(self) -> list[int]:
        return list(range(self.low)) + sorted(self.above)


@dataclass(eq=False)
class _Item:
    key: int  # admission order; row `key` of the segment log
    row: TrajectoryRow  # the trajectory, kept in its Arrow batch
    min_version: int
    max_version: int
    steps_per_agent: dict[str, int]
    sampled: dict[str, int] = field(default_factory=dict)  # view -> times sampled, or CONSUMED
    models: dict[str, tuple[int, int]] = field(default_factory=dict)  # base model -> (min, max) version


@dataclass(eq=False)
class _Group:
    group_id: str
    items: list[_Item]
    born: float  # monotonic time its first episode arrived
    priority: float = 1.0  # p_g ** alpha (prioritized sampler)
    taken: dict[str, dict[int, int]] = field(default_factory=dict)  # view -> round -> the rank it went to
    serial: int = -1  # release order; its key in ReplayBuffer._groups once released

    @property
    def min_version(self) -> int:
        return min(it.min_version for it in self.items)


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


def _fill(order: Iterable[int], sizes: list[int], batch_size: int) -> tuple[list[int], int]:
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


class ReplayBuffer:
    """Admission, groups, rate limiting and sampling; plain arguments (see ``BufferConfig``).

    Call sequence::

        buf = ReplayBuffer(**cfg.buffer_kwargs())
        res = buf.insert(trajs, source=(incarnation, seq), now=time.monotonic())
        store.append(res.accepted)                 # persist before acking the frame
        buf.expire_groups(time.monotonic())        # release incomplete groups past their timeout
        out = buf.sample(batch_size=8, rank=0)     # Sample, or Refused(reason)
        out = buf.sample(8, rank=0, agent_ids=["planner"], model_id="base-a", min_policy_version=v)
        state = buf.state_dict(now)                # JSON-able; load_state_dict(state, trajs, now)
    """

    def __init__(
        self,
        *,
        capacity: int = 100_000,
        sampler: Literal["fifo", "uniform", "prioritized"] = "fifo",
        max_times_sampled: int = 1,
        priority_exponent: float = 0.6,
        importance_exponent: float = 0.4,
        seed: int = 0,
        min_size: int = 1,
        samples_per_insert: float | None = None,
        error_buffer: float = 100.0,
        max_policy_lag: int | None = 4,
        stale_action: Literal["drop", "downweight"] = "drop",
        stale_decay: float = 0.5,
        group_size: int = 1,
        group_timeout_s: float = 120.0,
        max_pending_groups: int = 10_000,
        version_window: int | None = 10_000,
    ) -> None:
        if sampler not in ("fifo", "uniform", "prioritized"):
            raise ValueError(f"sampler must be fifo, uniform or prioritized, got {sampler!r}")
        if stale_action not in ("drop", "downweight"):
            raise ValueError(f"stale_action must be drop or downweight, got {stale_action!r}")
        if capacity < 1 or group_size < 1 or max_pending_groups < 1:
            raise ValueError("capacity, group_size and max_pending_groups must be >= 1")
        self.capacity = capacity
        self.sampler = sampler
        self.max_times_sampled = max_times_sampled
        self.alpha = priority_exponent
        self.beta = importance_exponent
        self.max_policy_lag = max_policy_lag
        self.stale_action = stale_action
        self.stale_decay = stale_decay
        self.group_size = group_size
        self.group_timeout_s = group_timeout_s
        self.max_pending_groups = max_pending_groups
        self.version_window = version_window
        self.limiter = RateLimiter(min_size, samples_per_insert, error_buffer)
        self._rng = np.random.default_rng(seed)
        self._groups: OrderedDict[int, _Group] = OrderedDict()  # release serial -> group (fifo order)
        self._pending: OrderedDict[str, _Group] = OrderedDict()  # group_id -> incomplete group, oldest first
        self._serial = 0
        self._size = 0
        self._per_agent: Tally[str] = Tally()
        self._seen: dict[str, _SeqSet] = {}
        self._rounds: dict[str, dict[int, int]] = {}  # view -> rank -> its next round
        self.next_key = 0
        self.current_version = -1  # highest version of any base (steps and hints)
        self.current_versions: dict[str, int] = {}  # base model id -> its current version
        self._hint_version = -1  # highest hint without model_id: raises every base, known or not
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
        return self._size

    @property
    def pending_groups(self) -> int:
        return len(self._pending)

    @property
    def pending_trajectories(self) -> int:
        return sum(len(g.items) for g in self._pending.values())

    def per_agent(self) -> dict[str, int]:
        """Steps held per agent id (sampleable items only)."""
        return {a: n for a, n in self._per_agent.items() if n > 0}

    def policy_version_range(self) -> tuple[int, int]:
        """(min, max) step policy version over held items; (-1, -1) when empty."""
        items = [it for g in self._groups.values() for it in g.items]
        if not items:
            return -1, -1
        return min(it.min_version for it in items), max(it.max_version for it in items)

    def current_version_of(self, model_id: str) -> int:
        """The version staleness on base ``model_id`` is judged against (-1: nothing known)."""
        return self.current_versions.get(model_id, self._hint_version)

    def keys(self) -> list[int]:
        """Sorted keys of every held and pending trajectory (what persistence must keep)."""
        out = [it.key for g in self._groups.values() for it in g.items]
        out += [it.key for g in self._pending.values() for it in g.items]
        return sorted(out)

    def seen(self) -> dict[str, list[int]]:
        """Every (incarnation -> seqs) delivered to ``insert``: what a restarted receiver must skip."""
        return {inc: s.seqs() for inc, s in self._seen.items()}

    def can_insert(self, n: int = 1) -> bool:
        return self.limiter.can_insert(n, self._size)

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

    def _evict(self, serial: int, reason: str) -> None:
        g = self._groups.pop(serial)
        for it in g.items:
            self._forget(it)
        self.evicted[reason] += len(g.items)
        EVICTED.labels(reason=reason).inc(len(g.items))

    def _forget(self, it: _Item) -> None:
        self._size -= 1
        self._per_agent.subtract(it.steps_per_agent)
        BUFFER_SIZE.set(self._size)

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
        top = max((r.versions(-1)[1] for r in rows), default=-1)
        if top > self.version_ceiling():  # before any state changes: the frame is not recorded as seen
            self.count_rejected(VersionOutOfRange.reason)
            raise VersionOutOfRange(
                f"policy version {top} is more than version_window={self.version_window} above the "
                f"current version {self.current_version}"
            )
        bad = next((a for r in rows for a in r.steps_per_agent() if not _nameable(a)), None)
        if bad is not None:  # before any state changes, like the version check
            self.count_rejected(InvalidAgentId.reason)
            raise InvalidAgentId(
                f"agent id of {len(bad)} characters: 1..{MAX_AGENT_ID_CHARS} allowed, without {VIEW_SEP!r}"
            )
        if source is not None:
            inc, seq = source
            seen = self._seen.get(inc)
            if seen is None:  # the receiver's rule: the first seq of an incarnation is its low mark
                seen = self._seen[inc] = _SeqSet(low=seq)
            if seq in seen:
                self.count_duplicates(1)
                return InsertResult([], duplicate=True)
            seen.add(seq)
        models = [r.versions_per_model() for r in rows]
        for r, per_model in zip(rows, models, strict=True):
            self.current_version = max(self.current_version, r.versions(-1)[1])
            for m, (_, top_m) in per_model.items():
                self.current_versions[m] = max(self.current_version_of(m), top_m)
        res = InsertResult([])
        for r, per_model in zip(rows, models, strict=True):
            lo, hi = r.versions(self.current_version)
            lag = self._lag(per_model)
            if self._too_stale(lag) and self.stale_action == "drop":
                self.count_rejected("stale")
                res.stale += 1
                continue
            STALENESS.observe(lag)
            item = _Item(self.next_key, r, lo, hi, r.steps_per_agent(), models=per_model)
            self.next_key += 1
            res.accepted.append((item.key, r))
            self._admit(item, now)
        return res

    def version_ceiling(self) -> float:
        """The highest policy version a frame or an untrusted sample hint may carry."""
        if self.version_window is None:
            return math.inf
        return max(self.current_version, 0) + self.version_window

    def forget_source(self, incarnation: str) -> None:
        """Drop the de-duplication state of a producer incarnation the receiver evicted."""
        self._seen.pop(incarnation, None)

    def _too_stale(self, lag: int) -> bool:
        return self.max_policy_lag is not None and lag > self.max_policy_lag

    def _lag(self, models: Mapping[str, tuple[int, int]]) -> int:
        """Versions the oldest step lags behind its own base, the largest over the bases (0 for none)."""
        return max((max(0, self.current_version_of(m) - lo) for m, (lo, _) in models.items()), default=0)

    def _admit(self, item: _Item, now: float) -> None:
        if self.group_size == 1:
            self._release(_Group(item.row.group_id, [item], now), timed_out=False)
            return
        gid = item.row.group_id
        g = self._pending.get(gid)
        if g is None:
            if len(self._pending) >= self.max_pending_groups:
                oldest = next(iter(self._pending))
                log.warning(
                    "more than %d groups pending: releasing %r incomplete", self.max_pending_groups, oldest
                )
                self._release(self._pending.pop(oldest), timed_out=True)
            g = self._pending[gid] = _Group(gid, [], now)
        g.items.append(item)
        if len(g.items) >= self.group_size:
            self._release(self._pending.pop(gid), timed_out=False)

    def _release(self, g: _Group, *, timed_out: bool) -> None:
        if timed_out:
            self.groups_timed_out += 1
            GROUPS_TIMED_OUT.inc()
        rewards = np.array([it.row.reward for it in g.items], dtype=np.float64)
        p = float(np.mean(np.abs(rewards - rewards.mean()))) + PRIORITY_EPS
        g.priority = p**self.alpha
        g.serial = self._serial
        self._groups[g.serial] = g
        self._serial += 1
        n = len(g.items)
        for it in g.items:
            self._per_agent.update(it.steps_per_agent)
        self._size += n
        self.inserted += n
        self.limiter.inserts += n
        INSERTED.inc(n)
        while self._size > self.capacity and self._groups:
            self._evict(next(iter(self._groups)), "capacity")
        BUFFER_SIZE.set(self._size)

    def expire_groups(self, now: float) -> int:
        """Release pending groups older than ``group_timeout_s`` as they are; returns how many."""
        n = 0
        while self._pending:
            gid, g = next(iter(self._pending.items()))
            if now - g.born < self.group_timeout_s:
                break
            log.info("group %r timed out with %d of %d episodes", gid, len(g.items), self.group_size)
            self._release(self._pending.pop(gid), timed_out=True)
            n += 1
        return n

    # --- sample -------------------------------------------------------------------------------

    def _eligible_items(self, g: _Group, view: str) -> list[_Item]:
        """The items of ``g`` the view may still take: one of its agents acted, not used up."""
        m = self.max_times_sampled
        agents = view_agents(view)
        out = []
        for it in g.items:
            n = it.sampled.get(view, 0)
            if n == CONSUMED or (m and n >= m):
                continue
            if view == WHOLE or not agents.isdisjoint(it.steps_per_agent):
                out.append(it)
        return out

    def _used_up(self, n: int) -> bool:
        return n == CONSUMED or (self.max_times_sampled > 0 and n >= self.max_times_sampled)

    def _exhausted(self, it: _Item) -> bool:
        """The whole view used it up, or every agent that acted in it is in a view that did."""
        if self._used_up(it.sampled.get(WHOLE, 0)):
            return True
        if not it.steps_per_agent:
            return False
        covered: set[str] = set()
        for view, n in it.sampled.items():
            if view != WHOLE and self._used_up(n):
                covered |= view_agents(view)
        return covered.issuperset(it.steps_per_agent)

    def _evict_stale(self, min_policy_version: int) -> None:
        drop_lagging = self.stale_action == "drop" and self.max_policy_lag is not None
        for serial, g in list(self._groups.items()):
            lo = g.min_version
            if lo < min_policy_version or (drop_lagging and self._too_stale(self.current_version - lo)):
                self._evict(serial, "stale")

    def _give_up_stale(self, view: str, model_id: str, min_policy_version: int) -> None:
        """A request with ``model_id``: groups whose oldest step on that base is older than
        ``min_policy_version`` or (``drop``) lags too far are given up by this view alone: marked
        ``CONSUMED`` for it and counted as stale evictions; other views keep them."""
        drop_lagging = self.stale_action == "drop" and self.max_policy_lag is not None
        current = self.current_version_of(model_id)
        n = 0
        for g in list(self._groups.values()):
            items = self._eligible_items(g, view)
            lo = min((it.models[model_id][0] for it in items if model_id in it.models), default=None)
            if lo is None:
                continue
            if lo < min_policy_version or (drop_lagging and self._too_stale(current - lo)):
                for it in items:
                    it.sampled[view] = CONSUMED
                n += len(items)
                self._drop_exhausted(g)
        if n:
            self.evicted["stale"] += n
            EVICTED.labels(reason="stale").inc(n)

    def _stale_weight(self, it: _Item, model_id: str | None = None) -> float:
        if self.stale_action != "downweight" or self.max_policy_lag is None:
            return 1.0
        if model_id is None:
            over = self.current_version - it.min_version - self.max_policy_lag
        elif model_id in it.models:
            over = self.current_version_of(model_id) - it.models[model_id][0] - self.max_policy_lag
        else:
            return 1.0
        return self.stale_decay ** max(0, over)

    def _order(self, candidates: list[_Group]) -> tuple[Iterable[int], np.ndarray | None]:
        """Indices into ``candidates`` in the order to take them, plus P(g) for prioritized."""
        n = len(candidates)
        if self.sampler == "fifo":
            return range(n), None
        if self.sampler == "uniform":
            return self._rng.permutation(n).tolist(), None
        pr = np.array([g.priority for g in candidates], dtype=np.float64)
        probs = pr / pr.sum()
        # Sampling without replacement, P ~ priority: the Gumbel-top-k trick orders all candidates.
        keys = np.log(probs) + self._rng.gumbel(size=n)
        return np.argsort(-keys, kind="stable").tolist(), probs

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

        ``agent_ids`` (or the one ``agent_id``) picks the view: the groups' items in which any of
        them acted; None: whole trajectories. ``model_id`` is the base whose versions
        ``min_policy_version`` counts in and whose staleness alone is judged (a base no data named
        yet is added only by a ``trusted`` hint); None: every base's, against
        ``current_version``. A malformed agent list raises ``InvalidView``, an untrusted
        ``min_policy_version`` above ``version_ceiling()`` raises ``VersionOutOfRange``, both
        counted, before anything changes; ``trusted`` (a learner authenticated by its key) skips
        the window, so its hint is the announcement the window is measured from."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        view = self._checked_view(agent_id, agent_ids, min_policy_version, trusted)
        self._take_hint(model_id, min_policy_version, trusted)
        if model_id is None:
            self._evict_stale(min_policy_version)
        else:
            self._give_up_stale(view, model_id, min_policy_version)
        if self._size < self.limiter.min_size:
            return Refused(
                "not_enough_data", f"{self._size} trajectories held, min_size {self.limiter.min_size}"
            )
        rnd = self._rounds.get(view, {}).get(rank, 0)
        candidates = [
            (g, items)
            for g in self._groups.values()
            if g.taken.get(view, {}).get(rnd, rank) == rank and (items := self._eligible_items(g, view))
        ]
        if not candidates:
            shown = view.replace(VIEW_SEP, ",") or "whole"
            return Refused("not_enough_data", f"no group left for rank {rank} (view {shown!r})")
        order, probs = self._order([g for g, _ in candidates])
        chosen, total = _fill(order, [len(items) for _, items in candidates], batch_size)
        why = self.limiter.refuse_sample(total, self._size)
        if why is not None:
            return Refused(why, f"{total} samples now would leave diff {self.limiter.diff - total}")
        iw = None
        if probs is not None:
            iw = (len(candidates) * probs) ** -self.beta
            iw = iw / iw.max()
        out = Sample([], [], [])
        for i in chosen:
            g, items = candidates[i]
            g.taken.setdefault(view, {})[rnd] = rank
            for it in items:
                it.sampled[view] = it.sampled.get(view, 0) + 1
                out.rows.append(it.row)
                out.keys.append(it.key)
                out.weights.append(
                    self._stale_weight(it, model_id) * (float(iw[i]) if iw is not None else 1.0)
                )
            self._drop_exhausted(g)
        self._rounds.setdefault(view, {})[rank] = rnd + 1
        self._prune_taken(view)
        self.sampled += total
        self.limiter.samples += total
        SAMPLED.inc(total)
        BUFFER_SIZE.set(self._size)
        return out

    def _checked_view(
        self, agent_id: str | None, agent_ids: Iterable[str] | None, min_policy_version: int, trusted: bool
    ) -> str:
        """The request's view name; a malformed agent list (``InvalidView``) or an untrusted hint above
        the version window (``VersionOutOfRange``) is counted and raised before anything changes."""
        try:
            view = view_name(agent_id, agent_ids)
        except InvalidView:
            self.count_rejected(InvalidView.reason)
            raise
        if not trusted and min_policy_version > self.version_ceiling():
            self.count_rejected(VersionOutOfRange.reason)
            raise VersionOutOfRange(
                f"min_policy_version {min_policy_version} is more than version_window={self.version_window} "
                f"above the current version {self.current_version}"
            )
        return view

    def _take_hint(self, model_id: str | None, min_policy_version: int, trusted: bool) -> None:
        """A learner's ``min_policy_version`` raises the current version (of its base, or of all)."""
        if min_policy_version < 0 or self.max_policy_lag is None:
            return
        hint = min_policy_version + self.max_policy_lag
        self.current_version = max(self.current_version, hint)
        if model_id is not None:
            # only data or a trusted learner adds a base: untrusted names cannot grow the table
            if trusted or model_id in self.current_versions:
                self.current_versions[model_id] = max(self.current_version_of(model_id), hint)
        else:
            self._hint_version = max(self._hint_version, hint)
            self.current_versions = {m: max(v, hint) for m, v in self.current_versions.items()}

    def _drop_exhausted(self, g: _Group) -> None:
        keep = []
        for it in g.items:
            if self._exhausted(it):
                self._forget(it)
            else:
                keep.append(it)
        g.items = keep
        if not keep:
            del self._groups[g.serial]

    def _prune_taken(self, view: str) -> None:
        # Not min over the ranks seen: a rank that has not asked yet is still in round 0.
        oldest = max(self._rounds[view].values()) - ROUND_WINDOW
        for g in self._groups.values():
            taken = g.taken.get(view)
            if not taken:
                continue
            for r in [r for r in taken if r < oldest]:
                del taken[r]
            if not taken:
                del g.taken[view]

    # --- state --------------------------------------------------------------------------------

    def state_dict(self, now: float) -> dict[str, Any]:
        """Everything but the trajectories themselves (they live in segments), JSON-able."""

        def items(g: _Group) -> list[list[Any]]:
            return [[it.key, it.sampled] for it in g.items]

        def taken(g: _Group, view: str) -> dict[int, int]:
            return g.taken.get(view, {})

        return {
            "format": STATE_FORMAT,
            "next_key": self.next_key,
            "current_version": self.current_version,
            "current_versions": dict(self.current_versions),
            "hint_version": self._hint_version,
            "serial": self._serial,
            "counters": {
                "inserted": self.inserted,
                "sampled": self.sampled,
                "duplicates": self.duplicates,
                "groups_timed_out": self.groups_timed_out,
                "rejected": dict(self.rejected),
                "evicted": dict(self.evicted),
            },
            "limiter": {"inserts": self.limiter.inserts, "samples": self.limiter.samples},
            # the whole view's rounds and takes under the keys older states used; other views apart
            "rounds": {str(r): n for r, n in self._rounds.get(WHOLE, {}).items()},
            "view_rounds": {
                v: {str(r): n for r, n in rounds.items()} for v, rounds in self._rounds.items() if v != WHOLE
            },
            "seen": {inc: [s.low, sorted(s.above)] for inc, s in self._seen.items()},
            "groups": [
                {
                    "serial": serial,
                    "group_id": g.group_id,
                    "items": items(g),
                    "taken": taken(g, WHOLE),
                    "view_taken": {v: t for v, t in g.taken.items() if v != WHOLE},
                }
                for serial, g in self._groups.items()
            ],
            "pending": [
                {"group_id": g.group_id, "items": items(g), "age_s": max(0.0, now - g.born)}
                for g in self._pending.values()
            ],
            "rng": self._rng.bit_generator.state,
        }

    def load_state_dict(
        self, state: Mapping[str, Any], trajectories: Mapping[int, TrajectoryRow], now: float
    ) -> None:
        """Restore ``state_dict`` output; ``trajectories`` maps every key it holds to its row. A
        state from before per-base versions (no ``current_versions``) derives them from the held
        items; the rounds and takes it has become the whole view's."""
        if state.get("format") != STATE_FORMAT:
            raise CorruptStore(f"buffer state format {state.get('format')!r}, expected {STATE_FORMAT}")

        def rebuild(entries: list[list[Any]]) -> list[_Item]:
            out = []
            for key, sampled in entries:
                t = trajectories.get(int(key))
                if t is None:
                    raise CorruptStore(f"checkpoint holds key {key} but no segment row has it")
                lo, hi = t.versions(-1)
                item = _Item(int(key), t, lo, hi, t.steps_per_agent(), dict(sampled), t.versions_per_model())
                out.append(item)
            return out

        def rounds(entry: Mapping[str, Any]) -> dict[int, int]:
            return {int(r): int(n) for r, n in entry.items()}

        c = state["counters"]
        self.next_key = int(state["next_key"])
        self.current_version = int(state["current_version"])
        self._serial = int(state["serial"])
        self.inserted, self.sampled = int(c["inserted"]), int(c["sampled"])
        self.duplicates, self.groups_timed_out = int(c["duplicates"]), int(c["groups_timed_out"])
        self.rejected, self.evicted = Tally(c["rejected"]), Tally(c["evicted"])
        self.limiter.inserts = int(state["limiter"]["inserts"])
        self.limiter.samples = int(state["limiter"]["samples"])
        self._rounds = {WHOLE: rounds(state["rounds"])} if state["rounds"] else {}
        self._rounds.update({v: rounds(r) for v, r in state.get("view_rounds", {}).items() if r})
        self._seen = {inc: _SeqSet(int(low), above) for inc, (low, above) in state["seen"].items()}
        self._groups.clear()
        self._pending.clear()
        self._per_agent.clear()
        self._size = 0
        for entry in state["groups"]:
            g = _Group(entry["group_id"], rebuild(entry["items"]), 0.0, serial=int(entry["serial"]))
            taken = {WHOLE: entry["taken"], **entry.get("view_taken", {})}
            g.taken = {v: rounds(t) for v, t in taken.items() if t}
            rewards = np.array([it.row.reward for it in g.items], dtype=np.float64)
            g.priority = (float(np.mean(np.abs(rewards - rewards.mean()))) + PRIORITY_EPS) ** self.alpha
            self._groups[g.serial] = g
            for it in g.items:
                self._per_agent.update(it.steps_per_agent)
            self._size += len(g.items)
        for entry in state["pending"]:
            self._pending[entry["group_id"]] = _Group(
                entry["group_id"], rebuild(entry["items"]), now - float(entry["age_s"])
            )
        self._rng.bit_generator.state = state["rng"]
        self._hint_version = int(state.get("hint_version", -1))
        if "current_versions" in state:
            self.current_versions = {str(m): int(v) for m, v in state["current_versions"].items()}
        else:  # written before per-base versions: what the held items show
            self.current_versions = {}
            for g in [*self._groups.values(), *self._pending.values()]:
                for it in g.items:
                    for m, (_, top) in it.models.items():
                        self.current_versions[m] = max(self.current_versions.get(m, -1), top)
        BUFFER_SIZE.set(self._size)


# --------------------------------------------------------------------------------------------
# persistence


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class _Segment:
    name: str
    first_key: int
    rows: int = 0


class SegmentStore:
    """Arrow IPC segment files plus checkpoints with a DONE marker, under one folder.

    Layout: ``segments/seg-NNNNNNNN.arrow`` (Arrow IPC *stream* of ``TRAJECTORY_SCHEMA``, one
    record batch per ``append``, rows in key order, contiguous from the segment's ``first_key``)
    and ``checkpoints/ckpt-NNNNNNNN/{state.json, DONE}``. Call sequence::

        store = SegmentStore(folder, fsync=True, keep_checkpoints=2)
        state, trajs = store.load()              # (None, {}) for a fresh folder
        if state: buf.load_state_dict(state, trajs, now)
        store.append(res.accepted)               # durable when it returns (written + fsync)
        store.checkpoint(buf.state_dict(now), buf.keys())   # complete when it returns
        store.close()

    A checkpoint lists the segments (and how many of their rows) it needs; only those rows are
    ever read back, so a torn tail written after it is harmless. After a restart appends go to a
    new segment. Segments no kept checkpoint needs are deleted.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        fsync: bool = True,
        keep_checkpoints: int = 2,
        segment_bytes: int = 64 << 20,
    ) -> None:
        self.folder = Path(folder)
        self.fsync = fsync
        self.keep_checkpoints = keep_checkpoints
        self.segment_bytes = segment_bytes
        self._seg_dir = self.folder / "segments"
        self._ckpt_dir = self.folder / "checkpoints"
        self._seg_dir.mkdir(parents=True, exist_ok=True)
        self._ckpt_dir.mkdir(parents=True, exist_ok=True)
        self._segments: list[_Segment] = []  # needed by the state in memory, oldest first
        self._needs: dict[int, set[str]] = {}  # complete checkpoint number -> segment names it needs
        self._file: Any = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._next_segment = 1 + max((self._number(p) for p in self._seg_dir.glob("seg-*.arrow")), default=0)
        self._next_ckpt = 1 + max((self._number(p) for p in self._ckpt_dir.glob("ckpt-*")), default=0)
        self.checkpoints_written = 0

    @staticmethod
    def _number(p: Path) -> int:
        try:
            return int(p.name.split("-", 1)[1].split(".", 1)[0])
        except (IndexError, ValueError):
            return 0

    def _complete(self) -> list[Path]:
        """Complete checkpoint folders, newest first."""
        found = [p for p in self._ckpt_dir.glob("ckpt-*") if (p / "DONE").is_file()]
        return sorted(found, key=self._number, reverse=True)

    # --- load ---------------------------------------------------------------------------------

    def load(self) -> tuple[dict[str, Any] | None, dict[int, TrajectoryRow]]:
        """The newest complete checkpoint's buffer state and the trajectories it holds."""
        for ckpt in self._complete():
            try:
                doc = json.loads((ckpt / "state.json").read_text())
            except (OSError, ValueError) as e:
                log.error("checkpoint %s has DONE but unreadable state (%s); trying an older one", ckpt, e)
                continue
            self._segments = [
                _Segment(s["name"], int(s["first_key"]), int(s["rows"])) for s in doc["segments"]
            ]
            self._needs[self._number(ckpt)] = {s.name for s in self._segments}
            wanted = set(doc["keys"])
            trajs: dict[int, TrajectoryRow] = {}
            for seg in self._segments:
                if any(seg.first_key <= k < seg.first_key + seg.rows for k in wanted):
                    trajs.update(self._read(seg, wanted))
            log.info("loaded checkpoint %s: %d trajectories", ckpt.name, len(trajs))
            return doc["buffer"], trajs
        return None, {}

    def _read(self, seg: _Segment, wanted: set[int]) -> dict[int, TrajectoryRow]:
        path = self._seg_dir / seg.name
        out: dict[int, TrajectoryRow] = {}
        key = seg.first_key
        try:
            reader = pa.ipc.MessageReader.open_stream(pa.memory_map(str(path)))
            head = reader.read_next_message().serialize().to_pybytes()
            while key < seg.first_key + seg.rows:
                msg = reader.read_next_message()
                # Each batch is re-framed as a one-batch stream so it goes through the validating
                # decoder: bytes on disk after a crash are as foreign as bytes off the wire.
                for batch in decode_batches(head + msg.serialize().to_pybytes()):
                    for row in batch.rows():
                        if key in wanted:
                            out[key] = row
                        key += 1
        except (OSError, StopIteration, pa.ArrowException, ProtocolError) as e:
            raise CorruptStore(
                f"segment {path}: cannot read row {key - seg.first_key} of {seg.rows}: {e}"
            ) from e
        return out

    # --- write --------------------------------------------------------------------------------

    def _open_segment(self, first_key: int) -> None:
        self._close_segment()
        name = f"seg-{self._next_segment:08d}.arrow"
        self._next_segment += 1
        self._file = open(self._seg_dir / name, "wb")  # noqa: SIM115 -- lives until rotation/close
        self._writer = pa.ipc.new_stream(self._file, S.TRAJECTORY_SCHEMA)
        self._sync()
        if self.fsync:
            _fsync_dir(self._seg_dir)
        self._segments.append(_Segment(name, first_key))

    def _close_segment(self) -> None:
        if self._writer is not None:
            self._writer.close()  # writes the end-of-stream marker
            self._sync()
            self._file.close()
            self._writer = self._file = None

    def _sync(self) -> None:
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def append(self, accepted: list[tuple[int, TrajectoryRow]]) -> None:
        """Append (key, row) pairs, keys increasing; durable when this returns. A whole decoded
        frame is written as the record batch it arrived in (no re-encoding)."""
        if not accepted:
            return
        first = accepted[0][0]
        seg = self._segments[-1] if self._segments and self._writer is not None else None
        if (
            seg is None
            or seg.first_key + seg.rows != first
            or self._file.tell() >= self.segment_bytes
            or any(k != first + i for i, (k, _) in enumerate(accepted))
        ):
            if any(k != first + i for i, (k, _) in enumerate(accepted)):
                raise ValueError("append needs consecutive keys")
            self._open_segment(first)
            seg = self._segments[-1]
        assert self._writer is not None
        self._writer.write_batch(rows_record_batch([r for _, r in accepted]))
        self._sync()
        seg.rows += len(accepted)

    def checkpoint(self, buffer_state: dict[str, Any], keys: list[int]) -> Path:
        """Write a complete checkpoint of ``buffer_state`` (``keys``: sorted keys it holds), then
        delete what no kept checkpoint needs. The checkpoint counts once this returns."""
        current = self._segments[-1].name if self._writer is not None else None
        needed = []
        for seg in self._segments:
            i = bisect.bisect_left(keys, seg.first_key)
            if seg.name == current or (i < len(keys) and keys[i] < seg.first_key + seg.rows):
                needed.append(seg)
        self._segments = needed
        n = self._next_ckpt
        self._next_ckpt += 1
        folder = self._ckpt_dir / f"ckpt-{n:08d}"
        folder.mkdir()
        doc = {
            "buffer": buffer_state,
            "keys": keys,
            "segments": [{"name": s.name, "first_key": s.first_key, "rows": s.rows} for s in needed],
        }
        self._write(folder / "state.json", json.dumps(doc, separators=(",", ":")).encode())
        self._write(folder / "DONE", b"ok\n")
        if self.fsync:
            _fsync_dir(folder)
            _fsync_dir(self._ckpt_dir)
        self._needs[n] = {s.name for s in needed}
        self.checkpoints_written += 1
        self._collect_garbage(n)
        return folder

    def _write(self, path: Path, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    def _collect_garbage(self, newest: int) -> None:
        complete = [self._number(p) for p in self._complete()]
        keep = set(complete[: self.keep_checkpoints])
        for p in self._ckpt_dir.glob("ckpt-*"):
            num = self._number(p)
            if num in keep or num > newest:
                continue
            (p / "DONE").unlink(missing_ok=True)  # first: a half-deleted checkpoint is incomplete
            shutil.rmtree(p, ignore_errors=True)
            self._needs.pop(num, None)
        needed: set[str] = set()
        for k in keep:
            if k not in self._needs:  # an older checkpoint this process did not load or write
                doc = json.loads((self._ckpt_dir / f"ckpt-{k:08d}" / "state.json").read_text())
                self._needs[k] = {s["name"] for s in doc["segments"]}
            needed |= self._needs[k]
        if self._writer is not None:
            needed.add(self._segments[-1].name)
        for p in self._seg_dir.glob("seg-*.arrow"):
            if p.name not in needed:
                p.unlink(missing_ok=True)

    def close(self) -> None:
        self._close_segment()
