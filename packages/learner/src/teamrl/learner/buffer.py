"""Replay buffer core: admission by staleness, episode groups, a Reverb-style rate limiter, three
samplers, and crash-safe persistence. In-process and single-threaded; ``buffer_service`` wraps it
in ZeroMQ. ``ReplayBuffer`` is assembled from parts in modules beside this one: ``buffer_groups``
(items, pending and held groups, sampler order), ``buffer_views`` (views, rank rounds),
``buffer_versions`` (per-base versions, staleness), ``buffer_state`` (its checkpoint state) and
``buffer_errors``.

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
import os
import shutil
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
from prometheus_client import Counter, Gauge, Histogram

# ``NAME as NAME``: re-exported, for the service, the tests and older callers that import it from here
from teamrl.learner.buffer_errors import CorruptStore, InvalidAgentId, InvalidView, VersionOutOfRange
from teamrl.learner.buffer_errors import ReplayBufferError as ReplayBufferError
from teamrl.learner.buffer_groups import PRIORITY_EPS as PRIORITY_EPS
from teamrl.learner.buffer_groups import GroupOrder, HeldGroups, PendingGroups, fill
from teamrl.learner.buffer_items import Group, Item
from teamrl.learner.buffer_state import STATE_FORMAT as STATE_FORMAT
from teamrl.learner.buffer_state import buffer_state, load_buffer_state
from teamrl.learner.buffer_versions import PolicyVersions
from teamrl.learner.buffer_views import CONSUMED as CONSUMED
from teamrl.learner.buffer_views import MAX_AGENT_ID_CHARS as MAX_AGENT_ID_CHARS
from teamrl.learner.buffer_views import MAX_VIEW_AGENTS as MAX_VIEW_AGENTS
from teamrl.learner.buffer_views import ROUND_WINDOW as ROUND_WINDOW
from teamrl.learner.buffer_views import VIEW_SEP, Views, check_agent_ids, view_name
from teamrl.learner.buffer_views import WHOLE as WHOLE
from teamrl.learner.buffer_views import view_agents as view_agents
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


class _Sources:
    """The (incarnation, seq) of every frame delivered to ``insert``, per producer incarnation."""

    def __init__(self) -> None:
        self.seen: dict[str, _SeqSet] = {}

    def first_delivery(self, incarnation: str, seq: int) -> bool:
        """Record (incarnation, seq) as seen; False when it was already."""
        seen = self.seen.get(incarnation)
        if seen is None:  # the receiver's rule: the first seq of an incarnation is its low mark
            seen = self.seen[incarnation] = _SeqSet(low=seq)
        if seq in seen:
            return False
        seen.add(seq)
        return True

    def state(self) -> dict[str, list[Any]]:
        return {inc: [s.low, sorted(s.above)] for inc, s in self.seen.items()}

    def load(self, state: Mapping[str, list[Any]]) -> None:
        self.seen = {inc: _SeqSet(int(low), above) for inc, (low, above) in state.items()}


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
        self.group_size = group_size
        self.versions = PolicyVersions(max_policy_lag, stale_action, stale_decay, version_window)
        self.limiter = RateLimiter(min_size, samples_per_insert, error_buffer)
        self._order = GroupOrder(sampler, priority_exponent, importance_exponent, seed)
        self._pending = PendingGroups(group_size, group_timeout_s, max_pending_groups)
        self._held = HeldGroups(self._order.priority)
        self._views = Views(max_times_sampled)
        self._sources = _Sources()
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
        """The highest version of any base (steps and hints)."""
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
        self._check_frame(rows)  # before any state changes: a refused frame is not recorded as seen
        if source is not None and not self._sources.first_delivery(*source):
            self.count_duplicates(1)
            return InsertResult([], duplicate=True)
        models = [r.versions_per_model() for r in rows]
        for r, per_model in zip(rows, models, strict=True):
            self.versions.observe(r.versions(-1)[1], per_model)
        res = InsertResult([])
        for r, per_model in zip(rows, models, strict=True):
            lo, hi = r.versions(self.current_version)
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

    def _check_frame(self, rows: list[TrajectoryRow]) -> None:
        """Count and raise ``VersionOutOfRange`` (a step above ``version_ceiling()``) or
        ``InvalidAgentId`` (an agent id no control message or view name can carry)."""
        try:
            self.versions.check(max((r.versions(-1)[1] for r in rows), default=-1), "policy version")
            check_agent_ids(a for r in rows for a in r.steps_per_agent())
        except (VersionOutOfRange, InvalidAgentId) as e:
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

    def _checked_view(
        self, agent_id: str | None, agent_ids: Iterable[str] | None, min_policy_version: int, trusted: bool
    ) -> str:
        """The request's view name; a malformed agent list (``InvalidView``) or an untrusted hint above
        the version window (``VersionOutOfRange``) is counted and raised before anything changes."""
        try:
            view = view_name(agent_id, agent_ids)
            if not trusted:
                self.versions.check(min_policy_version, "min_policy_version")
        except (InvalidView, VersionOutOfRange) as e:
            self.count_rejected(e.reason)
            raise
        return view

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
