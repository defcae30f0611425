"""The rewards that score a workflow episode by roles: which acts answer, how verdicts score.

Each is a :class:`teamrl.rewards.base.Reward`, registered as ``addition`` and ``outcome`` and named
by a workflow's ``[reward]`` table (docs/workflows.md). On an episode (``episode(task, acts)``) the
answering acts (those of the workflow's ``reward.answer_from`` agent, else those of the answer role)
give the turn rewards (each turn's last answering act) and the trajectory reward (the last one); on
one completion (``reward(completion, task)``) each scores it as it scores an answering act.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from teamrl.rewards import addition
from teamrl.rewards.base import (
    ActView,
    EpisodeRewards,
    Reward,
    RewardResult,
    by_answers,
    get_reward,
    require,
    team_outcome,
)


def scaled_by_role(
    scores: Sequence[float], acts: Sequence[ActView], role_scale: Mapping[str, float]
) -> list[float]:
    """Each act's score times its role's ``role_scale`` (1 for a role not named)."""
    return [x * role_scale.get(a.role, 1.0) for x, a in zip(scores, acts, strict=True)]


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

    def __call__(self, completion: str, task: Mapping[str, Any]) -> RewardResult:
        """A solver's completion: 1 if its answer (the digits before ``;``) is the sum."""
        require(task, "answer", (str, int), "addition")
        got = addition.parse_answer(completion)
        score = addition.solver_reward(dict(task), completion)
        reason = "ok" if score == 1.0 else "wrong_answer" if got else "no_answer"
        return RewardResult(score, reason, {"prediction": got})

    def episode(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards:
        scores = []
        for a in acts:
            if a.role == "verifier":
                read = [acts[p] for p in a.parents if self._answers(acts[p])]
                cand = read[-1].output if read else ""
                scores.append(addition.verifier_reward(dict(task), cand, a.text))
            else:  # scored on the candidate the verifier sees, as ``teamrl run`` does
                scores.append(addition.solver_reward(dict(task), a.output))
        if self.role_scale:
            scores = scaled_by_role(scores, acts, self.role_scale)
        return by_answers(acts, scores, self._answers)


class OutcomeReward:
    """A ``teamrl.rewards`` reward on the answer role's output; the team shares the outcome.

    Answering acts (those of agent ``answer_agent`` when given, the workflow's
    ``reward.answer_from``; else those of role ``answer_role``) are scored on their own output view
    by ``reward`` (a :class:`Reward`, or a name for ``get_reward`` with ``reward_kwargs``); the last
    one is the trajectory reward; acts of ``verifier_role`` get 1 for a correct verdict (``accept`` /
    ``reject`` regexes on their text) on the answer they read; every other act gets the trajectory
    reward (team credit).

    ``balance_verdicts``: a correct verdict on an answer of class c (right or wrong) scores
    ``1 / (2 p_c)`` instead of 1, where ``p_c`` is the share of class c among the answers this reward's
    verifier acts have read (a running estimate over about ``verdict_window`` acts, starting at one of
    each). The expected verdict reward is then the verifier's balanced accuracy: 0.5 for any verdict
    that ignores the answer (always accept, always reject, a coin), 1 for a perfect one. Without it a
    verifier of a team that is mostly wrong learns to reject everything (docs/real-model.md). The
    shares count every verifier act this object scores; a workflow runner's held-out evaluation scores
    with a reward object of its own (its greedy copy of the workflow), so these are the training
    episodes' shares. Updates are serialised (episodes are scored on several threads at once).

    ``role_scale`` multiplies a role's act scores (``teamrl run --reward-scale solver=10``: agents with
    different reward scales, the case Dr. MAS is about), as ``addition``'s does: the turn and trajectory
    rewards follow the scaled answering acts; other acts keep the unscaled team outcome.
    """

    def __init__(
        self,
        reward: str | Reward,
        answer_role: str = "solver",
        reward_kwargs: Mapping[str, Any] | None = None,
        verifier_role: str | None = None,
        accept: str = r"(?i)verdict:\s*correct",
        reject: str = r"(?i)verdict:\s*(?:wrong|incorrect)",
        pass_threshold: float = 1.0,
        answer_agent: str = "",
        balance_verdicts: bool = False,
        verdict_window: float = 256.0,
        role_scale: Mapping[str, float] | None = None,
    ) -> None:
        self.scorer = (
            reward if isinstance(reward, Reward) else get_reward(reward, **dict(reward_kwargs or {}))
        )
        self.answer_role = answer_role
        self.answer_agent = answer_agent
        self.verifier_role = verifier_role
        self.accept, self.reject = re.compile(accept), re.compile(reject)
        self.pass_threshold = pass_threshold
        if verdict_window < 1:
            raise ValueError(f"verdict_window must be >= 1, got {verdict_window}")
        self.balance_verdicts = balance_verdicts
        self.verdict_window = float(verdict_window)
        self.answers_seen = {True: 1.0, False: 1.0}  # decayed counts of right / wrong answers read
        self.role_scale = dict(role_scale or {})
        self._seen_lock = threading.Lock()  # episodes are scored on worker threads, several at once

    def __call__(self, completion: str, task: Mapping[str, Any]) -> RewardResult:
        """An answering act's score: ``reward`` on the completion."""
        return self.scorer(completion, task)

    def episode(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards:
        out = team_outcome(self.scorer, task, acts, self._answers, self._verifier_score)
        if not self.role_scale:
            return out
        return by_answers(acts, scaled_by_role(out.acts, acts, self.role_scale), self._answers)

    def _verifier_score(self, a: ActView, own: Mapping[int, float]) -> float | None:
        """1 for a verifier's correct verdict on the last answer it read; None for other roles."""
        if not self.verifier_role or a.role != self.verifier_role:
            return None
        read = [p for p in a.parents if p in own]
        ok = own[read[-1]] >= self.pass_threshold if read else False
        verdict = self.verdict(a.text)
        score = 1.0 if verdict is not None and verdict == ok else 0.0
        if not self.balance_verdicts:
            return score
        seen, keep = self.answers_seen, 1.0 - 1.0 / self.verdict_window
        with self._seen_lock:
            seen[True], seen[False] = seen[True] * keep, seen[False] * keep
            seen[ok] += 1.0
            share = seen[ok] / (seen[True] + seen[False])
        return score / (2.0 * share)

    @property
    def class_balanced(self) -> bool:
        """Whether act scores carry class weights (``balance_verdicts``; teamrl.rewards.base.Reward)."""
        return self.balance_verdicts

    def _answers(self, a: ActView) -> bool:
        return a.agent_id == self.answer_agent if self.answer_agent else a.role == self.answer_role

    def verdict(self, text: str) -> bool | None:
        """A verifier's verdict in ``text``: True accept, False reject, None unparsable."""
        return True if self.accept.search(text) else False if self.reject.search(text) else None
