"""What a rollout service (and the sync loop of ``teamrl run``) asks of a workflow.

``WorkflowRunner(name_or_toml, engine, incarnation)`` gives: the training tasks of one replica's
shard, the held-out tasks, one episode as a :class:`GraphTrajectory` (through
:func:`teamrl.rollout.workflow.run_episode`), and a greedy held-out evaluation. ``name_or_toml`` is a
built-in workflow name (``teamrl.rollout.workflows.names()``) or a workflow TOML file.

Held-out tasks (:func:`teamrl.rollout.team.split_tasks`): the workflow's task set's own held-out split where it has one (``addition`` ->
``addition-held-out``), else the last tenth of its tasks, which then are not trained on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from teamrl.rollout.team import split_tasks
from teamrl.rollout.workflows import load, shard

__all__ = [
    "WorkflowRunner",
    "answer_agents",
    "evaluation_metrics",
    "shard",
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
        model_dir: str | Path | None = None,
        reward_kwargs: dict[str, Any] | None = None,
    ) -> None:
        from teamrl.rewards.tokenizer import tokenizer_for
        from teamrl.rollout.workflow import Workflow, WorkflowError

        wf = load(name)
        if len(wf.models) > 1:
            raise WorkflowError(
                f"workflow {wf.name!r} maps agents to {len(wf.models)} base models; a rollout service "
                "serves one (run one service per base model)"
            )
        self.name = wf.name
        self.greedy = wf.with_sampling(temperature=0.0)  # evaluation: the unmodified reward
        if reward_kwargs:  # training reward only, e.g. {"role_scale": {"verifier": 10.0}}
            if wf.reward is None:
                raise WorkflowError(f"workflow {wf.name!r} has no reward to pass {sorted(reward_kwargs)} to")
            data = wf.model_dump()
            data["reward"]["kwargs"] = {**data["reward"].get("kwargs", {}), **reward_kwargs}
            wf = Workflow.from_dict(data)
        self.workflow = wf
        self.engine = engine
        self.incarnation = incarnation
        folder = model_dir or getattr(getattr(engine, "cfg", None), "model", None)
        if folder is None:
            raise WorkflowError("no model folder to take the tokenizer from")
        self.tokenizer = tokenizer_for(folder)
        self.train, self.held = split_tasks(wf, tasks or None)
        self._seq = 0
        self.profile_version = -1  # -1: the workflow's own profiles; else the LangMARL version applied

    def set_profiles(self, version: int, profiles: dict[str, str]) -> None:
        """Use these agent profiles (system prompts) from now on; episodes in flight keep theirs.

        Raises WorkflowError (an unknown agent) or TokenizerError (text the model's tokenizer cannot
        encode, which would fail every later episode) and keeps the profiles in use."""
        workflow = self.workflow.with_profiles(profiles)  # unknown agents first
        for text in profiles.values():
            self.tokenizer.encode(text + "\n\n", add_special=False)
        self.workflow, self.greedy = workflow, self.greedy.with_profiles(profiles)
        self.profile_version = version

    def train_tasks(self, replica: int, num_replicas: int) -> list[dict]:
        return shard(self.train, replica, num_replicas)

    def held_out_tasks(self, n: int) -> list[dict]:
        return self.held[:n]

    async def episode(self, task: dict, seed: int, *, group_id: str, seq: int = 0, greedy: bool = False):
        """One episode (sampled, or greedy); a cancelled episode raises and returns nothing."""
        from teamrl.rollout.workflow import run_episode

        self._seq += 1
        return await run_episode(
            self.greedy if greedy else self.workflow,
            task,
            self.engine,
            tokenizers=self.tokenizer,
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
