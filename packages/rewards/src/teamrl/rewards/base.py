"""The reward interface, weighted composition and the registry.

Design: a reward is any callable ``reward(completion, task) -> RewardResult``. No base class:
any function or object with that call fits, and no reward inherits behaviour it must then override.
Every reward is *total*: whatever the completion is (garbage, an infinite loop, a fork bomb,
unparsable math) it returns a result, with score 0 and a reason when it cannot score, within its
configured timeout. Raising is reserved for operator errors (a task record missing a field:
``TaskFormatError``).

Call sequence::

    r = get_reward("math", timeout_s=2.0)          # or WeightedSum([(0.9, r1), (0.1, r2)])
    res = r(completion_text, {"answer": "42"})
    res.score, res.reason, res.details

Registry entries are factories taking keyword arguments, so configs stay out of the classes: a
caller passes a config table's keys straight through (``get_reward(name, **table)``).

A workflow's team is scored one level up, per episode: an :class:`EpisodeReward` is
``reward(task, acts) -> EpisodeRewards``, from the acts of one episode (:class:`ActView`, what a
reward sees of each act) to step, turn and trajectory rewards (UnityMAS-O's three levels). Both
shapes are defined here and nowhere else; the episode rewards (``teamrl.rewards.outcome``, named by
a workflow's ``[reward]`` table) score each answering act as a completion (``OutcomeReward`` with a
reward of the registry above).
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


@runtime_checkable
class Reward(Protocol):
    """A reward: ``__call__(completion, task) -> RewardResult``; never raises on bad completions."""

    def __call__(self, completion: str, task: Mapping[str, Any]) -> RewardResult: ...


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


class EpisodeReward(Protocol):
    """``(task, acts) -> EpisodeRewards``; may block (sandbox, sympy): it runs in a worker thread."""

    def __call__(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards: ...


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
}


class _Registry(Mapping[str, Callable[..., Reward]]):
    """Read-only view name -> factory, resolving the import on first access."""

    def __getitem__(self, name: str) -> Callable[..., Reward]:
        if name not in _FACTORIES:
            raise UnknownReward(f"unknown reward {name!r}; registered: {sorted(_FACTORIES)}")
        module, attr = _FACTORIES[name].split(":")
        return getattr(importlib.import_module(module), attr)

    def __iter__(self):
        return iter(_FACTORIES)

    def __len__(self) -> int:
        return len(_FACTORIES)


REWARDS: Mapping[str, Callable[..., Reward]] = _Registry()


def register(name: str, target: str) -> None:
    """Register a factory by import path ``"package.module:Factory"`` (lazy; resolved on use)."""
    if ":" not in target:
        raise ValueError(f"register({name!r}): target must look like 'module:attr', got {target!r}")
    _FACTORIES[name] = target


def get_reward(name: str, **kwargs: Any) -> Reward:
    """Build the reward registered under ``name`` with keyword arguments for its factory."""
    return REWARDS[name](**kwargs)
