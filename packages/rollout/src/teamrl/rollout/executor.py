"""The executor: one episode of a workflow on its engines, as a graph trajectory with rewards.

``run_episode`` walks the dependency function D (``teamrl.rollout.workflow``): a static DAG level by
level (the nodes of one level are generated concurrently, so vLLM batches them), ``turns`` times; or
a dynamic graph act by act, asking the routes (or the router, with a :class:`RouteState`) who acts
next. Then the workflow's reward scores the acts (``teamrl.rewards.outcome``, in a worker thread) and
its credit rule turns the outcome into each step's reward.

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
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from teamrl.protocol.trajectory import AgentStep, GraphTrajectory, ToolCall
from teamrl.rewards.base import ActView, EpisodeRewards
from teamrl.rewards.tokenizer import Tokenizer, TokenizerError
from teamrl.rollout.spec import END, AgentSpec, WorkflowError, resolve_name
from teamrl.rollout.tools import TOOL_STOP, format_result, parse_tool_call
from teamrl.rollout.validation import template_fields
from teamrl.rollout.views import output_view
from teamrl.rollout.workflow import Workflow


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


def _sampling(agent: AgentSpec, tok: Tokenizer, has_tools: bool) -> tuple[Any, list[str]]:
    from teamrl.rollout.engine import Sampling

    stops = list(agent.sampling.stop) + ([TOOL_STOP] if has_tools else [])
    ids = list(agent.sampling.stop_token_ids)
    for s in stops:
        enc = tok.encode(s, add_special=False)
        if len(enc) == 1 and enc[0] not in ids:
            ids.append(enc[0])
    choices = choice_token_ids(agent, tok)
    samp = Sampling(
        max_tokens=1 if choices else agent.sampling.max_tokens,
        temperature=agent.sampling.temperature,
        top_p=agent.sampling.top_p,
        stop_token_ids=tuple(ids),
        allowed_token_ids=choices,
    )
    return samp, stops


def choice_token_ids(agent: AgentSpec, tok: Tokenizer) -> tuple[int, ...]:
    """The token of each of ``agent.choices`` (() for a free-text agent). Each choice must be exactly
    one token that decodes back to it: the agent samples one token among them, and the learner
    normalises its log-probs over the same ids (docs/workflows.md, "choices")."""
    ids: list[int] = []
    for text in agent.choices:
        enc = tok.encode(text, add_special=False)
        if len(enc) != 1 or tok.decode(enc) != text:
            raise WorkflowError(
                f"agent {agent.id!r}: choice {text!r} is {len(enc)} tokens of the model "
                f"({enc[:8]}), not one token that decodes back to it; a choice must be one token "
                "(e.g. ' correct' with its leading space, after a response_prefix)",
                agent=agent.id,
            )
        ids.append(enc[0])
    if len(set(ids)) != len(ids):
        raise WorkflowError(f"agent {agent.id!r}: choices {agent.choices} share a token", agent=agent.id)
    return tuple(ids)


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
    """The agent's prompt: its profile and ``user`` (through the chat template when it has one), then
    its ``response_prefix``, which the model continues."""
    prefix = tok.encode(agent.response_prefix, add_special=False) if agent.response_prefix else []
    if agent.chat:
        msgs = ([{"role": "system", "content": agent.profile}] if agent.profile else []) + [
            {"role": "user", "content": user}
        ]
        ids = tok.chat(msgs)
        if ids is not None:
            return list(ids) + prefix
    if agent.profile and "{profile}" not in agent.template:
        user = agent.profile + "\n\n" + user
    return tok.encode(user) + prefix


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
        text = (agent.response_prefix if rnd == 0 else "") + tok.decode(ids)
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
            await asyncio.sleep(getattr(tool, "latency_s", 0.0))  # the world's latency holds no core
            result = await asyncio.to_thread(tool, call.arguments)
        else:
            result = f"unknown tool {call.name!r}; available: {', '.join(agent.tools)}"
        step.tool_calls.append(ToolCall(call.name, call.arguments, result))
        appended = format_result(result)
        transcript += appended
        prompt = prompt + ids + tok.encode(appended, add_special=False)
    act.text = transcript
    act.output = output_view(agent.output)(transcript)


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
    """The workflow's reward on the finished acts, ``episode(task, views)`` (all zero without one)."""
    n_turns = max((a.turn for a in acts), default=-1) + 1
    rewards = EpisodeRewards([0.0] * len(acts), [0.0] * n_turns, 0.0)
    fn = workflow.reward_fn()
    if fn is not None:
        if workflow.reward.latency_s:  # a remote verifier's latency: other episodes generate meanwhile
            await asyncio.sleep(workflow.reward.latency_s)
        rewards = await asyncio.to_thread(fn.episode, task, views)
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
        schema = C.judge_schema(agents) if spec.structured else None
        samp = Sampling(max_tokens=spec.max_tokens, temperature=spec.temperature, json_schema=schema)
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
    router = resolve_name({}, g.router, "router") if g.router else None
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
