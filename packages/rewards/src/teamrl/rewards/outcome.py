"""Episode rewards: from the acts of one workflow episode to step, turn and trajectory rewards.

Each is an :class:`teamrl.rewards.base.EpisodeReward` (``(task, acts) -> EpisodeRewards``), named by
a workflow's ``[reward]`` table (a key of :data:`EPISODE_REWARDS`, or ``module:factory``). The
answering acts (those of the workflow's ``reward.answer_from`` agent, else those of the answer role)
give the turn rewards (each turn's last answering act) and the trajectory reward (the last one).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from teamrl.rewards import addition
from teamrl.rewards.base import ActView, EpisodeReward, EpisodeRewards, get_reward


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
        return addition.verifier_verdict(text)

    def __call__(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards:
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


EPISODE_REWARDS: dict[str, Callable[..., EpisodeReward]] = {
    "addition": AdditionReward,
    "outcome": OutcomeReward,
}
