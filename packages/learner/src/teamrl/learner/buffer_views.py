"""The replay buffer's views: a request reads whole trajectories (``WHOLE``) or those in which any
of a set of agents acted, named by the sorted ids joined by ``VIEW_SEP``. Each item counts its
samples per view and each view has its own rank rounds (``Views``), so one learner group's
sampling never consumes or blocks another's (``teamrl.learner.buffer``'s module docstring, "Views"
and "Ranks"; docs/architecture.md, "The replay buffer").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from teamrl.learner.buffer_errors import InvalidAgentId, InvalidView

if TYPE_CHECKING:
    from teamrl.learner.buffer_items import Group, Item

WHOLE = ""  # the view of whole-trajectory sampling; agent views are named by agent id
VIEW_SEP = "\x1f"  # joins the sorted ids of a several-agent view; admission refuses ids holding it
CONSUMED = -1  # an item's count for a view that gave it up (stale for the view's base model)
ROUND_WINDOW = 64  # rounds a rank may lag the fastest one and still be kept apart from it
MAX_AGENT_ID_CHARS = 256  # as teamrl.protocol.control.Id (BufferStats.per_agent keys, SampleRequest)
MAX_VIEW_AGENTS = 256  # as teamrl.protocol.control.MAX_SAMPLE_AGENTS


# --------------------------------------------------------------------------------------------
# view names


def nameable(agent_id: str) -> bool:
    """An agent id a control message can carry and no view name can be taken for."""
    return 1 <= len(agent_id) <= MAX_AGENT_ID_CHARS and VIEW_SEP not in agent_id


def check_agent_ids(agent_ids: Iterable[str]) -> None:
    """Raise ``InvalidAgentId`` for an agent id no control message or view name can carry."""
    bad = _unnameable(agent_ids)
    if bad is not None:
        raise InvalidAgentId(
            f"agent id of {len(bad)} characters: 1..{MAX_AGENT_ID_CHARS} allowed, without {VIEW_SEP!r}"
        )


def _unnameable(agent_ids: Iterable[str]) -> str | None:
    return next((a for a in agent_ids if not nameable(a)), None)


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
    bad = _unnameable(ids)
    if bad is not None:
        raise InvalidView(
            f"agent id of {len(bad)} characters (1..{MAX_AGENT_ID_CHARS} allowed, without {VIEW_SEP!r})"
        )
    return VIEW_SEP.join(ids)


@lru_cache(maxsize=4096)
def view_agents(view: str) -> frozenset[str]:
    """The agent ids of a view name (empty for ``WHOLE``)."""
    return frozenset(view.split(VIEW_SEP)) if view else frozenset()


class Views:
    """Each view's use of the held items, and its rank rounds.

    An item counts its samples per view; the view is done with it after ``max_times_sampled``
    (0: never) or once it gave it up (``CONSUMED``). Every request of a rank opens that rank's next
    round of its view, and a group one rank took in round r goes to no other rank of the view in
    its own round r (kept for ``ROUND_WINDOW`` rounds behind the view's fastest rank)."""

    def __init__(self, max_times_sampled: int) -> None:
        self.max_times_sampled = max_times_sampled
        self.rounds: dict[str, dict[int, int]] = {}  # view -> rank -> its next round

    # --- use ----------------------------------------------------------------------------------

    def eligible(self, g: Group, view: str) -> list[Item]:
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

    def used_up(self, n: int) -> bool:
        return n == CONSUMED or (self.max_times_sampled > 0 and n >= self.max_times_sampled)

    def exhausted(self, it: Item) -> bool:
        """The whole view used it up, or every agent that acted in it is in a view that did."""
        if self.used_up(it.sampled.get(WHOLE, 0)):
            return True
        if not it.steps_per_agent:
            return False
        covered: set[str] = set()
        for view, n in it.sampled.items():
            if view != WHOLE and self.used_up(n):
                covered |= view_agents(view)
        return covered.issuperset(it.steps_per_agent)

    @staticmethod
    def give_up(items: Iterable[Item], view: str) -> None:
        """The view is done with ``items`` without sampling them (stale for its base model)."""
        for it in items:
            it.sampled[view] = CONSUMED

    # --- rounds -------------------------------------------------------------------------------

    def round_of(self, view: str, rank: int) -> int:
        return self.rounds.get(view, {}).get(rank, 0)

    def candidates(
        self, groups: Iterable[Group], view: str, rnd: int, rank: int
    ) -> list[tuple[Group, list[Item]]]:
        """The groups no other rank of the view took in round ``rnd``, each with its items the view
        may still take (groups without any left out)."""
        return [
            (g, items)
            for g in groups
            if g.taken.get(view, {}).get(rnd, rank) == rank and (items := self.eligible(g, view))
        ]

    @staticmethod
    def take(g: Group, items: Iterable[Item], view: str, rnd: int, rank: int) -> None:
        """``rank`` takes ``items`` of ``g`` in its round ``rnd``: one more sample each for the view."""
        g.taken.setdefault(view, {})[rnd] = rank
        for it in items:
            it.sampled[view] = it.sampled.get(view, 0) + 1

    def close(self, view: str, rank: int, rnd: int, groups: Iterable[Group]) -> None:
        """End the rank's round ``rnd``; the takes of ``groups`` more than ``ROUND_WINDOW`` rounds
        behind the view's fastest rank are forgotten."""
        self.rounds.setdefault(view, {})[rank] = rnd + 1
        # Not min over the ranks seen: a rank that has not asked yet is still in round 0.
        oldest = max(self.rounds[view].values()) - ROUND_WINDOW
        for g in groups:
            taken = g.taken.get(view)
            if not taken:
                continue
            for r in [r for r in taken if r < oldest]:
                del taken[r]
            if not taken:
                del g.taken[view]

    def state(self) -> dict[str, Any]:
        """The whole view's rounds under the key older states used; other views apart."""
        return {
            "rounds": {str(r): n for r, n in self.rounds.get(WHOLE, {}).items()},
            "view_rounds": {
                v: {str(r): n for r, n in rounds.items()} for v, rounds in self.rounds.items() if v != WHOLE
            },
        }

    def load(self, state: Mapping[str, Any]) -> None:
        """Restore ``state()``; an older state's rounds become the whole view's."""
        self.rounds = {WHOLE: rounds_of(state["rounds"])} if state["rounds"] else {}
        self.rounds.update({v: rounds_of(r) for v, r in state.get("view_rounds", {}).items() if r})


def rounds_of(entry: Mapping[str, Any]) -> dict[int, int]:
    """Round -> rank (or rank -> round) read back from JSON, whose keys are strings."""
    return {int(r): int(n) for r, n in entry.items()}
