"""Load-time validation of a workflow: how its parts refer to each other.

Parents (D(a_i, a_j) of one episode) are exactly the steps whose outputs the prompt contains: the
template's ``{out[<node>]}`` references, or every readable step for ``{parents}``. Load-time
validation raises :class:`WorkflowError` naming the agent, node or edge: a cycle in a static DAG,
an unknown agent/node in an edge or route, an agent mapped to an unknown model or adapter, an
adapter shared across base models, a template reading an output it cannot see, and (given the
engine's ``max_lora_rank``, :meth:`teamrl.rollout.workflow.Workflow.check_engine`) an adapter rank
above the engine's maximum.

The checks are pure functions of the parts (``teamrl.rollout.spec``); :func:`check_workflow` runs
them all, in the order a reader checks them, whenever a ``Workflow`` is built.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from teamrl.rewards.base import REWARDS
from teamrl.rollout.spec import (
    END,
    AdapterSpec,
    AgentSpec,
    CreditSpec,
    GraphSpec,
    ModelSpec,
    RewardSpec,
    WorkflowError,
    nodes_of,
)
from teamrl.rollout.views import OUTPUT_VIEWS

_TEMPLATE_ROOTS = {"task", "out", "parents", "profile", "turn"}


class WorkflowParts(Protocol):
    """What the checks read of a workflow (:class:`teamrl.rollout.workflow.Workflow` is one)."""

    name: str
    models: dict[str, ModelSpec]
    adapters: dict[str, AdapterSpec]
    agents: list[AgentSpec]
    graph: GraphSpec
    tools: dict[str, dict[str, Any]]
    reward: RewardSpec | None
    credit: CreditSpec


def check_workflow(wf: WorkflowParts) -> None:
    """Every cross-reference of a workflow's parts, in the order a reader checks them; the first
    problem raises."""
    name, agents, graph = wf.name, wf.agents, wf.graph
    _validate_agent_ids(name, agents)
    for a in agents:
        _validate_agent(name, a, wf.models, wf.adapters, wf.tools)
    _validate_tables(name, wf.adapters, wf.models, wf.tools)
    agent_ids = {a.id for a in agents}
    _validate_credit(name, wf.credit, wf.models, agent_ids)
    _validate_reward(name, wf.reward, agent_ids)
    if graph.kind == "static":
        _validate_static(name, graph, agents)
    else:
        _validate_dynamic(name, graph, agents)


def _validate_agent_ids(name: str, agents: Sequence[AgentSpec]) -> None:
    """At least one agent, no id twice."""
    ids = [a.id for a in agents]
    if not ids:
        raise WorkflowError(f"workflow {name!r}: no agents")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise WorkflowError(f"workflow {name!r}: agent ids {dup} are declared twice", agent=dup[0])


def _validate_agent(
    name: str,
    a: AgentSpec,
    models: Mapping[str, ModelSpec],
    adapters: Mapping[str, AdapterSpec],
    tools: Mapping[str, Any],
) -> None:
    """One agent's model, adapter (on the same model), tools and output view exist."""
    if a.model not in models:
        raise WorkflowError(
            f"workflow {name!r}: agent {a.id!r} maps to unknown model {a.model!r} (models: {sorted(models)})",
            agent=a.id,
        )
    if a.adapter:
        ad = adapters.get(a.adapter)
        if ad is None:
            raise WorkflowError(
                f"workflow {name!r}: agent {a.id!r} uses unknown adapter {a.adapter!r} "
                f"(adapters: {sorted(adapters)})",
                agent=a.id,
            )
        if ad.model != a.model:
            raise WorkflowError(
                f"workflow {name!r}: agent {a.id!r} runs on model {a.model!r} but its adapter "
                f"{a.adapter!r} belongs to model {ad.model!r}",
                agent=a.id,
            )
    for t in a.tools:
        if t not in tools:
            raise WorkflowError(
                f"workflow {name!r}: agent {a.id!r} uses unknown tool {t!r} (tools: {sorted(tools)})",
                agent=a.id,
            )
    _validate_choices(name, a)
    if a.output not in OUTPUT_VIEWS and ":" not in a.output:
        raise WorkflowError(
            f"workflow {name!r}: agent {a.id!r}: unknown output view {a.output!r} "
            f"(known: {sorted(OUTPUT_VIEWS)}, or 'module:function')",
            agent=a.id,
        )


def _validate_choices(name: str, a: AgentSpec) -> None:
    """An agent's ``choices``: two or more distinct non-empty texts, and no tools (a reply is one
    token). That each is one token of the agent's model is checked by the plan (it has the tokenizer)."""
    if not a.choices:
        return
    problem = ""
    if len(a.choices) < 2:
        problem = "needs two choices at least (one leaves nothing to choose or to learn)"
    elif len(set(a.choices)) != len(a.choices) or not all(a.choices):
        problem = "choices must be distinct, non-empty texts"
    elif a.tools:
        problem = "an agent with choices replies with one token and cannot call tools"
    if problem:
        raise WorkflowError(f"workflow {name!r}: agent {a.id!r} choices {a.choices}: {problem}", agent=a.id)


