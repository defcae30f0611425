"""The parts of a workflow definition: its tables as pydantic models, and :class:`WorkflowError`.

A workflow (:class:`teamrl.rollout.workflow.Workflow`, one TOML table) is made of these parts:
``[models]`` (:class:`ModelSpec`), ``[adapters]`` (:class:`AdapterSpec`), ``[[agents]]``
(:class:`AgentSpec`, with its ``sampling``), ``[graph]`` (:class:`GraphSpec`: static nodes, edges,
stop rules; dynamic routes), ``[reward]`` (:class:`RewardSpec`), ``[credit]`` (:class:`CreditSpec`)
and ``[tasks]`` (:class:`TaskSource`). Every model refuses unknown fields and is frozen. Each field
is checked on its own here; how the parts refer to each other is checked in
``teamrl.rollout.validation``.

Names in a definition are a key of a registry or ``module:attr`` (:func:`resolve_name`); data paths
are a file or ``builtin:<file>``, a file bundled with ``teamrl.rollout.workflows``
(:func:`resolve_data_path`).
"""

from __future__ import annotations

import importlib
import importlib.resources
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

END = "end"


class WorkflowError(ValueError):
    """A workflow definition is wrong; ``agent`` / ``edge`` name the culprit when there is one."""

    def __init__(self, message: str, *, agent: str | None = None, edge: tuple[str, str] | None = None):
        super().__init__(message)
        self.agent = agent
        self.edge = edge


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingSpec(_Strict):
    """Per-agent sampling (the agent profile's serving config)."""

    max_tokens: int = Field(256, ge=1, description="most tokens sampled per step (per tool round)")
    temperature: float = Field(1.0, ge=0, le=2, description="0 is greedy; 2 is the most vLLM samples at")
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
    response_prefix: str = Field(
        "",
        description="text the agent's reply starts with: put at the end of its prompt (after the chat "
        "template's assistant header), so the model continues it. Never trained (it is prompt), but part "
        "of the response text that routes, other agents and the reward read; e.g. 'VERDICT:' makes a "
        "verifier choose its verdict before anything else",
    )
    choices: list[str] = Field(
        default_factory=list,
        description="the only replies the agent may give, each one token of its model (checked by "
        "`teamrl workflow check`): it samples one token among them (vLLM allowed_token_ids) and the "
        "learner normalises its log-probs over the same tokens; e.g. [' correct', ' wrong'] after "
        "response_prefix 'VERDICT:' makes every verdict parse and both verdicts explorable. [] = free text",
    )


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

    name: str = Field(
        description="a reward of teamrl.rewards.base.REWARDS ('outcome', 'addition', 'math', ...), "
        "or 'module:Factory' building a teamrl.rewards.base.Reward"
    )
    kwargs: dict[str, Any] = Field(default_factory=dict)
    answer_from: str = Field(
        "",
        description="agent id whose last act is the team's answer (its score is the trajectory reward); "
        "'' = the reward's role rule (the last act of role 'solver' / kwargs.answer_role)",
    )
    latency_s: float = Field(
        0.0,
        ge=0.0,
        le=600.0,
        description="seconds an episode waits before it is scored, as a remote verifier or test runner "
        "takes (awaited off the cores: other episodes keep generating)",
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
    structured: bool = Field(
        True,
        description="judge: sample under the credit object's JSON schema (vLLM structured outputs), so a "
        "small judge still answers with a parsable split",
    )


class TaskSource(_Strict):
    """Where the workflow's tasks come from by default (``teamrl.rollout.workflows.load_tasks``)."""

    builtin: str | None = Field(None, description="a built-in task set (workflows.TASK_SETS)")
    path: str | None = Field(None, description="JSONL or Parquet file")
    format: str = Field(
        "auto", description="record format: auto, plain, gsm8k, math, nq, hotpotqa, humaneval"
    )
    seed: int = 0
    difficulty: int | None = Field(
        None,
        ge=1,
        le=3,
        description="math-word only: arithmetic steps per problem, 1 (one add, take-away, multiply or "
        "share) to 3; none = 2 or 3, the default set (docs/real-model.md, 'Task difficulty')",
    )
    max_number: int | None = Field(
        None,
        ge=10,
        description="math-word only: no number written in a problem above this (10 or more); with "
        "difficulty, the level of a task set for a small model (docs/real-model.md, 'Task difficulty')",
    )


def nodes_of(graph: GraphSpec, agents: Sequence[AgentSpec]) -> list[NodeSpec]:
    """Static: the declared nodes, or one per agent; dynamic: one per agent."""
    if graph.kind == "static" and graph.nodes:
        return list(graph.nodes)
    return [NodeSpec(id=a.id, agent=a.id) for a in agents]


def resolve_name(table: Mapping[str, Any], name: str, what: str) -> Any:
    """``table[name]``, or the attribute ``attr`` of module ``module`` for ``name = 'module:attr'``."""
    if name in table:
        return table[name]
    if ":" in name:
        module, attr = name.split(":", 1)
        return getattr(importlib.import_module(module), attr)
    raise WorkflowError(f"unknown {what} {name!r} (known: {sorted(table)})")


def data_path(name: str) -> Path:
    """A file bundled in ``teamrl/rollout/workflows/data/`` (a package resource, read by name)."""
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
