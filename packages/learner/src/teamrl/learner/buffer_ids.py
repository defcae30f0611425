"""Which model ids and agent ids the replay buffer accepts: those the run's plan names, and nothing
a peer makes up (docs/security.md, "Ids from the plan").

A run's plan lists them in the ``[buffer]`` table (``model_ids``: every model an agent runs on,
``agent_ids``: every agent; ``teamrl run`` fills both from the workflow). With a plan, a frame, sample
request or announcement naming another id is refused whole (``UnknownId``), counted under
``unknown_model_id`` or ``unknown_agent_id``, and changes nothing.

A buffer started without them learns the ids of learners' announcements (``VersionAnnounce``: the
base and the trained agents of a learner group), at most ``MAX_KNOWN_IDS`` of each, which bounds the
only map a wire id can add to for good (per-base versions come from announcements alone:
``buffer_versions``). It does not refuse data by them: an announcement names only the *trained*
agents and bases, and a team's untrained agents (a frozen verifier on its own model) send steps
too. Such data is held like any other (bounded by ``capacity``) and names nothing that outlives it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from teamrl.learner.buffer_errors import UnknownId

MAX_KNOWN_IDS = 256  # model ids, and agent ids, a plan-less buffer learns from announcements


class KnownIds:
    """The accepted ids: ``model_ids``/``agent_ids`` from the plan (fixed), else those announced."""

    def __init__(self, model_ids: Iterable[str] = (), agent_ids: Iterable[str] = ()) -> None:
        self.planned = bool(list(model_ids) or list(agent_ids))
        self.models: set[str] = set(model_ids)
        self.agents: set[str] = set(agent_ids)

    def check(self, models: Iterable[str], agents: Iterable[str]) -> None:
        """Raise ``UnknownId`` for the first model id or agent id outside the plan's (no plan, or a plan
        without that kind of id: nothing is checked)."""
        if not self.planned:
            return
        for what, known, ids in (("model", self.models, models), ("agent", self.agents, agents)):
            if not known:
                continue
            for i in ids:
                if i not in known:
                    shown = sorted(known)[:8]
                    raise UnknownId(f"unknown_{what}_id", f"{what} id {i!r} is not in the run's plan {shown}")

    def learn(self, model_id: str | None, agent_ids: Iterable[str], commit: bool = True) -> None:
        """An authenticated learner's announcement: with a plan, its ids must be in it (``check``);
        without, they join the known sets (``UnknownId`` past ``MAX_KNOWN_IDS``). ``commit`` False:
        only raise what it would raise."""
        agents = list(agent_ids)
        models = [] if model_id is None else [model_id]
        if self.planned:
            self.check(models, agents)
            return
        new_models = set(models) - self.models
        new_agents = set(agents) - self.agents
        for what, known, new in (("model", self.models, new_models), ("agent", self.agents, new_agents)):
            if len(known) + len(new) > MAX_KNOWN_IDS:
                raise UnknownId(f"unknown_{what}_id", f"more than {MAX_KNOWN_IDS} {what} ids announced")
        if not commit:
            return
        self.models |= new_models
        self.agents |= new_agents

    def state(self) -> dict[str, Any]:
        """The learned ids (a plan's come from the config again after a restart)."""
        if self.planned:
            return {}
        return {"known_ids": {"models": sorted(self.models), "agents": sorted(self.agents)}}

    def load(self, state: Mapping[str, Any]) -> None:
        known = state.get("known_ids")
        if known is not None and not self.planned:
            self.models = {str(m) for m in known["models"]}
            self.agents = {str(a) for a in known["agents"]}