def _validate_tables(
    name: str,
    adapters: Mapping[str, AdapterSpec],
    models: Mapping[str, ModelSpec],
    tools: Mapping[str, Mapping[str, Any]],
) -> None:
    """Each adapter's model exists; each tool is of a known kind."""
    for ad_name, ad in adapters.items():
        if ad.model not in models:
            raise WorkflowError(
                f"workflow {name!r}: adapter {ad_name!r} belongs to unknown model {ad.model!r}"
            )
    for tname, spec in tools.items():
        if spec.get("kind") not in ("python", "bm25"):
            raise WorkflowError(f"workflow {name!r}: tool {tname!r} has unknown kind {spec.get('kind')!r}")


def _validate_credit(
    name: str, credit: CreditSpec, models: Mapping[str, ModelSpec], agent_ids: set[str]
) -> None:
    """Role weights: each agent once, each in [0, 1]; the judge's model is the workflow's."""
    if credit.rule == "role" and isinstance(credit.weights, dict):
        missing = sorted(agent_ids - set(credit.weights))
        bad = {k: v for k, v in credit.weights.items() if not 0.0 <= v <= 1.0}
        if missing or bad or set(credit.weights) - agent_ids:
            raise WorkflowError(
                f"workflow {name!r}: credit weights need each agent once, each in [0, 1] "
                f"(missing {missing}, out of range {bad}, unknown {sorted(set(credit.weights) - agent_ids)})"
            )
    if credit.judge_model and credit.judge_model not in models:
        raise WorkflowError(
            f"workflow {name!r}: credit judge_model {credit.judge_model!r} is not one of its models "
            f"{sorted(models)}"
        )


def _validate_reward(name: str, reward: RewardSpec | None, agent_ids: set[str]) -> None:
    """The reward is registered (or 'module:Factory'); ``answer_from`` names an agent."""
    if reward is not None and reward.name not in REWARDS and ":" not in reward.name:
        raise WorkflowError(f"workflow {name!r}: unknown reward {reward.name!r} (known: {sorted(REWARDS)})")
    if reward is not None and reward.answer_from and reward.answer_from not in agent_ids:
        raise WorkflowError(
            f"workflow {name!r}: reward.answer_from names agent {reward.answer_from!r}, which is not "
            f"an agent (agents: {sorted(agent_ids)})",
            agent=reward.answer_from,
        )


def _validate_static(name: str, g: GraphSpec, agents: Sequence[AgentSpec]) -> None:
    if g.start or g.routes or g.router:
        raise WorkflowError(
            f"workflow {name!r}: a static graph takes no start/routes/router (kind='dynamic')"
        )
    ids = set(a.id for a in agents)
    nodes = nodes_of(g, agents)
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
    dag_levels(name, g.edges, nids)  # raises on a cycle
    for rule in g.stop_when:
        if rule.node not in known:
            raise WorkflowError(
                f"workflow {name!r}: stop_when names unknown node {rule.node!r}", agent=rule.node
            )
        _compile(rule.when, f"workflow {name!r}: stop_when on {rule.node!r}")
    by_id = {a.id: a for a in agents}
    for n in nodes:
        readable = {s for s, d in g.edges if d == n.id}
        if g.turns > 1:
            readable |= set(nids) if g.history == "all" else ({n.id} if g.history == "self" else set())
        _validate_template(name, by_id[n.agent], readable, node=n.id)


def _validate_dynamic(name: str, g: GraphSpec, agents: Sequence[AgentSpec]) -> None:
    ids = [a.id for a in agents]
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
    for a in agents:
        _validate_template(name, a, {s for s, d in g.edges if d == a.id}, node=a.id)


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


def _validate_template(name: str, a: AgentSpec, readable: set[str], node: str) -> None:
    where = f"node {node!r}" if node != a.id else f"agent {a.id!r}"
    for text, label in ((a.template, "template"), (a.parent_format, "parent_format")):
        try:
            fields = template_fields(text)
        except ValueError as e:
            raise WorkflowError(
                f"workflow {name!r}: {where}: bad {label} {text!r}: {e}", agent=a.id
            ) from None
        roots = _TEMPLATE_ROOTS if label == "template" else {"agent", "role", "node", "output", "turn"}
        for root, key in fields:
            if root not in roots:
                raise WorkflowError(
                    f"workflow {name!r}: {where}: {label} field {{{root}}} is not one of {sorted(roots)}",
                    agent=a.id,
                )
            if root == "out" and key not in readable:
                raise WorkflowError(
                    f"workflow {name!r}: {where}: template reads {{out[{key}]}} but can only read "
                    f"{sorted(readable)} (is an edge {key}->{node} missing?)",
                    agent=a.id,
                    edge=(str(key), node),
                )


def dag_levels(name: str, edges: Sequence[tuple[str, str]], nids: list[str]) -> list[list[str]]:
    """Node ids grouped by DAG depth (Kahn's algorithm, keeping node order inside a level); a cycle
    raises naming its nodes (``name``: the workflow's)."""
    preds: dict[str, set[str]] = {n: set() for n in nids}
    for s, d in edges:
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
                f"workflow {name!r}: static graph has a cycle {' -> '.join(cycle)}",
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
