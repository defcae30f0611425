"""The one reward interface, weighted composition and the registry.

Design: every reward in teamrl is one :class:`Reward`: an object that scores a completion
(``reward(completion, task) -> RewardResult``) and a workflow episode
(``reward.episode(task, acts) -> EpisodeRewards``, from the acts of one episode, :class:`ActView`,
to step, turn and trajectory rewards: UnityMAS-O's three levels). No base class to inherit from:
any object with both methods fits (a per-completion reward scores an episode with
:func:`team_outcome`), and :func:`get_reward` refuses one that does not. Every reward is *total*:
whatever the completion is (garbage, an infinite loop, a fork bomb, unparsable math) it returns a
result, with score 0 and a reason when it cannot score, within its configured timeout. Raising is
reserved for operator errors (a task record missing a field: ``TaskFormatError``).

Call sequence::

    r = get_reward("math", timeout_s=2.0)          # or "outcome", "addition", "my_pkg.mod:MyReward"
    res = r(completion_text, {"answer": "42"})     # one completion
    res.score, res.reason, res.details
    ep = r.episode(task, acts)                     # one workflow episode (what the rollout calls)
    ep.acts, ep.turns, ep.trajectory

Registry entries are factories taking keyword arguments, so configs stay out of the classes: a
caller passes a config table's keys straight through (``get_reward(name, **table)``), the
workflow's ``[reward]`` table (``name`` and ``kwargs``) included, and ``teamrl reward NAME``.
The rewards that score an episode by roles (``addition``, ``outcome``: which acts answer, how a
verifier's verdict is scored) are in ``teamrl.rewards.outcome``; docs/workflows.md shows the
``[reward]`` table and a reward of one's own. Credit rules (``teamrl.rewards.credit``, a workflow's
``[credit]`` table) are no rewards: they apportion an episode's reward among its agents.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from teamrl.rewards.errors import TaskFormatError, UnknownReward


@dataclass(frozen=True)
class RewardResult:
    """What a reward says about one completion.

    ``score`` is the scalar used for training (most rewards in [0, 1]; shaping terms may be
    negative). ``reason`` is a short machine-greppable phrase ("ok", "wrong_answer",
    "timeout", ...). ``details`` holds JSON-serialisable extras (extracted answer, pass rate).
    """

    score: float
    reason: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"score": self.score, "reason": self.reason, **self.details}


@dataclass
class ActView:
    """What an episode reward sees of one node act (all its tool rounds together)."""

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


@runtime_checkable
class Reward(Protocol):
    """Every reward: one completion, or one workflow episode; never raises on bad completions.

    Both calls may block (sandbox, sympy): the rollout runs ``episode`` in a worker thread.

    Optional attributes, read with ``getattr``: ``verdict(text)`` (a verifier's accept / reject, for
    the runner's verifier metrics) and ``class_balanced`` (True where act scores are weighted so that
    each class of outcome counts alike, as ``outcome``'s ``balance_verdicts``: ``teamrl run`` then
    warns if the learner divides advantages by each group's std, which undoes such weights).
    """

    def __call__(self, completion: str, task: Mapping[str, Any]) -> RewardResult:
        """Score one completion against its task record."""
        ...

    def episode(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards:
        """Score one workflow episode: a reward per act, per turn and for the trajectory."""
        ...


def team_outcome(
    reward: Reward,
    task: Mapping[str, Any],
    acts: Sequence[ActView],
    answers: Callable[[ActView], bool] | None = None,
    other: Callable[[ActView, Mapping[int, float]], float | None] | None = None,
) -> EpisodeRewards:
    """``reward`` on an episode, the team sharing the outcome: each answering act (``answers``; role
    ``solver`` by default) scored on its output, the last one's score the trajectory's; every other
    act gets ``other(act, {answering act index: score})`` or, where that is None or not given, the
    trajectory's. With the defaults this is a per-completion reward's ``episode``; ``outcome`` passes
    its answering rule and its verifiers' verdict scores."""
    answers = answers or _solver
    own = {a.index: float(reward(a.output, task).score) for a in acts if answers(a)}
    final = own[[a.index for a in acts if answers(a)][-1]] if own else 0.0
    scores = []
    for a in acts:
        mine = own[a.index] if a.index in own else other(a, own) if other is not None else None
        scores.append(final if mine is None else mine)
    return by_answers(acts, scores, answers)


def by_answers(
    acts: Sequence[ActView], scores: list[float], answers: Callable[[ActView], bool]
) -> EpisodeRewards:
    """Episode rewards from each act's score: a turn's is its last answering act's, the trajectory's
    the last answering act's (0 where none answered)."""
    n_turns = max((a.turn for a in acts), default=-1) + 1
    turns = []
    for t in range(n_turns):
        last = [s for a, s in zip(acts, scores, strict=True) if a.turn == t and answers(a)]
        turns.append(last[-1] if last else 0.0)
    final = [s for a, s in zip(acts, scores, strict=True) if answers(a)]
    return EpisodeRewards(scores, turns, final[-1] if final else 0.0)


def _solver(act: ActView) -> bool:
    return act.role == "solver"


def require(task: Mapping[str, Any], key: str, kind: type | tuple[type, ...], reward: str) -> Any:
    """Fetch ``task[key]`` or raise ``TaskFormatError`` naming the reward, field and expected type."""
    if key not in task:
        raise TaskFormatError(f"{reward} reward: task record has no field {key!r} (fields: {sorted(task)})")
    value = task[key]
    if not isinstance(value, kind):
        raise TaskFormatError(
            f"{reward} reward: task field {key!r} should be {kind}, got {type(value).__name__}"
        )
    return value


class WeightedSum:
    """``score = sum_i w_i * score_i``; each component's result is kept in ``details``.

    The reason is "ok" when every component said "ok", otherwise the first non-ok reason,
    prefixed by the component's name, so a 0 from a dominant term can be traced.
    """

    def __init__(self, terms: Sequence[tuple[float, Reward]], names: Sequence[str] | None = None) -> None:
        if not terms:
            raise ValueError("WeightedSum needs at least one (weight, reward) term")
        self.terms = [(float(w), r) for w, r in terms]
        self.names = list(names) if names is not None else [_name_of(r, i) for i, (_, r) in enumerate(terms)]
        if len(self.names) != len(self.terms):
            raise ValueError(f"WeightedSum: {len(self.names)} names for {len(self.terms)} terms")

    def __call__(self, completion: str, task: Mapping[str, Any]) -> RewardResult:
        total = 0.0
        parts: dict[str, Any] = {}
        reason = "ok"
        for name, (w, r) in zip(self.names, self.terms, strict=True):
            res = r(completion, task)
            total += w * res.score
            parts[name] = {"weight": w, **res.to_json()}
            if reason == "ok" and res.reason != "ok":
                reason = f"{name}:{res.reason}"
        return RewardResult(total, reason, {"components": parts})

    def episode(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards:
        return team_outcome(self, task, acts)


def _name_of(r: Reward, i: int) -> str:
    return str(getattr(r, "name", None) or f"term{i}")


# name -> "module:factory". Lazy so that importing the registry does not import sympy.
_FACTORIES: dict[str, str] = {
    "math": "teamrl.rewards.math_reward:MathReward",
    "code": "teamrl.rewards.code_reward:CodeReward",
    "qa_em": "teamrl.rewards.qa:ExactMatchReward",
    "qa_f1": "teamrl.rewards.qa:F1Reward",
    "format": "teamrl.rewards.shaping:FormatReward",
    "length": "teamrl.rewards.shaping:LengthReward",
    "addition": "teamrl.rewards.outcome:AdditionReward",
    "outcome": "teamrl.rewards.outcome:OutcomeReward",
}


class _Registry(Mapping[str, Callable[..., Reward]]):
    """Read-only view name -> factory, resolving the import on first access."""

    def __getitem__(self, name: str) -> Callable[..., Reward]:
        if name not in _FACTORIES:
            raise UnknownReward(f"unknown reward {name!r}; registered: {sorted(_FACTORIES)}")
        return _import(_FACTORIES[name])

    def __iter__(self):
        return iter(_FACTORIES)

    def __len__(self) -> int:
        return len(_FACTORIES)


REWARDS: Mapping[str, Callable[..., Reward]] = _Registry()


def _import(target: str) -> Any:
    module, attr = target.split(":", 1)
    return getattr(importlib.import_module(module), attr)


def register(name: str, target: str) -> None:
    """Register a factory by import path ``"package.module:Factory"`` (lazy; resolved on use)."""
    if ":" not in target:
        raise ValueError(f"register({name!r}): target must look like 'module:attr', got {target!r}")
    _FACTORIES[name] = target


def reward_factory(name: str) -> Callable[..., Reward]:
    """The factory of ``name``: a registered name, or ``"package.module:Factory"`` imported as is
    (a reward of one's own, with no registration)."""
    if name not in _FACTORIES and ":" in name:
        return _import(name)
    return REWARDS[name]


def get_reward(name: str, **kwargs: Any) -> Reward:
    """Build the reward ``name`` (see :func:`reward_factory`) with keyword arguments for its factory.

    What the factory builds must be a :class:`Reward` (both calls), else ``TypeError``."""
    reward = reward_factory(name)(**kwargs)
    if not isinstance(reward, Reward):
        raise TypeError(
            f"reward {name!r} built a {type(reward).__name__}, which is no teamrl.rewards.base.Reward: "
            "it needs __call__(completion, task) -> RewardResult and "
            "episode(task, acts) -> EpisodeRewards (docs/workflows.md)"
        )
    return reward
