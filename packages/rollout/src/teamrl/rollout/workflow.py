"""Workflows: agents, the dependency function D, and the agent -> (model, adapter) mapping.

A workflow is MARFT's Flex-MG made concrete. It has

* **agents**: a role, a profile (system prompt) or none (anonymous agents, the MARFT ablation),
  a prompt template, sampling parameters, tools, and a *mapping* to a physical base model and a
  LoRA adapter. Agents that name the same adapter share its weights, so one adapter for all is
  full sharing, a few adapters for groups is partial sharing, one each is full separation, and
  agents on two ``models`` make a heterogeneous team (:meth:`Workflow.sharing` reports which);
* **the dependency function D** (``graph``), either
  - ``static``: a DAG over *nodes* (an agent acting once; the same agent may act in several nodes,
    e.g. coder -> reviewer -> coder) that runs ``turns`` times; nodes of one DAG level are
    independent and are generated concurrently, so vLLM batches them; or
  - ``dynamic``: after each agent acts, a router on its output picks who acts next (ordered
    ``routes`` of regex rules with an optional per-rule ``limit``, or a Python ``router``), e.g. a
    verifier that sends the solver back at most k times; a turn starts each time ``start`` acts;
* **termination rules**: ``turns`` and ``stop_when`` (static), ``end`` routes and ``max_steps``
  (dynamic);
* **a reward function** (``reward``) from the episode's texts to step, turn and trajectory rewards
  (UnityMAS-O's three levels), from ``teamrl.rewards.outcome``;
* **credit assignment** (``credit``, optional): how the team outcome becomes each step's reward,
  ``reward`` (as the reward function gave, the default), ``equal`` (R / n agents), ``role``
  (``w R + (1 - w) r_i`` with the agent's own reward), ``turn`` (discounted returns-to-go of the turn
  rewards) or ``judge`` (LangMARL: a model of the workflow, with its base weights, reads the episode
  and apportions R; its critique goes to ``metadata["critique"]``; an unparsable answer or text the
  tokenizer cannot encode falls back to ``equal``, counted in
  ``teamrl_credit_judge_fallbacks_total{reason}``).

:class:`Workflow` is the whole definition (one TOML table): its parts are the models of
``teamrl.rollout.spec``, checked against each other by ``teamrl.rollout.validation`` whenever it is
built; episodes run in ``teamrl.rollout.executor`` (``run_episode``). Every problem in a definition
is a :class:`teamrl.rollout.spec.WorkflowError` naming the agent or edge.

Call sequence::

    wf = load_workflow("addition-duo", max_lora_rank=engine.cfg.max_lora_rank)  # teamrl.rollout.workflows
    wf = Workflow.from_toml("team.toml")  # or Workflow.from_dict(table)
    wf.levels(), wf.sharing(), wf.adapter_groups(), wf.reward_fn()
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from teamrl.rewards.base import Reward, get_reward
from teamrl.rollout.spec import (
    AdapterSpec,
    AgentSpec,
    CreditSpec,
    GraphSpec,
    ModelSpec,
    NodeSpec,
    RewardSpec,
    TaskSource,
    WorkflowError,
    _Strict,
    nodes_of,
    resolve_data_path,
)
from teamrl.rollout.tools import Tool, build_tool
from teamrl.rollout.validation import check_workflow, dag_levels


class Workflow(_Strict):
    """A complete workflow definition (one TOML table)."""

    name: str
    description: str = ""
    models: dict[str, ModelSpec]
    adapters: dict[str, AdapterSpec] = Field(default_factory=dict)
    agents: list[AgentSpec]
    graph: GraphSpec = Field(default_factory=GraphSpec)
    tools: dict[str, dict[str, Any]] = Field(default_factory=dict, description="name -> {kind, ...}")
    reward: RewardSpec | None = None
    credit: CreditSpec = Field(default_factory=CreditSpec)
    tasks: TaskSource = Field(default_factory=TaskSource)

    _reward_fn: Any = PrivateAttr(None)  # built on first use, then shared by every episode
    _tools: Any = PrivateAttr(None)

    def __eq__(self, other: object) -> bool:  # the definition, not the caches built from it
        return isinstance(other, Workflow) and self.model_dump() == other.model_dump()

    __hash__ = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _check(self) -> Workflow:
        check_workflow(self)
        return self

    # ------------------------------------------------------------------ lookup

    def agent(self, agent_id: str) -> AgentSpec:
        for a in self.agents:
            if a.id == agent_id:
                return a
        raise WorkflowError(f"workflow {self.name!r}: unknown agent {agent_id!r}", agent=agent_id)

    def nodes(self) -> list[NodeSpec]:
        """Static: the declared nodes, or one per agent; dynamic: one per agent."""
        return nodes_of(self.graph, self.agents)

    def levels(self) -> list[list[str]]:
        """Static: node ids grouped by DAG depth (each level's nodes are independent), in node order."""
        return dag_levels(self.name, self.graph.edges, [n.id for n in self.nodes()])

    def sharing(self) -> dict[str, str]:
        """Per base model: 'base' (no adapters), 'full', 'partial' or 'separate' adapter sharing."""
        out = {}
        for model in self.models:
            agents = [a for a in self.agents if a.model == model]
            names = [a.adapter for a in agents if a.adapter]
            if not agents:
                continue
            if not names:
                out[model] = "base"
            elif len(set(names)) == 1 and len(agents) > 1:
                out[model] = "full"
            elif len(set(names)) == len(agents):
                out[model] = "separate"
            else:
                out[model] = "partial"
        return out

    def adapter_groups(self) -> dict[str, list[str]]:
        """Adapter name -> the agents that share it."""
        groups: dict[str, list[str]] = {}
        for a in self.agents:
            if a.adapter:
                groups.setdefault(a.adapter, []).append(a.id)
        return groups

    def check_engine(self, max_lora_rank: int) -> None:
        """Raise if an adapter's rank exceeds the engine's ``max_lora_rank`` (vLLM would refuse it)."""
        for name, ad in self.adapters.items():
            if ad.rank > max_lora_rank:
                users = [a.id for a in self.agents if a.adapter == name]
                raise WorkflowError(
                    f"workflow {self.name!r}: adapter {name!r} (agents {users}) has rank {ad.rank}, "
                    f"above the engine's max_lora_rank {max_lora_rank}",
                    agent=users[0] if users else None,
                )

    def with_sampling(self, **overrides: Any) -> Workflow:
        """A copy whose every agent samples with ``overrides`` (e.g. ``temperature=0.0`` for eval)."""
        data = self.model_dump()
        for a in data["agents"]:
            a["sampling"].update(overrides)
        return Workflow.from_dict(data)

    def profiles(self) -> dict[str, str]:
        """``{agent_id: profile}`` of the agents that have one (anonymous agents are left out)."""
        return {a.id: a.profile for a in self.agents if a.profile}

    def with_profiles(self, profiles: Mapping[str, str]) -> Workflow:
        """A copy whose agents named in ``profiles`` get those system prompts (LangMARL's update).

        Agents not named keep theirs; a name that is no agent of this workflow is a WorkflowError.
        The copy shares this workflow's built reward and tools (profiles change neither): a reward
        with state, such as ``outcome``'s ``balance_verdicts`` class shares, goes on across a
        LangMARL round instead of starting again."""
        known = {a.id for a in self.agents}
        unknown = sorted(set(profiles) - known)
        if unknown:
            raise WorkflowError(f"workflow {self.name!r}: profiles for unknown agents {unknown}")
        data = self.model_dump()
        for a in data["agents"]:
            if a["id"] in profiles:
                a["profile"] = profiles[a["id"]]
        out = Workflow.from_dict(data)
        out._reward_fn, out._tools = self._reward_fn, self._tools
        return out

    # ------------------------------------------------------------------ built parts (cached)

    def reward_fn(self) -> Reward | None:
        """The ``[reward]`` table's reward, ``get_reward(name, **kwargs)`` (``answer_from`` passed
        as ``answer_agent``), or None without one; episodes call its ``episode(task, acts)``."""
        if self.reward is None:
            return None
        if self._reward_fn is None:
            kwargs = dict(self.reward.kwargs)
            if self.reward.answer_from:
                kwargs["answer_agent"] = self.reward.answer_from
            self._reward_fn = get_reward(self.reward.name, **kwargs)
        return self._reward_fn

    def built_tools(self) -> dict[str, Tool]:
        if self._tools is None:
            self._tools = {
                name: build_tool(name, spec, resolve_data_path) for name, spec in self.tools.items()
            }
        return self._tools

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, max_lora_rank: int | None = None) -> Workflow:
        """Build and validate; every problem is a :class:`WorkflowError`."""
        try:
            wf = cls.model_validate(dict(data))
        except ValidationError as e:
            raise _unwrap(e, data) from None
        if max_lora_rank is not None:
            wf.check_engine(max_lora_rank)
        return wf

    @classmethod
    def from_toml(
        cls, path: str | Path, *, table: str = "workflow", max_lora_rank: int | None = None
    ) -> Workflow:
        """Read ``[table]`` of a TOML file (or the whole file when it has no such table)."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise WorkflowError(f"cannot read workflow file {path}: {e}") from e
        if table in data and isinstance(data[table], dict):
            data = data[table]
        try:
            return cls.from_dict(data, max_lora_rank=max_lora_rank)
        except WorkflowError as e:
            raise WorkflowError(f"{path}: {e}", agent=e.agent, edge=e.edge) from None


def _unwrap(e: ValidationError, data: Mapping[str, Any]) -> WorkflowError:
    for err in e.errors():
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, WorkflowError):
            return inner
    name = data.get("name", "?") if isinstance(data, Mapping) else "?"
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        agent = _agent_at(data, err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            valid = _fields_at(Workflow, err["loc"][:-1])
            msg = f"unknown field{f' (valid: {valid})' if valid else ''}"
        lines.append(f"{loc}{f' (agent {agent!r})' if agent else ''}: {msg}")
    agent = next((a for a in (_agent_at(data, err["loc"]) for err in e.errors()) if a), None)
    return WorkflowError(f"workflow {name!r}: " + "; ".join(lines), agent=agent)


def _fields_at(model: Any, loc: Sequence[Any]) -> list[str]:
    """The field names of the model found at ``loc`` under ``model`` (list indices and dict keys
    skipped), for "unknown field" messages; [] when the path leads to no model."""
    import typing

    for key in loc:
        if isinstance(key, int) or not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        f = model.model_fields.get(str(key))
        if f is None:
            return []
        model = f.annotation
        while typing.get_args(model):  # list[X], dict[str, X], X | None -> X
            model = next(
                (
                    a
                    for a in reversed(typing.get_args(model))
                    if isinstance(a, type) and issubclass(a, BaseModel)
                ),
                typing.get_args(model)[-1],
            )
            if isinstance(model, type):
                break
    if isinstance(model, type) and issubclass(model, BaseModel):
        return sorted(model.model_fields)
    return []


def _agent_at(data: Any, loc: Sequence[Any]) -> str | None:
    if len(loc) >= 2 and loc[0] == "agents" and isinstance(loc[1], int):
        try:
            return str(data["agents"][loc[1]].get("id"))
        except (KeyError, IndexError, TypeError, AttributeError):
            return None
    return None
