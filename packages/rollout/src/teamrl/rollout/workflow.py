"""Workflows: agents, the dependency function D, the agent -> (model, adapter) mapping, and the executor.

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
  (UnityMAS-O's three levels), built on ``teamrl.rewards``;
* **credit assignment** (``credit``, optional): how the team outcome becomes each step's reward,
  ``reward`` (as the reward function gave, the default), ``equal`` (R / n agents), ``role``
  (``w R + (1 - w) r_i`` with the agent's own reward), ``turn`` (discounted returns-to-go of the turn
  rewards) or ``judge`` (LangMARL: a model of the workflow, with its base weights, reads the episode
  and apportions R; its critique goes to ``metadata["critique"]``; an unparsable answer or text the
  tokenizer cannot encode falls back to ``equal``, counted in
  ``teamrl_credit_judge_fallbacks_total{reason}``).

Parents (D(a_i, a_j) of one episode) are exactly the steps whose outputs the prompt contains: the
template's ``{out[<node>]}`` references, or every readable step for ``{parents}``. Load-time
validation raises :class:`WorkflowError` naming the agent, node or edge: a cycle in a static DAG,
an unknown agent/node in an edge or route, an agent mapped to an unknown model or adapter, an
adapter shared across base models, a template reading an output it cannot see, and (given the
engine's ``max_lora_rank``) an adapter rank above the engine's maximum.

Prompts: ``template`` is ``str.format``-ed with ``task`` (the task record), ``out`` (node ->
output view of its latest readable step), ``parents`` (those steps, each with ``parent_format``),
``profile`` and ``turn``. With a tokenizer that has a chat template (and ``chat = true``) the
messages ``[system: profile] + [user: text]`` go through it; otherwise the text is the prompt,
preceded by the profile and a blank line unless the template places ``{profile}`` itself.

Tool rounds: an agent with tools samples with ``</tool>`` as a stop string; a complete call is run
(``teamrl.rollout.tools``), and the agent continues from ``prompt + response + <result>..</result>``
as a *new step* of the same node whose parents are the previous round and the node's parents. So
every step's response is purely sampled tokens with their behaviour log-probs (the schema has no
loss mask), and the ids a continuation sees are the exact ids of the earlier rounds (never
re-tokenised). The call and its result are stored in the calling step's ``tool_calls``.

Stop strings: a stop string that is one token is passed to the engine as a stop id; every stop
string is also applied to the decoded response, truncating it after the token that completes the
string (the kept prefix is a sample of the same policy; its log-probs are unchanged).

Call sequence::

    wf = load_workflow("addition-duo", max_lora_rank=engine.cfg.max_lora_rank)  # teamrl.rollout.workflows
    traj = await run_episode(wf, task, engine, tokenizers=CharTokenizer(), seed=7,
                             incarnation=inc, seq=n, group_id=f"{step}-{task['id']}")
"""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import string
import tomllib
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from teamrl.protocol.trajectory import AgentStep, GraphTrajectory, ToolCall
from teamrl.rewards.tokenizer import Tokenizer, TokenizerError
from teamrl.rollout.tools import TOOL_STOP, Tool, build_tool, format_result, parse_tool_call

END = "end"
_TEMPLATE_ROOTS = {"task", "out", "parents", "profile", "turn"}


class WorkflowError(ValueError):
    """A workflow definition is wrong; ``agent`` / ``edge`` name the culprit when there is one."""

    def __init__(self, message: str, *, agent: str | None = None, edge: tuple[str, str] | None = None):
        super().__init__(message)
        self.agent = agent
        self.edge = edge


