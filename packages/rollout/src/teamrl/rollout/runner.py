"""What a rollout service (and the sync loop of ``teamrl run``) asks of a workflow.

``WorkflowRunner(name_or_toml, engine, incarnation)`` gives: the training tasks of one replica's
shard, the held-out tasks, one episode as a :class:`GraphTrajectory` (through
:func:`teamrl.rollout.executor.run_episode`), and a greedy held-out evaluation. ``name_or_toml`` is a
built-in workflow name (``teamrl.rollout.workflows.names()``) or a workflow TOML file.

``engine`` is one engine, serving the workflow's one base model (:func:`served_model`), or a mapping
``{model_id: engine}``, one engine per base model of a heterogeneous workflow (docs/architecture.md
§3, "Rollout services"); each model's tokenizer is read from its engine's model folder. Either way
``run_episode`` gets ``{model_id: engine}`` and ``{model_id: tokenizer}``, so every agent runs on the
engine of its own model, and a workflow agent whose model has no engine is refused when the runner
is built.

Held-out tasks (:func:`teamrl.rollout.team.split_tasks`): the workflow's task set's own held-out split where it has one (``addition`` ->
``addition-held-out``), else the last tenth of its tasks, which then are not trained on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from teamrl.rollout.team import split_tasks, trained_models, used_models
from teamrl.rollout.workflows import load, shard

__all__ = [
    "WorkflowRunner",
    "answer_agents",
    "evaluation_metrics",
    "served_model",
    "shard",
    "trained_models",
    "used_models",
    "verifier_agents",
    "workflow_metrics",
]


class WorkflowRunner:
    def __init__(
        self,
        name: str,
        engine: Any,
        incarnation: str,
        tasks: str = "",
        model_dir: str | Path | Mapping[str, str | Path] | None = None,
        reward_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """``engine``: one engine, or ``{model_id: engine}``; ``model_dir``: the tokenizer's folder
        (one, or one per model id) when not the engines' own ``cfg.model``."""
        from teamrl.rewards.tokenizer import tokenizer_for
        from teamrl.rollout.spec import WorkflowError
        from teamrl.rollout.workflow import Workflow

        wf = load(name)
        self.name = wf.name
        self.greedy = wf.with_sampling(temperature=0.0)  # evaluation: the unmodified reward
        if reward_kwargs:  # training reward only, e.g. {"role_scale": {"verifier": 10.0}}
            if wf.reward is None:
                raise WorkflowError(f"workflow {wf.name!r} has no reward to pass {sorted(reward_kwargs)} to")
            data = wf.model_dump()
            data["reward"]["kwargs"] = {**data["reward"].get("kwargs", {}), **reward_kwargs}
            wf = Workflow.from_dict(data)
        self.workflow = wf
        self.engine = engine  # as given: one engine, or the mapping
        self.engines = _engines_by_model(wf, engine)
        self.incarnation = incarnation
        self.tokenizers: dict[str, Any] = {}
        for model_id, eng in self.engines.items():
            folder = model_dir.get(model_id) if isinstance(model_dir, Mapping) else model_dir
            folder = folder or getattr(getattr(eng, "cfg", None), "model", None)
            if not folder:
                raise WorkflowError(f"no model folder to take model {model_id!r}'s tokenizer from")
            self.tokenizers[model_id] = tokenizer_for(folder)
        self.tokenizer = next(iter(self.tokenizers.values()))  # the first model's (one model: its only)
        self.train, self.held = split_tasks(wf, tasks or None)
        self._seq = 0
        self.profile_version = -1  # -1: the workflow's own profiles; else the LangMARL version applied

    @classmethod
    def for_rollout(cls, cfg: Any, bases: Mapping[str, Any], incarnation: str) -> WorkflowRunner:
        """The runner a rollout config asks for (``teamrl.rollout.config.RolloutConfig``: its workflow,
        tasks and per-role reward scales) on the engines of ``bases`` (``teamrl.rollout.bases.Bases``,
        one per base model). A rollout service and ``teamrl run --mode sync`` both build theirs here."""
        return cls(
            cfg.workflow,
            {model_id: b.engine for model_id, b in bases.items()},
            incarnation,
            tasks=cfg.tasks,
            reward_kwargs={"role_scale": dict(cfg.reward_scale)} if cfg.reward_scale else None,
        )

    def set_profiles(self, version: int, profiles: dict[str, str]) -> None:
        """Use these agent profiles (system prompts) from now on; episodes in flight keep theirs.

        Raises WorkflowError (an unknown agent) or TokenizerError (text the agent's model's tokenizer
        cannot encode, which would fail every later episode) and keeps the profiles in use."""
        workflow = self.workflow.with_profiles(profiles)  # unknown agents first
        for agent, text in profiles.items():
            self.tokenizers[workflow.agent(agent).model].encode(text + "\n\n", add_special=False)
        self.workflow, self.greedy = workflow, self.greedy.with_profiles(profiles)
        self.profile_version = version

    def train_tasks(self, replica: int, num_replicas: int) -> list[dict]:
        return shard(self.train, replica, num_replicas)

    def held_out_tasks(self, n: int) -> list[dict]:
        return self.held[:n]

    async def episode(self, task: dict, seed: int, *, group_id: str, seq: int = 0, greedy: bool = False):
        """One episode (sampled, or greedy); a cancelled episode raises and returns nothing."""
        from teamrl.rollout.executor import run_episode

        self._seq += 1
        return await run_episode(
            self.greedy if greedy else self.workflow,
            task,
            self.engines,
            tokenizers=self.tokenizers,
            seed=seed,
            incarnation=self.incarnation,
            seq=self._seq - 1,
            group_id=group_id,
            metadata={"profile_version": str(self.profile_version)} if self.profile_version >= 0 else None,
        )

    async def evaluate(self, tasks: list[dict]) -> dict[str, float]:
        """Greedy episodes on ``tasks``; the metrics of :func:`evaluation_metrics`."""
        trajs = await asyncio.gather(
            *[self.episode(t, 0, group_id=f"eval-{i}", greedy=True) for i, t in enumerate(tasks)]
        )
        return workflow_metrics(trajs, self.workflow)


