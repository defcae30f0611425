"""A workflow's ``[reward]``: built by ``teamrl.rewards.base.get_reward`` (built-in or a user's
``module:Class``) and called as ``episode(task, acts)`` by the executor; nothing else scores."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from teamrl.rewards.base import Reward
from teamrl.rewards.outcome import AdditionReward
from teamrl.rewards.tokenizer import CharTokenizer
from teamrl.rollout.engine import Generation
from teamrl.rollout.executor import run_episode
from teamrl.rollout.spec import WorkflowError
from teamrl.rollout.workflow import Workflow

SHIPPED = Path(__file__).parents[3] / "packages/rollout/src/teamrl/rollout/workflows/toml/addition-duo.toml"
CHAR = CharTokenizer()
TASK = {"id": "t1", "question": "07+45=", "answer": "52"}

USER_MODULE = '''
from teamrl.rewards.base import EpisodeRewards, RewardResult


class Graded:
    """A reward of one's own: the answer's digits right, in place, over 3; each act a share."""

    def __init__(self, share=1.0, answer_agent=""):
        self.share, self.answer_agent = share, answer_agent
        self.calls = []

    def __call__(self, completion, task):
        got = completion.split(";")[0].rjust(3, "0")
        right = sum(x == y for x, y in zip(got, task["answer"].rjust(3, "0")))
        return RewardResult(right / 3, "ok")

    def episode(self, task, acts):
        self.calls.append([a.agent_id for a in acts])
        final = self(acts[0].output, task).score
        return EpisodeRewards([final * self.share ** a.index for a in acts], [final], final)


class OldShape:
    def __call__(self, task, acts):
        return EpisodeRewards([1.0] * len(acts), [1.0], 1.0)
'''


class Scripted:
    """One scripted answer per adapter."""

    def __init__(self, answers: dict[str, str]):
        self.answers = answers

    async def generate(self, prompt_ids: Sequence[int], sampling, adapter: str = "", seed=None):
        text = self.answers[adapter]
        ids = CHAR.encode(text, add_special=False)
        return Generation(ids, [-0.1] * len(ids), text, "stop", adapter, 0, 5.0, 6.0)


def _workflow(tmp_path: Path, reward: str) -> Workflow:
    text = SHIPPED.read_text().replace('[reward]\nname = "addition"\n', reward)
    path = tmp_path / "team.toml"
    path.write_text(text)
    return Workflow.from_toml(path)


def _episode(wf: Workflow, answers: dict[str, str]):
    return asyncio.run(
        run_episode(
            wf, TASK, Scripted(answers), tokenizers=CHAR, seed=0, incarnation="i", seq=0, group_id="g"
        )
    )


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = "teamrl_test_workflow_reward"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_a_users_reward_class_named_in_the_toml_scores_the_episode(tmp_path: Path, user_module: str) -> None:
    reward = (
        f'[reward]\nname = "{user_module}:Graded"\nanswer_from = "solver"\n[reward.kwargs]\nshare = 0.5\n'
    )
    wf = _workflow(tmp_path, reward)
    fn = wf.reward_fn()
    assert isinstance(fn, Reward) and type(fn).__name__ == "Graded" and fn.answer_agent == "solver"
    traj = _episode(wf, {"solver-lora": "42;", "verifier-lora": "1;"})
    assert fn.calls == [["solver", "verifier"]]
    assert [s.reward for s in traj.steps] == pytest.approx([2 / 3, 1 / 3])
    assert traj.reward == pytest.approx(2 / 3) and traj.turn_rewards.tolist() == pytest.approx([2 / 3])


def test_a_built_in_reward_takes_the_same_path(tmp_path: Path) -> None:
    wf = _workflow(tmp_path, '[reward]\nname = "addition"\n')
    assert isinstance(wf.reward_fn(), AdditionReward)
    traj = _episode(wf, {"solver-lora": "052;", "verifier-lora": "1;"})
    assert (traj.reward, [s.reward for s in traj.steps]) == (1.0, [1.0, 1.0])
    per_completion = _workflow(tmp_path, '[reward]\nname = "qa_em"\n')  # the solver's output as answer
    traj = _episode(per_completion, {"solver-lora": "052", "verifier-lora": "1;"})
    assert isinstance(per_completion.reward_fn(), Reward)
    assert [s.reward for s in traj.steps] == [0.0, 0.0]  # "052" is not the gold "52" for QA


def test_an_unknown_reward_and_one_of_the_old_shape_are_refused(tmp_path: Path, user_module: str) -> None:
    with pytest.raises(WorkflowError, match=r"unknown reward 'nope' \(known: \['addition', 'code'"):
        _workflow(tmp_path, '[reward]\nname = "nope"\n')
    # an episode reward of the shape before the one protocol: __call__(task, acts), no episode()
    wf = _workflow(tmp_path, f'[reward]\nname = "{user_module}:OldShape"\n')
    with pytest.raises(TypeError, match=r"built a OldShape, which is no teamrl.rewards.base.Reward"):
        wf.reward_fn()
