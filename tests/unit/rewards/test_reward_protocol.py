"""One reward interface: every registered reward, the composition and a user's own class are a
``teamrl.rewards.base.Reward``, built by ``get_reward`` and called the same two ways."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from teamrl.rewards.base import REWARDS, ActView, Reward, RewardResult, WeightedSum, get_reward
from teamrl.rewards.cli import main
from teamrl.rewards.outcome import AdditionReward, OutcomeReward

# the one registered reward that needs an argument: the reward it scores answers with
KWARGS = {"outcome": {"reward": "qa_em"}}

USER_MODULE = '''
from teamrl.rewards.base import EpisodeRewards, RewardResult, team_outcome


class Shouting:
    """1 when the completion is all capitals (a reward of one's own, in the user's module)."""

    def __init__(self, bonus=0.0, answer_agent=""):
        self.bonus, self.answer_agent = bonus, answer_agent

    def __call__(self, completion, task):
        loud = completion.isupper()
        return RewardResult(1.0 + self.bonus if loud else 0.0, "ok" if loud else "quiet")

    def episode(self, task, acts):
        if self.answer_agent:  # the workflow's answer_from: that agent's last act is the outcome
            own = [self(a.output, task).score for a in acts if a.agent_id == self.answer_agent]
            final = own[-1] if own else 0.0
            return EpisodeRewards([final] * len(acts), [final], final)
        return team_outcome(self, task, acts)


def old_style(task, acts):  # an episode function of the old shape: no longer a reward
    return None
'''


def _acts(*outputs: tuple[str, str]) -> list[ActView]:
    return [ActView(i, role, role, role, 0, text, text, [], [i]) for i, (role, text) in enumerate(outputs)]


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = "teamrl_test_user_reward"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


@pytest.mark.parametrize("name", sorted(REWARDS))
def test_every_registered_reward_is_the_one_protocol(name: str) -> None:
    reward = get_reward(name, **KWARGS.get(name, {}))
    try:
        assert isinstance(reward, Reward)
        assert callable(reward) and callable(reward.episode)
    finally:
        close = getattr(reward, "close", None)
        if callable(close):
            close()


def test_registry_holds_the_episode_rewards_and_the_per_completion_ones() -> None:
    assert set(REWARDS) >= {"addition", "outcome", "math", "code", "qa_em", "qa_f1", "format", "length"}
    assert isinstance(WeightedSum([(1.0, get_reward("qa_em"))]), Reward)


def test_a_per_completion_reward_scores_an_episode_as_outcome_with_its_defaults() -> None:
    task = {"answers": ["paris"]}
    for outputs in (
        [("planner", "look it up"), ("solver", "Paris")],
        [("solver", "Rome"), ("verifier", "ok"), ("solver", "paris")],
        [("planner", "no solver here")],
    ):
        acts = _acts(*outputs)
        alone = get_reward("qa_f1").episode(task, acts)
        assert alone == OutcomeReward("qa_f1").episode(task, acts)
    fmt = get_reward("format")
    total = WeightedSum([(1.0, get_reward("qa_em")), (0.5, fmt)])
    acts = _acts(("solver", "<answer>paris</answer>"))
    assert total.episode(task, acts).trajectory == total("<answer>paris</answer>", task).score


def test_the_episode_rewards_also_score_one_completion() -> None:
    task = {"question": "07+45=", "answer": "52"}
    addition = get_reward("addition")
    assert addition("052;", task) == RewardResult(1.0, "ok", {"prediction": "052"})
    assert (addition("053;", task).reason, addition(";", task).reason) == ("wrong_answer", "no_answer")
    assert (
        addition("052;", task).score == AdditionReward().episode(task, _acts(("solver", "052;"))).trajectory
    )
    outcome = get_reward("outcome", reward="qa_em")
    assert outcome("Paris", {"answer": "paris"}) == get_reward("qa_em")("Paris", {"answer": "paris"})


def test_a_users_reward_class_goes_through_the_same_path(user_module: str) -> None:
    mine = get_reward(f"{user_module}:Shouting", bonus=0.5)
    assert isinstance(mine, Reward) and mine("YES", {}).score == 1.5
    acts = _acts(("planner", "think"), ("solver", "LOUD"))
    assert mine.episode({}, acts).acts == [1.5, 1.5]
    # and as the answer reward of ``outcome``, by the same name
    inner = get_reward("outcome", reward=f"{user_module}:Shouting", verifier_role="verifier")
    assert inner.episode({}, _acts(("solver", "quiet"), ("solver", "LOUD"))).trajectory == 1.0


def test_what_is_not_a_reward_is_refused_by_name(user_module: str) -> None:
    with pytest.raises(TypeError, match=r"'teamrl_test_user_reward:old_style' built a NoneType.*episode\("):
        get_reward(f"{user_module}:old_style", task={}, acts=[])


def test_teamrl_reward_scores_with_the_episode_rewards_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"completion": "052;", "question": "07+45=", "answer": "52"}) + "\n")
    assert main(["addition", "--input", str(path)]) == 0
    assert main(["outcome", "--input", str(path), "--arg", "reward=addition"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["score"], r["reason"]) for r in rows] == [(1.0, "ok"), (1.0, "ok")]