def served_model(wf: Any) -> str | None:
    """The model id one engine serves for ``wf``: its trained agents' model when they are on one,
    else its only generating model; None when that is ambiguous (one engine per model is needed)."""
    trained = trained_models(wf)
    if len(trained) == 1:
        return trained[0]
    used = used_models(wf)
    return used[0] if not trained and len(used) == 1 else None


def _engines_by_model(wf: Any, engine: Any) -> dict[str, Any]:
    """``{model_id: engine}`` for ``wf``: the mapping as given, or one engine keyed by
    :func:`served_model`. Raises WorkflowError naming an agent whose model has no engine."""
    from teamrl.rollout.spec import WorkflowError

    if isinstance(engine, Mapping):
        engines = dict(engine)
    else:
        served = served_model(wf)
        engines = {served: engine} if served is not None else {}
    for a in wf.agents:
        if a.model not in engines:
            raise WorkflowError(
                f"workflow {wf.name!r}: agent {a.id!r} runs on model {a.model!r}, which has no engine "
                + (
                    f"(engines: {sorted(engines)})"
                    if isinstance(engine, Mapping) or engines
                    else f"(one engine given for models {used_models(wf)}: give {{model_id: engine}})"
                ),
                agent=a.id,
            )
    if wf.credit.rule == "judge" and wf.credit.judge_model and wf.credit.judge_model not in engines:
        raise WorkflowError(
            f"workflow {wf.name!r}: the credit judge runs on model {wf.credit.judge_model!r}, which has "
            f"no engine (engines: {sorted(engines)})"
        )
    return engines