# ============================================================================ definition (config)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingSpec(_Strict):
    """Per-agent sampling (the agent profile's serving config)."""

    max_tokens: int = Field(256, ge=1, description="most tokens sampled per step (per tool round)")
    temperature: float = Field(1.0, ge=0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    stop: list[str] = Field(default_factory=list, description="stop strings (kept in the response)")
    stop_token_ids: list[int] = Field(default_factory=list, description="stop token ids (e.g. EOS)")


class ModelSpec(_Strict):
    """A physical base model. ``path`` is its folder ('' = given by whoever runs the workflow)."""

    path: str = Field("", description="model folder (vLLM model / HF folder); '' = supplied at run time")


class AdapterSpec(_Strict):
    """A LoRA adapter: trained for exactly one base model; ``rank`` must fit the engine's max."""

    model: str = Field(description="id of the base model (a key of [models]) the adapter belongs to")
    rank: int = Field(8, ge=1, description="LoRA rank r")
    # Its own optimisation (Dr. MAS); None = the learner-wide value ([learner] table, `teamrl run` flags).
    # `teamrl run` passes them on as [learner.agents.<adapter>]; the sampling temperature is the agents'.
    lr: float | None = Field(None, gt=0, description="learning rate of this adapter")
    clip_low: float | None = Field(None, ge=0, description="PPO clip range below 1")
    clip_high: float | None = Field(None, ge=0, description="PPO clip range above 1 (clip-higher)")
    kl_coef: float | None = Field(None, ge=0, description="KL-to-reference coefficient")
    micro_batch_rows: int | None = Field(None, ge=1, description="rows per forward/backward")

    def learner_settings(self) -> dict[str, float]:
        """The optimisation settings this workflow sets for the adapter (unset ones left out)."""
        names = ("lr", "clip_low", "clip_high", "kl_coef", "micro_batch_rows")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


class AgentSpec(_Strict):
    """One logical agent and its mapping to (base model, adapter)."""

    id: str = Field(pattern=r"^[A-Za-z_][\w-]*$", description="logical agent id, e.g. 'solver'")
    role: str = Field(description="role name; several agents may share a role")
    profile: str | None = Field(None, description="system prompt; None = anonymous agent (MARFT ablation)")
    model: str = Field(description="base model id (a key of [models])")
    adapter: str = Field("", description="LoRA adapter name (a key of [adapters]); '' = base weights")
    template: str = Field("{task[question]}", description="user prompt, str.format-ed (module docstring)")
    parent_format: str = Field("{agent}: {output}\n", description="how each step in {parents} is written")
    output: str = Field("text", description="the view of this agent's response others read (OUTPUT_VIEWS)")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    tools: list[str] = Field(default_factory=list, description="names of [tools] this agent may call")
    max_tool_rounds: int = Field(2, ge=0, description="tool calls per node act, at most")
    chat: bool = Field(True, description="use the tokenizer's chat template when it has one")


class NodeSpec(_Strict):
    """Static graphs: one act of an agent within a turn."""

    id: str = Field(pattern=r"^[A-Za-z_][\w-]*$")
    agent: str


class RouteRule(_Strict):
    """Dynamic graphs: after ``after`` acts, go to ``next`` if ``when`` matches its output view."""

    after: str = Field(description="agent whose output is inspected")
    when: str = Field("", description="regex searched in the output view; '' always matches")
    next: str = Field(description=f"agent id, or '{END}'")
    limit: int | None = Field(None, ge=0, description="times this rule may fire per episode")


class StopRule(_Strict):
    """Static graphs: after a turn, end the episode if node ``node``'s output matches ``when``."""

    node: str
    when: str


class GraphSpec(_Strict):
    """The dependency function D."""

    kind: Literal["static", "dynamic"] = "static"
    nodes: list[NodeSpec] = Field(
        default_factory=list, description="static: acts per turn; empty = one node per agent, named by it"
    )
    edges: list[tuple[str, str]] = Field(
        default_factory=list,
        description="static: node -> node (a DAG); dynamic: agent -> agent ('dst may read src's latest output')",
    )
    turns: int = Field(1, ge=1, description="static: times the DAG runs")
    history: Literal["none", "self", "all"] = Field(
        "all", description="static, turn t > 0: which nodes' turn t-1 steps a node may read"
    )
    stop_when: list[StopRule] = Field(default_factory=list)
    start: str | None = Field(None, description="dynamic: the agent that acts first")
    routes: list[RouteRule] = Field(default_factory=list)
    router: str | None = Field(None, description="dynamic: 'module:function' (RouteState) -> agent | None")
    max_steps: int = Field(16, ge=1, description="dynamic: most agent acts per episode")


class RewardSpec(_Strict):
    """The reward function; ``answer_from`` names the agent whose output is the team's answer."""

    name: str = Field(description="a key of REWARD_FUNCTIONS, or 'module:factory'")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    answer_from: str = Field(
        "",
        description="agent id whose last act is the team's answer (its score is the trajectory reward); "
        "'' = the reward's role rule (the last act of role 'solver' / kwargs.answer_role)",
    )


class CreditSpec(_Strict):
    """From the episode outcome to per-step rewards (``teamrl.rewards.credit``)."""

    rule: Literal["reward", "equal", "role", "turn", "judge"] = "reward"
    weights: dict[str, float] | float = Field(
        1.0, description="role: team-reward weight w per agent (or one for all), in [0, 1]"
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="turn: discount of later turns' rewards")
    judge_model: str = Field("", description="judge: model id of this workflow (default: the first agent's)")
    max_tokens: int = Field(256, ge=1, description="judge: answer length in tokens")
    temperature: float = Field(0.0, ge=0.0, description="judge: sampling temperature")


class TaskSource(_Strict):
    """Where the workflow's tasks come from by default (``teamrl.rollout.workflows.load_tasks``)."""

    builtin: str | None = Field(None, description="a built-in task set (workflows.TASK_SETS)")
    path: str | None = Field(None, description="JSONL or Parquet file")
    format: str = Field(
        "auto", description="record format: auto, plain, gsm8k, math, nq, hotpotqa, humaneval"
    )
    seed: int = 0


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
        _validate(self)
        return self

    # ------------------------------------------------------------------ lookup

    def agent(self, agent_id: str) -> AgentSpec:
        for a in self.agents:
            if a.id == agent_id:
                return a
        raise WorkflowError(f"workflow {self.name!r}: unknown agent {agent_id!r}", agent=agent_id)

    def nodes(self) -> list[NodeSpec]:
        """Static: the declared nodes, or one per agent; dynamic: one per agent."""
        if self.graph.kind == "static" and self.graph.nodes:
            return list(self.graph.nodes)
        return [NodeSpec(id=a.id, agent=a.id) for a in self.agents]

    def levels(self) -> list[list[str]]:
        """Static: node ids grouped by DAG depth (each level's nodes are independent), in node order."""
        return _levels(self, [n.id for n in self.nodes()])

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

        Agents not named keep theirs; a name that is no agent of this workflow is a WorkflowError."""
        known = {a.id for a in self.agents}
        unknown = sorted(set(profiles) - known)
        if unknown:
            raise WorkflowError(f"workflow {self.name!r}: profiles for unknown agents {unknown}")
        data = self.model_dump()
        for a in data["agents"]:
            if a["id"] in profiles:
                a["profile"] = profiles[a["id"]]
        return Workflow.from_dict(data)

    # ------------------------------------------------------------------ built parts (cached)

    def reward_fn(self) -> RewardFunction | None:
        if self.reward is None:
            return None
        if self._reward_fn is None:
            factory = _resolve(REWARD_FUNCTIONS, self.reward.name, "reward")
            kwargs = dict(self.reward.kwargs)
            if self.reward.answer_from:
                kwargs["answer_agent"] = self.reward.answer_from
            self._reward_fn = factory(**kwargs)
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


# ============================================================================ validation


def _validate(wf: Workflow) -> None:
    """Every cross-reference of a workflow, in the order a reader checks them; the first problem raises."""
    _validate_agent_ids(wf)
    for a in wf.agents:
        _validate_agent(wf, a)
    _validate_tables(wf)
    agent_ids = {a.id for a in wf.agents}
    _validate_credit(wf, agent_ids)
    _validate_reward(wf, agent_ids)
    if wf.graph.kind == "static":
        _validate_static(wf)
    else:
        _validate_dynamic(wf)


def _validate_agent_ids(wf: Workflow) -> None:
    """At least one agent, no id twice."""
    ids = [a.id for a in wf.agents]
    if not ids:
        raise WorkflowError(f"workflow {wf.name!r}: no agents")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise WorkflowError(f"workflow {wf.name!r}: agent ids {dup} are declared twice", agent=dup[0])


def _validate_agent(wf: Workflow, a: AgentSpec) -> None:
    """One agent's model, adapter (on the same model), tools and output view exist."""
    name = wf.name
    if a.model not in wf.models:
        raise WorkflowError(
            f"workflow {name!r}: agent {a.id!r} maps to unknown model {a.model!r} "
            f"(models: {sorted(wf.models)})",
            agent=a.id,
        )
    if a.adapter:
        ad = wf.adapters.get(a.adapter)
        if ad is None:
            raise WorkflowError(
                f"workflow {name!r}: agent {a.id!r} uses unknown adapter {a.adapter!r} "
                f"(adapters: {sorted(wf.adapters)})",
                agent=a.id,
            )
        if ad.model != a.model:
            raise WorkflowError(
                f"workflow {name!r}: agent {a.id!r} runs on model {a.model!r} but its adapter "
                f"{a.adapter!r} belongs to model {ad.model!r}",
                agent=a.id,
            )
    for t in a.tools:
        if t not in wf.tools:
            raise WorkflowError(
                f"workflow {name!r}: agent {a.id!r} uses unknown tool {t!r} (tools: {sorted(wf.tools)})",
                agent=a.id,
            )
    if a.output not in OUTPUT_VIEWS and ":" not in a.output:
        raise WorkflowError(
            f"workflow {name!r}: agent {a.id!r}: unknown output view {a.output!r} "
            f"(known: {sorted(OUTPUT_VIEWS)}, or 'module:function')",
            agent=a.id,
        )


def _validate_tables(wf: Workflow) -> None:
    """Each adapter's model exists; each tool is of a known kind."""
    for ad_name, ad in wf.adapters.items():
        if ad.model not in wf.models:
            raise WorkflowError(
                f"workflow {wf.name!r}: adapter {ad_name!r} belongs to unknown model {ad.model!r}"
            )
    for tname, spec in wf.tools.items():
        if spec.get("kind") not in ("python", "bm25"):
            raise WorkflowError(f"workflow {wf.name!r}: tool {tname!r} has unknown kind {spec.get('kind')!r}")


def _validate_credit(wf: Workflow, agent_ids: set[str]) -> None:
    """Role weights: each agent once, each in [0, 1]; the judge's model is the workflow's."""
    name = wf.name
    if wf.credit.rule == "role" and isinstance(wf.credit.weights, dict):
        missing = sorted(agent_ids - set(wf.credit.weights))
        bad = {k: v for k, v in wf.credit.weights.items() if not 0.0 <= v <= 1.0}
        if missing or bad or set(wf.credit.weights) - agent_ids:
            raise WorkflowError(
                f"workflow {name!r}: credit weights need each agent once, each in [0, 1] "
                f"(missing {missing}, out of range {bad}, unknown {sorted(set(wf.credit.weights) - agent_ids)})"
            )
    if wf.credit.judge_model and wf.credit.judge_model not in wf.models:
        raise WorkflowError(
            f"workflow {name!r}: credit judge_model {wf.credit.judge_model!r} is not one of its models "
            f"{sorted(wf.models)}"
        )


def _validate_reward(wf: Workflow, agent_ids: set[str]) -> None:
    """The reward function is known (or 'module:function'); ``answer_from`` names an agent."""
    name = wf.name
    if wf.reward is not None and wf.reward.name not in REWARD_FUNCTIONS and ":" not in wf.reward.name:
        raise WorkflowError(
            f"workflow {name!r}: unknown reward {wf.reward.name!r} (known: {sorted(REWARD_FUNCTIONS)})"
        )
    if wf.reward is not None and wf.reward.answer_from and wf.reward.answer_from not in agent_ids:
        raise WorkflowError(
            f"workflow {name!r}: reward.answer_from names agent {wf.reward.answer_from!r}, which is not "
            f"an agent (agents: {sorted(agent_ids)})",
            agent=wf.reward.answer_from,
        )


def _validate_static(wf: Workflow) -> None:
    g, name = wf.graph, wf.name
    if g.start or g.routes or g.router:
        raise WorkflowError(
            f"workflow {name!r}: a static graph takes no start/routes/router (kind='dynamic')"
        )
    ids = set(a.id for a in wf.agents)
    nodes = wf.nodes()
    nids = [n.id for n in nodes]
    dup = sorted({i for i in nids if nids.count(i) > 1})
    if dup:
        raise WorkflowError(f"workflow {name!r}: node ids {dup} are declared twice")
    for n in nodes:
        if n.agent not in ids:
            raise WorkflowError(
                f"workflow {name!r}: node {n.id!r} names unknown agent {n.agent!r}", agent=n.agent
            )
    known = set(nids)
    for src, dst in g.edges:
        for end in (src, dst):
            if end not in known:
                raise WorkflowError(
                    f"workflow {name!r}: edge {src}->{dst}: unknown agent/node {end!r} (nodes: {nids})",
                    agent=end,
                    edge=(src, dst),
                )
        if src == dst:
            raise WorkflowError(
                f"workflow {name!r}: edge {src}->{dst} is a self-loop (a cycle)", agent=src, edge=(src, dst)
            )
    _levels(wf, nids)  # raises on a cycle
    for rule in g.stop_when:
        if rule.node not in known:
            raise WorkflowError(
                f"workflow {name!r}: stop_when names unknown node {rule.node!r}", agent=rule.node
            )
        _compile(rule.when, f"workflow {name!r}: stop_when on {rule.node!r}")
    for n in nodes:
        readable = {s for s, d in g.edges if d == n.id}
        if g.turns > 1:
            readable |= set(nids) if g.history == "all" else ({n.id} if g.history == "self" else set())
        _validate_template(wf, wf.agent(n.agent), readable, node=n.id)


def _validate_dynamic(wf: Workflow) -> None:
    g, name = wf.graph, wf.name
    ids = [a.id for a in wf.agents]
    if g.nodes or g.stop_when or g.turns != 1:
        raise WorkflowError(
            f"workflow {name!r}: a dynamic graph takes no nodes/stop_when/turns (turns start when 'start' acts)"
        )
    if g.start not in ids:
        raise WorkflowError(
            f"workflow {name!r}: dynamic graph start {g.start!r} is not an agent (agents: {ids})",
            agent=g.start,
        )
    if g.routes and g.router:
        raise WorkflowError(f"workflow {name!r}: give routes or a router, not both")
    for src, dst in g.edges:
        for end in (src, dst):
            if end not in ids:
                raise WorkflowError(
                    f"workflow {name!r}: edge {src}->{dst}: unknown agent {end!r} (agents: {ids})",
                    agent=end,
                    edge=(src, dst),
                )
    for r in g.routes:
        if r.after not in ids:
            raise WorkflowError(f"workflow {name!r}: route after unknown agent {r.after!r}", agent=r.after)
        if r.next != END and r.next not in ids:
            raise WorkflowError(
                f"workflow {name!r}: route {r.after}->{r.next}: unknown agent {r.next!r}",
                agent=r.next,
                edge=(r.after, r.next),
            )
        _compile(r.when, f"workflow {name!r}: route {r.after}->{r.next}")
    for a in wf.agents:
        _validate_template(wf, a, {s for s, d in g.edges if d == a.id}, node=a.id)


def _compile(pattern: str, where: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise WorkflowError(f"{where}: bad regex {pattern!r}: {e}") from None


def template_fields(template: str) -> list[tuple[str, str | None]]:
    """(root, key) of every ``{...}`` field: ``{out[solver]}`` -> ('out', 'solver')."""
    out = []
    for _, fname, _, _ in string.Formatter().parse(template):
        if fname is None:
            continue
        m = re.fullmatch(r"([A-Za-z_]\w*)(?:\[([^\]]+)\])?.*", fname)
        if not m:
            raise ValueError(f"field {{{fname}}}")
        out.append((m.group(1), m.group(2)))
    return out


def _validate_template(wf: Workflow, a: AgentSpec, readable: set[str], node: str) -> None:
    where = f"node {node!r}" if node != a.id else f"agent {a.id!r}"
    for text, label in ((a.template, "template"), (a.parent_format, "parent_format")):
        try:
            fields = template_fields(text)
        except ValueError as e:
            raise WorkflowError(
                f"workflow {wf.name!r}: {where}: bad {label} {text!r}: {e}", agent=a.id
            ) from None
        roots = _TEMPLATE_ROOTS if label == "template" else {"agent", "role", "node", "output", "turn"}
        for root, key in fields:
            if root not in roots:
                raise WorkflowError(
                    f"workflow {wf.name!r}: {where}: {label} field {{{root}}} is not one of {sorted(roots)}",
                    agent=a.id,
                )
            if root == "out" and key not in readable:
                raise WorkflowError(
                    f"workflow {wf.name!r}: {where}: template reads {{out[{key}]}} but can only read "
                    f"{sorted(readable)} (is an edge {key}->{node} missing?)",
                    agent=a.id,
                    edge=(str(key), node),
                )


def _levels(wf: Workflow, nids: list[str]) -> list[list[str]]:
    """Kahn's algorithm, keeping node order inside a level; a cycle raises naming its nodes."""
    preds: dict[str, set[str]] = {n: set() for n in nids}
    for s, d in wf.graph.edges:
        preds[d].add(s)
    done: set[str] = set()
    levels = []
    while len(done) < len(nids):
        level = [n for n in nids if n not in done and preds[n] <= done]
        if not level:
            left = [n for n in nids if n not in done]
            cycle = _find_cycle(left, preds)
            edge = (cycle[-2], cycle[-1]) if len(cycle) >= 2 else None
            raise WorkflowError(
                f"workflow {wf.name!r}: static graph has a cycle {' -> '.join(cycle)}",
                agent=cycle[0] if cycle else None,
                edge=edge,
            )
        levels.append(level)
        done |= set(level)
    return levels


def _find_cycle(left: list[str], preds: dict[str, set[str]]) -> list[str]:
    # Walk predecessors inside the unresolved set until a node repeats.
    path: list[str] = []
    node = left[0]
    while node not in path:
        path.append(node)
        node = sorted(p for p in preds[node] if p in left)[0]
    cyc = path[path.index(node) :] + [node]
    return list(reversed(cyc))


# ============================================================================ output views, rewards


def _addition_candidate(text: str) -> str:
    from teamrl.rewards import addition

    return addition.parse_answer(text)[:3].rjust(3, "0")


def _math_answer(text: str) -> str:
    from teamrl.rewards.math_reward import extract_answer

    found = extract_answer(text)
    return found[0] if found else text.strip()


def _code(text: str) -> str:
    from teamrl.rewards.code_reward import extract_code

    return extract_code(text)


OUTPUT_VIEWS: dict[str, Callable[[str], str]] = {
    "text": lambda t: t,
    "strip": str.strip,
    "addition_candidate": _addition_candidate,
    "math_answer": _math_answer,
    "code": _code,
}


@dataclass
class ActView:
    """What a reward function sees of one node act (all its tool rounds together)."""

    index: int  # act index (order of acting)
    node: str
    agent_id: str
    role: str
    turn: int
    text: str  # the act's full response: every round's text and tool results
    output: str  # the agent's output view of ``text``
    parents: list[int]  # act indices whose outputs the prompt contained
    steps: list[int]  # the trajectory step indices of this act (one per tool round)


@dataclass
class EpisodeRewards:
    acts: list[float]  # one per act; each of the act's steps gets it
    turns: list[float]  # one per turn that ran
    trajectory: float


class RewardFunction(Protocol):
    """``(task, acts) -> EpisodeRewards``; may block (sandbox, sympy): it runs in a worker thread."""

    def __call__(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards: ...


class AdditionReward:
    """The embedded task (``teamrl.rewards.addition``): as ``teamrl run`` scores it.

    Solver acts: 1 if their answer is the sum. Verifier acts: 1 for a correct verdict on the
    candidate of the answering act they read. Turn reward: the turn's last answering act;
    trajectory reward: the final one. The answering acts are those of ``answer_agent`` when given
    (the workflow's ``reward.answer_from``), else those of role ``solver``. ``role_scale``
    multiplies a role's step scores (e.g. ``{"verifier": 10}``: agents with different reward
    scales, the case Dr. MAS is about).
    """

    def __init__(self, role_scale: Mapping[str, float] | None = None, answer_agent: str = "") -> None:
        self.role_scale = dict(role_scale or {})
        self.answer_agent = answer_agent

    def _answers(self, a: ActView) -> bool:
        return a.agent_id == self.answer_agent if self.answer_agent else a.role == "solver"

    def verdict(self, text: str) -> bool | None:
        """A verifier's verdict in ``text``: True accept, False reject, None unparsable."""
        from teamrl.rewards import addition

        return addition.verifier_verdict(text)

    def __call__(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards:
        from teamrl.rewards import addition

        scores = []
        for a in acts:
            if a.role == "verifier":
                read = [acts[p] for p in a.parents if self._answers(acts[p])]
                cand = read[-1].output if read else ""
                scores.append(addition.verifier_reward(dict(task), cand, a.text))
            else:  # scored on the candidate the verifier sees, as ``teamrl run`` does
                scores.append(addition.solver_reward(dict(task), a.output))
        if self.role_scale:
            scores = [x * self.role_scale.get(a.role, 1.0) for x, a in zip(scores, acts, strict=True)]
        return _outcome(acts, scores, self._answers)


def _outcome(
    acts: Sequence[ActView], scores: list[float], answers: Callable[[ActView], bool]
) -> EpisodeRewards:
    n_turns = max((a.turn for a in acts), default=-1) + 1
    turns = []
    for t in range(n_turns):
        last = [s for a, s in zip(acts, scores, strict=True) if a.turn == t and answers(a)]
        turns.append(last[-1] if last else 0.0)
    final = [s for a, s in zip(acts, scores, strict=True) if answers(a)]
    return EpisodeRewards(scores, turns, final[-1] if final else 0.0)


class OutcomeReward:
    """A ``teamrl.rewards`` reward on the answer role's output; the team shares the outcome.

    Answering acts (those of agent ``answer_agent`` when given, the workflow's
    ``reward.answer_from``; else those of role ``answer_role``) are scored on their own output view
    (``reward`` from the registry, with ``reward_kwargs``); the last one is the trajectory reward; acts of ``verifier_role`` get 1 for a
    correct verdict (``accept`` / ``reject`` regexes on their text) on the answer they read; every
    other act gets the trajectory reward (team credit).
    """

    def __init__(
        self,
        reward: str,
        answer_role: str = "solver",
        reward_kwargs: Mapping[str, Any] | None = None,
        verifier_role: str | None = None,
        accept: str = r"(?i)verdict:\s*correct",
        reject: str = r"(?i)verdict:\s*(?:wrong|incorrect)",
        pass_threshold: float = 1.0,
        answer_agent: str = "",
    ) -> None:
        from teamrl.rewards.base import get_reward

        self.scorer = get_reward(reward, **dict(reward_kwargs or {}))
        self.answer_role = answer_role
        self.answer_agent = answer_agent
        self.verifier_role = verifier_role
        self.accept, self.reject = re.compile(accept), re.compile(reject)
        self.pass_threshold = pass_threshold

    def __call__(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards:
        own: dict[int, float] = {}
        for a in acts:
            if self._answers(a):
                own[a.index] = float(self.scorer(a.output, task).score)
        answers = [a for a in acts if self._answers(a)]
        final = own[answers[-1].index] if answers else 0.0
        scores = []
        for a in acts:
            if a.index in own:
                scores.append(own[a.index])
            elif self.verifier_role and a.role == self.verifier_role:
                read = [p for p in a.parents if p in own]
                ok = own[read[-1]] >= self.pass_threshold if read else False
                verdict = (
                    True if self.accept.search(a.text) else False if self.reject.search(a.text) else None
                )
                scores.append(1.0 if verdict is not None and verdict == ok else 0.0)
            else:
                scores.append(final)
        return _outcome(acts, scores, self._answers)

    def _answers(self, a: ActView) -> bool:
        return a.agent_id == self.answer_agent if self.answer_agent else a.role == self.answer_role

    def verdict(self, text: str) -> bool | None:
        """A verifier's verdict in ``text``: True accept, False reject, None unparsable."""
        return True if self.accept.search(text) else False if self.reject.search(text) else None


REWARD_FUNCTIONS: dict[str, Callable[..., RewardFunction]] = {
    "addition": AdditionReward,
    "outcome": OutcomeReward,
}


def _resolve(table: Mapping[str, Any], name: str, what: str) -> Any:
    if name in table:
        return table[name]
    if ":" in name:
        module, attr = name.split(":", 1)
        return getattr(importlib.import_module(module), attr)
    raise WorkflowError(f"unknown {what} {name!r} (known: {sorted(table)})")


def data_path(name: str) -> Path:
    """A file bundled in ``teamrl/rollout/workflows/data/`` (a package resource, read by name)."""
    import importlib.resources

    p = importlib.resources.files("teamrl.rollout.workflows").joinpath("data", name)
    path = Path(str(p))
    if not path.is_file():
        raise FileNotFoundError(f"no bundled data file {name!r} in {path.parent}")
    return path


def resolve_data_path(path: str) -> Path:
    """``builtin:<file>`` is a file bundled with ``teamrl.rollout.workflows``; anything else a path."""
    if path.startswith("builtin:"):
        return data_path(path.removeprefix("builtin:"))
    return Path(path)


# ============================================================================ executor


class Backend(Protocol):
    """What the executor needs from an engine (``teamrl.rollout.engine.RolloutEngine`` is one)."""

    async def generate(
        self, prompt_ids: Sequence[int], sampling: Any, adapter: str = "", seed: int | None = None
    ) -> Any: ...


@dataclass
class RouteState:
    """What a dynamic router sees after an agent acted."""

    task: Mapping[str, Any]
    acts: list[ActView]
    visits: dict[str, int]  # agent -> times it acted
    fired: dict[int, int]  # route rule index -> times it fired

    @property
    def last(self) -> ActView:
        return self.acts[-1]


@dataclass
class _Act:
    index: int  # order of acting; also the seed offset
    node: str
    agent: AgentSpec
    turn: int
    seed: int | None
    parents: list[int] = field(default_factory=list)  # act indices whose outputs the prompt contains
    steps: list[AgentStep] = field(default_factory=list)  # one per tool round
    text: str = ""
    output: str = ""


def _backend_for(backend: Any, model_id: str) -> Any:
    if isinstance(backend, Mapping):
        if model_id not in backend:
            raise WorkflowError(f"no backend for model {model_id!r} (backends: {sorted(backend)})")
        return backend[model_id]
    pick = getattr(backend, "backend_for", None)
    if callable(pick):
        return pick(model_id)
    served = getattr(backend, "model_id", None)
    if isinstance(served, str) and served and served != model_id:
        raise WorkflowError(f"backend serves model {served!r}, not {model_id!r}")
    return backend


def _tokenizer_for(tokenizers: Any, model_id: str) -> Tokenizer:
    if isinstance(tokenizers, Mapping):
        if model_id not in tokenizers:
            raise WorkflowError(f"no tokenizer for model {model_id!r} (tokenizers: {sorted(tokenizers)})")
        return tokenizers[model_id]
    return tokenizers


def _view(name: str) -> Callable[[str], str]:
    return _resolve(OUTPUT_VIEWS, name, "output view")


def _sampling(agent: AgentSpec, tok: Tokenizer, has_tools: bool) -> tuple[Any, list[str]]:
    from teamrl.rollout.engine import Sampling

    stops = list(agent.sampling.stop) + ([TOOL_STOP] if has_tools else [])
    ids = list(agent.sampling.stop_token_ids)
    for s in stops:
        enc = tok.encode(s, add_special=False)
        if len(enc) == 1 and enc[0] not in ids:
            ids.append(enc[0])
    samp = Sampling(
        max_tokens=agent.sampling.max_tokens,
        temperature=agent.sampling.temperature,
        top_p=agent.sampling.top_p,
        stop_token_ids=tuple(ids),
    )
    return samp, stops


def _cut_at_stop(
    ids: list[int], lps: list[float], tok: Tokenizer, stops: list[str]
) -> tuple[list[int], list[float], bool]:
    """Keep the shortest prefix whose text contains a stop string (log-probs unchanged)."""
    if not stops or not any(s in tok.decode(ids) for s in stops):
        return ids, lps, False
    lo, hi = 1, len(ids)
    while lo < hi:  # containment grows with the prefix: binary search the first n that has it
        mid = (lo + hi) // 2
        if any(s in tok.decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo], lps[:lo], lo < len(ids)


def _finish(reason: str) -> str:
    return reason if reason in ("stop", "length", "abort") else "stop"


def _render(
    wf: Workflow, act: _Act, acts: list[_Act], task: Mapping[str, Any], readable: dict[str, int]
) -> tuple[str, list[int]]:
    """The user text of ``act`` and the act indices it contains (its parents)."""
    agent = act.agent
    fields = template_fields(agent.template)
    used: list[int] = []
    out: dict[str, str] = {}
    for root, key in fields:
        if root == "out" and key is not None:
            if key in readable:
                out[key] = acts[readable[key]].output
                used.append(readable[key])
            else:
                out[key] = ""
    parents_text = ""
    if any(root == "parents" for root, _ in fields):
        for node, idx in readable.items():
            p = acts[idx]
            parents_text += agent.parent_format.format(
                agent=p.agent.id, role=p.agent.role, node=node, output=p.output, turn=p.turn
            )
            used.append(idx)
    text = agent.template.format(
        task=_TaskView(task),
        out=_Missing(out),
        parents=parents_text,
        profile=agent.profile or "",
        turn=act.turn,
    )
    return text, sorted(set(used))


class _TaskView(dict):
    def __init__(self, task: Mapping[str, Any]) -> None:
        super().__init__(task)

    def __missing__(self, key: str) -> str:
        raise WorkflowError(
            f"the task record has no field {key!r} that the template needs (fields: {sorted(self)})"
        )


class _Missing(dict):
    def __missing__(self, key: str) -> str:
        return ""


def _prompt_ids(agent: AgentSpec, tok: Tokenizer, user: str) -> list[int]:
    if agent.chat:
        msgs = ([{"role": "system", "content": agent.profile}] if agent.profile else []) + [
            {"role": "user", "content": user}
        ]
        ids = tok.chat(msgs)
        if ids is not None:
            return list(ids)
    if agent.profile and "{profile}" not in agent.template:
        user = agent.profile + "\n\n" + user
    return tok.encode(user)


def _seed(seed: int | None, act_index: int, tool_round: int) -> int | None:
    if seed is None:
        return None
    return (seed + act_index + 100_003 * tool_round) % (2**31)


async def _run_act(
    wf: Workflow, act: _Act, prompt: list[int], backend: Any, tok: Tokenizer, model_id: str
) -> None:
    """Generate one node act, with its tool rounds; fills ``act.steps`` (parents filled in later)."""
    agent = act.agent
    tools = wf.built_tools() if agent.tools else {}
    samp, stops = _sampling(agent, tok, bool(agent.tools))
    engine = _backend_for(backend, model_id)
    transcript = ""
    for rnd in range(agent.max_tool_rounds + 1):
        gen = await engine.generate(prompt, samp, agent.adapter, seed=_seed(act.seed, act.index, rnd))
        ids, lps, cut = _cut_at_stop(list(gen.token_ids), list(gen.logprobs), tok, stops)
        text = tok.decode(ids)
        step = AgentStep(
            agent_id=agent.id,
            role=agent.role,
            model_id=model_id,
            adapter=agent.adapter,
            policy_version=int(gen.version),
            turn=act.turn,
            parents=np.zeros(0, np.int32),
            prompt_ids=np.asarray(prompt, np.int32),
            response_ids=np.asarray(ids, np.int32),
            logprobs=np.asarray(lps, np.float32),
            finish_reason="stop" if cut else _finish(gen.finish_reason),
            response_text=text,
            t_start=float(gen.t_start),
            t_end=float(gen.t_end),
        )
        act.steps.append(step)
        transcript += text
        call = parse_tool_call(text) if agent.tools and rnd < agent.max_tool_rounds else None
        if call is None:
            break
        if call.name in agent.tools:
            tool = tools[call.name]
            result = await asyncio.to_thread(tool, call.arguments)
        else:
            result = f"unknown tool {call.name!r}; available: {', '.join(agent.tools)}"
        step.tool_calls.append(ToolCall(call.name, call.arguments, result))
        appended = format_result(result)
        transcript += appended
        prompt = prompt + ids + tok.encode(appended, add_special=False)
    act.text = transcript
    act.output = _view(agent.output)(transcript)


async def run_episode(
    workflow: Workflow,
    task: Mapping[str, Any],
    backend: Any,
    *,
    tokenizers: Tokenizer | Mapping[str, Tokenizer],
    seed: int | None,
    incarnation: str,
    seq: int,
    group_id: str,
    versions: Mapping[str, int] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> GraphTrajectory:
    """Run one episode of ``workflow`` on ``task`` and return its graph trajectory with rewards.

    ``backend``: one engine for every model, a ``{model_id: engine}`` mapping (heterogeneous
    teams), or an object with ``backend_for(model_id)``. ``tokenizers``: one tokenizer or one per
    model id. ``seed``: act ``k`` samples with ``seed + k`` (tool round ``r`` adds ``100003 r``);
    ``None`` leaves sampling unseeded. ``versions``: the adapter versions the caller expects
    (recorded in ``metadata['versions']``); each step records the version its ``Generation``
    reports. ``metadata``: extra string entries for the trajectory (e.g. ``profile_version``).
    Cancellation propagates (``asyncio.CancelledError``); nothing partial is returned.
    """
    _check_backends(workflow, backend, tokenizers)  # fail before generating anything
    acts: list[_Act] = []
    if workflow.graph.kind == "static":
        termination = await _run_static(workflow, task, backend, tokenizers, seed, acts)
    else:
        termination = await _run_dynamic(workflow, task, backend, tokenizers, seed, acts)
    steps, act_steps = _link_steps(acts)
    views = _views(acts, act_steps)
    rewards = await _episode_rewards(workflow, task, acts, views)
    act_credit, credit_meta = await _assign_credit(workflow, views, rewards, backend, tokenizers, seed)
    for i, a in enumerate(acts):
        for st in a.steps:
            st.reward = float(act_credit[i])
    return GraphTrajectory(
        episode_id=uuid.uuid4().hex,
        incarnation=incarnation,
        seq=seq,
        task_id=str(task.get("id", "")),
        group_id=group_id,
        workflow=workflow.name,
        steps=steps,
        reward=float(rewards.trajectory),
        turn_rewards=np.asarray(rewards.turns, np.float32),
        metadata=_episode_metadata(termination, seed, {**credit_meta, **dict(metadata or {})}, versions),
    )


def _check_backends(workflow: Workflow, backend: Any, tokenizers: Any) -> None:
    """Every model an agent runs on has a backend and a tokenizer (raises WorkflowError)."""
    for model_id in {a.model for a in workflow.agents}:
        _backend_for(backend, model_id)
        _tokenizer_for(tokenizers, model_id)


def _link_steps(acts: list[_Act]) -> tuple[list[AgentStep], list[list[int]]]:
    """Every act's steps in acting order, each step's ``parents`` set (its act's parents' steps and
    the act's previous tool round); and the step indices of each act."""
    steps: list[AgentStep] = []
    act_steps: list[list[int]] = []
    for act in acts:
        mine: list[int] = []
        for r, st in enumerate(act.steps):
            parents = [i for p in act.parents for i in act_steps[p]] + ([mine[-1]] if r else [])
            st.parents = np.asarray(sorted(set(parents)), np.int32)
            mine.append(len(steps))
            steps.append(st)
        act_steps.append(mine)
    return steps, act_steps


async def _episode_rewards(
    workflow: Workflow, task: Mapping[str, Any], acts: list[_Act], views: list[ActView]
) -> EpisodeRewards:
    """The workflow's reward function on the finished acts (all zero without one)."""
    n_turns = max((a.turn for a in acts), default=-1) + 1
    rewards = EpisodeRewards([0.0] * len(acts), [0.0] * n_turns, 0.0)
    fn = workflow.reward_fn()
    if fn is not None:
        rewards = await asyncio.to_thread(fn, task, views)
        if len(rewards.acts) != len(acts):
            raise WorkflowError(
                f"reward {workflow.reward.name!r} returned {len(rewards.acts)} act rewards for {len(acts)} acts"
            )
    return rewards


def _episode_metadata(
    termination: str, seed: int | None, extra: dict[str, str], versions: Mapping[str, int] | None
) -> dict[str, str]:
    """The trajectory's metadata: how it ended, its seed, ``extra`` (credit, the caller's), versions."""
    metadata = {"termination": termination, "seed": "" if seed is None else str(seed), **extra}
    if versions is not None:
        metadata["versions"] = json.dumps(dict(versions), sort_keys=True)
    return metadata


async def _assign_credit(
    wf: Workflow,
    views: list[ActView],
    rewards: EpisodeRewards,
    backend: Any,
    tokenizers: Any,
    seed: int | None,
) -> tuple[list[float], dict[str, str]]:
    """Each act's reward under ``wf.credit`` and the metadata it adds (rule, critique)."""
    from teamrl.rewards import credit as C
    from teamrl.rollout.engine import Sampling

    spec, acts_r, team = wf.credit, list(rewards.acts), float(rewards.trajectory)
    if spec.rule == "reward" or not views:
        return acts_r, {}
    agents = [v.agent_id for v in views]
    meta = {"credit": spec.rule}
    if spec.rule == "turn":
        returns = C.turn_discount(rewards.turns, spec.gamma)
        return [returns[v.turn] if v.turn < len(returns) else 0.0 for v in views], meta
    if spec.rule == "role":
        own: dict[str, list[float]] = {}
        for v, r in zip(views, acts_r, strict=True):
            own.setdefault(v.agent_id, []).append(float(r))
        by = C.per_role(team, {a: sum(x) / len(x) for a, x in own.items()}, spec.weights)
        return [by[a] for a in agents], meta
    if spec.rule == "equal":
        by = C.equal_split(team, agents)
        return [by[a] for a in agents], meta
    # judge: a model of this workflow, base weights, reads the transcript and apportions the outcome
    model_id = spec.judge_model or wf.agents[0].model
    steps = [{"agent_id": v.agent_id, "role": v.role, "text": v.text} for v in views]
    prompt = C.judge_prompt(steps, "success" if team > 0 else "failure", team)
    reason, critique = "ok", ""
    try:
        tok = _tokenizer_for(tokenizers, model_id)
        ids = tok.chat([{"role": "user", "content": prompt}]) or tok.encode(prompt)
        samp = Sampling(max_tokens=spec.max_tokens, temperature=spec.temperature)
        gen = await _backend_for(backend, model_id).generate(ids, samp, adapter="", seed=seed)
        shares, critique = C.parse_judge_answer(gen.text, list(dict.fromkeys(agents)))
        total = sum(shares.values())
        by = {a: team * shares[a] / total for a in shares}
    except TokenizerError:  # the model's vocabulary cannot read the judge prompt (the embedded model)
        reason = "untokenizable"
    except ValueError:  # an answer that is no credit object
        reason = "unparsable"
    if reason != "ok":
        C.JUDGE_FALLBACKS.labels(reason).inc()
        by = C.equal_split(team, agents)
    meta.update(credit_reason=reason, **({"critique": critique} if critique else {}))
    return [by[a] for a in agents], meta


def _new_act(acts: list[_Act], node: str, agent: AgentSpec, turn: int, seed: int | None) -> _Act:
    act = _Act(index=len(acts), node=node, agent=agent, turn=turn, seed=seed)
    acts.append(act)
    return act


async def _gather_level(wf: Workflow, batch: list[tuple[_Act, list[int], Tokenizer]], backend: Any) -> None:
    """Generate one DAG level concurrently; the first failure cancels its siblings and is raised as is."""
    if len(batch) == 1:
        act, prompt, tok = batch[0]
        await _run_act(wf, act, prompt, backend, tok, act.agent.model)
        return
    try:
        async with asyncio.TaskGroup() as tg:
            for act, prompt, tok in batch:
                tg.create_task(_run_act(wf, act, prompt, backend, tok, act.agent.model))
    except BaseExceptionGroup as eg:
        if len(eg.exceptions) == 1:
            raise eg.exceptions[0] from None
        raise


async def _run_static(
    wf: Workflow, task: Mapping[str, Any], backend: Any, tokenizers: Any, seed: int | None, acts: list[_Act]
) -> str:
    g = wf.graph
    nodes = {n.id: n for n in wf.nodes()}
    levels = wf.levels()
    preds: dict[str, list[str]] = {n: [s for s, d in g.edges if d == n] for n in nodes}
    stops = [(r.node, re.compile(r.when)) for r in g.stop_when]
    latest: dict[str, int] = {}  # node -> act index of its latest act
    for turn in range(g.turns):
        prev = dict(latest)
        this: dict[str, int] = {}
        for level in levels:
            batch = []
            for nid in level:
                agent = wf.agent(nodes[nid].agent)
                readable = {s: this[s] for s in preds[nid] if s in this}
                if turn > 0 and g.history != "none":
                    for s, idx in prev.items():
                        if (g.history == "all" or s == nid) and s not in readable:
                            readable[s] = idx
                act = _new_act(acts, nid, agent, turn, seed)
                tok = _tokenizer_for(tokenizers, agent.model)
                user, act.parents = _render(wf, act, acts, task, readable)
                batch.append((act, _prompt_ids(agent, tok, user), tok))
            await _gather_level(wf, batch, backend)
            for act, _, _ in batch:
                this[act.node] = act.index
        latest.update(this)
        for node, pat in stops:
            if node in this and pat.search(acts[this[node]].output):
                return "stop_rule"
    return "turns_done"


async def _run_dynamic(
    wf: Workflow, task: Mapping[str, Any], backend: Any, tokenizers: Any, seed: int | None, acts: list[_Act]
) -> str:
    g = wf.graph
    router = _resolve({}, g.router, "router") if g.router else None
    rules = [(i, r, re.compile(r.when)) for i, r in enumerate(g.routes)]
    preds = {a.id: [s for s, d in g.edges if d == a.id] for a in wf.agents}
    latest: dict[str, int] = {}
    visits: dict[str, int] = {}
    fired: dict[int, int] = {}
    current: str | None = g.start
    turn = -1
    while current is not None:
        if len(acts) >= g.max_steps:
            return "max_steps"
        if current == g.start:
            turn += 1
        agent = wf.agent(current)
        act = _new_act(acts, current, agent, turn, seed)
        tok = _tokenizer_for(tokenizers, agent.model)
        readable = {s: latest[s] for s in preds[current] if s in latest}
        user, act.parents = _render(wf, act, acts, task, readable)
        await _run_act(wf, act, _prompt_ids(agent, tok, user), backend, tok, agent.model)
        latest[current] = act.index
        visits[current] = visits.get(current, 0) + 1
        if router is not None:
            state = RouteState(task, _views(acts), visits, fired)
            nxt = router(state)
            if nxt is not None and nxt != END and nxt not in {a.id for a in wf.agents}:
                raise WorkflowError(f"router {g.router!r} chose unknown agent {nxt!r}", agent=str(nxt))
            current = None if nxt in (None, END) else nxt
            continue
        current = None
        for i, rule, pat in rules:
            if rule.after != act.node or not pat.search(act.output):
                continue
            if rule.limit is not None and fired.get(i, 0) >= rule.limit:
                continue
            fired[i] = fired.get(i, 0) + 1
            current = None if rule.next == END else rule.next
            break
    return "routed_end"


def _views(acts: list[_Act], act_steps: list[list[int]] | None = None) -> list[ActView]:
    """What a reward function or router sees of each act (``act_steps``: its step indices, if known)."""
    return [
        ActView(
            i,
            a.node,
            a.agent.id,
            a.agent.role,
            a.turn,
            a.text,
            a.output,
            list(a.parents),
            act_steps[i] if act_steps is not None else [],
        )
        for i, a in enumerate(acts)
    ]
