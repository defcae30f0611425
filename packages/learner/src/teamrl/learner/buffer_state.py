"""The replay buffer's checkpoint state: everything but the trajectories themselves (they live in
the segment log), JSON-able (``teamrl.learner.buffer``'s module docstring, "Persistence";
docs/reliability.md R-kill-buffer). ``ReplayBuffer.state_dict`` and ``load_state_dict`` call
``buffer_state`` and ``load_buffer_state`` (``buf`` is that ``ReplayBuffer``: typed ``Any`` here, since
the buffer imports this module); the versions, views and sources write their own parts.

A group's entry lists its items as [key, {view: times sampled}]; the whole view's rounds and takes
stay under the keys states from before views used (``rounds``, ``taken``), the other views' apart
(``view_rounds``, ``view_taken``), so either kind of state loads.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Mapping
from typing import Any

from teamrl.learner.buffer_errors import CorruptStore
from teamrl.learner.buffer_items import Group, Item, item_versions
from teamrl.learner.buffer_views import WHOLE, rounds_of
from teamrl.protocol.codec import TrajectoryRow

STATE_FORMAT = 1


def buffer_state(buf: Any, now: float) -> dict[str, Any]:
    """``buf``'s state; ``now`` (monotonic seconds) turns pending groups' birth times into ages."""
    return {
        "format": STATE_FORMAT,
        "next_key": buf.next_key,
        **buf.versions.state(),
        **buf.ids.state(),
        "serial": buf._held.serial,
        "counters": {
            "inserted": buf.inserted,
            "sampled": buf.sampled,
            "duplicates": buf.duplicates,
            "groups_timed_out": buf.groups_timed_out,
            "rejected": dict(buf.rejected),
            "evicted": dict(buf.evicted),
        },
        "limiter": {"inserts": buf.limiter.inserts, "samples": buf.limiter.samples},
        **buf._views.state(),
        "seen": buf._sources.state(),
        "groups": [_held_entry(g) for g in buf._held.groups.values()],
        "pending": [_pending_entry(g, now) for g in buf._pending.groups.values()],
        "rng": buf._order.rng.bit_generator.state,
    }


def load_buffer_state(
    buf: Any, state: Mapping[str, Any], trajectories: Mapping[int, TrajectoryRow], now: float
) -> None:
    """Restore ``buffer_state`` output into ``buf``; ``trajectories`` maps every key it holds to its row."""
    if state.get("format") != STATE_FORMAT:
        raise CorruptStore(f"buffer state format {state.get('format')!r}, expected {STATE_FORMAT}")
    c = state["counters"]
    buf.next_key = int(state["next_key"])
    buf.inserted, buf.sampled = int(c["inserted"]), int(c["sampled"])
    buf.duplicates, buf.groups_timed_out = int(c["duplicates"]), int(c["groups_timed_out"])
    buf.rejected, buf.evicted = Tally(c["rejected"]), Tally(c["evicted"])
    buf.limiter.inserts = int(state["limiter"]["inserts"])
    buf.limiter.samples = int(state["limiter"]["samples"])
    buf._views.load(state)
    buf._sources.load(state["seen"])
    buf._held.clear()
    buf._pending.groups.clear()
    buf._held.serial = int(state["serial"])
    for entry in state["groups"]:
        buf._held.hold(_held_group(entry, trajectories))
    for entry in state["pending"]:
        buf._pending.groups[entry["group_id"]] = _pending_group(entry, trajectories, now)
    buf._order.rng.bit_generator.state = state["rng"]
    buf.versions.load(state, [*buf._held.groups.values(), *buf._pending.groups.values()])
    buf.ids.load(state)


def _held_entry(g: Group) -> dict[str, Any]:
    return {
        "serial": g.serial,
        "group_id": g.group_id,
        "items": _item_entries(g),
        "taken": g.taken.get(WHOLE, {}),
        "view_taken": {v: t for v, t in g.taken.items() if v != WHOLE},
    }


def _pending_entry(g: Group, now: float) -> dict[str, Any]:
    return {"group_id": g.group_id, "items": _item_entries(g), "age_s": max(0.0, now - g.born)}


def _item_entries(g: Group) -> list[list[Any]]:
    return [[it.key, it.sampled] for it in g.items]


def _held_group(entry: Mapping[str, Any], trajectories: Mapping[int, TrajectoryRow]) -> Group:
    g = Group(entry["group_id"], _items(entry["items"], trajectories), 0.0, serial=int(entry["serial"]))
    taken = {WHOLE: entry["taken"], **entry.get("view_taken", {})}
    g.taken = {v: rounds_of(t) for v, t in taken.items() if t}
    return g


def _pending_group(entry: Mapping[str, Any], trajectories: Mapping[int, TrajectoryRow], now: float) -> Group:
    return Group(entry["group_id"], _items(entry["items"], trajectories), now - float(entry["age_s"]))


def _items(entries: list[list[Any]], trajectories: Mapping[int, TrajectoryRow]) -> list[Item]:
    out = []
    for key, sampled in entries:
        t = trajectories.get(int(key))
        if t is None:
            raise CorruptStore(f"checkpoint holds key {key} but no segment row has it")
        lo, hi, per_model = item_versions(t, -1)
        out.append(Item(int(key), t, lo, hi, t.steps_per_agent(), dict(sampled), per_model))
    return out