def workflow_metrics(trajs: Sequence[Any], wf: Any) -> dict[str, float]:
    """:func:`evaluation_metrics` with the workflow's verifiers, answering agents and verdict parser."""
    verdict = getattr(wf.reward_fn(), "verdict", None)
    return evaluation_metrics(trajs, verifier_agents(wf), answer_agents(wf), verdict)


def verifier_agents(wf: Any) -> list[str]:
    """Agents whose step reward is a verdict on an answer they read: role ``verifier``, or the
    outcome reward's ``verifier_role``."""
    role = (wf.reward.kwargs.get("verifier_role") if wf.reward is not None else None) or "verifier"
    return [a.id for a in wf.agents if a.role == role]


def answer_agents(wf: Any) -> list[str]:
    """The agents whose output is the team's answer: ``reward.answer_from``, else the reward's
    answer role (``solver`` by default)."""
    if wf.reward is not None and wf.reward.answer_from:
        return [wf.reward.answer_from]
    role = (wf.reward.kwargs.get("answer_role") if wf.reward is not None else None) or "solver"
    return [a.id for a in wf.agents if a.role == role]


def evaluation_metrics(
    trajs: Sequence[Any],
    verifiers: Sequence[str] = (),
    answers: Sequence[str] = (),
    verdict: Callable[[str], bool | None] | None = None,
) -> dict[str, float]:
    """What a held-out evaluation reports, for any workflow (docs/workflows.md, "Evaluation").

    * ``reward_mean``: mean team (trajectory) reward; ``<agent>_accuracy``: each agent's mean step
      reward (an accuracy where that reward is 0/1);
    * ``first_try_accuracy``: mean reward of each episode's first step by an answering agent
      (``answers``), reported when some agent acted twice in an episode (the team routed back), to
      compare with the team's reward after routing;
    * for each verifier agent ``v`` (a verdict on the answer step it read): ``v_accept_rate`` and
      ``v_balanced_accuracy``, the mean of its true-accept rate (accepts among correct answers) and
      true-reject rate (rejects among wrong answers). A constant verdict scores 0.5 there, whatever
      the class balance, where its plain accuracy would be the share of the majority class. The
      verdict is read from the step's text by ``verdict`` (the reward's own parser: True accept,
      False reject, None unparsable, which counts as neither); without one it is inferred from the
      0/1 step reward (a wrong or unparsable verdict scores 0).
    """
    out = {"reward_mean": sum(float(t.reward) for t in trajs) / max(1, len(trajs))}
    per: dict[str, list[float]] = {}
    firsts: list[float] = []
    routed = False
    verdicts: dict[str, list[tuple[bool, bool]]] = {v: [] for v in verifiers}  # (answer ok, accepted)
    for t in trajs:
        seen: set[str] = set()
        for i, s in enumerate(t.steps):
            per.setdefault(s.agent_id, []).append(float(s.reward))
            routed |= s.agent_id in seen
            seen.add(s.agent_id)
            if s.agent_id in verdicts and len(s.parents):
                answer = t.steps[int(s.parents[-1])]
                ok = float(answer.reward) >= 1.0
                said = verdict(s.response_text) if verdict is not None else ok == (float(s.reward) >= 1.0)
                verdicts[s.agent_id].append((ok, said))
            if s.agent_id in answers and not any(x.agent_id in answers for x in t.steps[:i]):
                firsts.append(float(s.reward))
    for agent, xs in per.items():
        out[f"{agent}_accuracy"] = sum(xs) / len(xs)
    if routed and firsts:
        out["first_try_accuracy"] = sum(firsts) / len(firsts)
    for v, pairs in verdicts.items():
        if not pairs:
            continue
        good = [said is True for ok, said in pairs if ok]  # accepted, among correct answers
        bad = [said is False for ok, said in pairs if not ok]  # rejected, among wrong answers
        out[f"{v}_accept_rate"] = sum(said is True for _, said in pairs) / len(pairs)
        rates = [sum(good) / len(good)] if good else []
        rates += [sum(bad) / len(bad)] if bad else []
        out[f"{v}_balanced_accuracy"] = sum(rates) / len(rates)
    return out
