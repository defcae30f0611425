"""What a rollout service (and the sync loop of ``teamrl run``) asks of a workflow.

``WorkflowRunner(name, engine, incarnation)`` gives: the training tasks of one replica's shard, the
held-out tasks, one episode as a :class:`GraphTrajectory`, and a greedy held-out evaluation.

``addition-duo`` is the embedded default and is written out here: the solver answers ``S07+45=``
with three digits; the verifier, whose step depends on the solver's (``parents=[0]``), judges
``V07+45=052?``; rewards come from :mod:`teamrl.rewards.addition` (the solver for a correct sum, the
verifier for a correct verdict). Other workflows come from :mod:`teamrl.rollout.workflows` when that
module provides them.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np

CHARS = list("0123456789+=;?SVR")
BOS, EOS_ID = 1, 14
SOLVER, VERIFIER = "solver", "verifier"
ADAPTERS = {SOLVER: "solver-lora", VERIFIER: "verifier-lora"}
PROBE_PROMPT = "S01+23="


def encode(text: str) -> list[int]:
    """The embedded model's character tokenizer: BOS, then one id per character."""
    return [BOS] + [2 + CHARS.index(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(CHARS[i - 2] for i in ids if 2 <= i < 2 + len(CHARS))


def shard(tasks: list[dict], replica: int, num_replicas: int) -> list[dict]:
    """Replica ``replica``'s share: every ``num_replicas``-th task (disjoint, together complete)."""
    if not 0 <= replica < num_replicas:
        raise ValueError(f"replica {replica} outside 0..{num_replicas - 1}")
    return tasks[replica::num_replicas]


class WorkflowRunner:
    def __init__(self, name: str, engine: Any, incarnation: str, tasks: str = "") -> None:
        if name != "addition-duo":
            raise ValueError(f"unknown workflow {name!r}; built in: addition-duo")
        if tasks:
            raise ValueError("addition-duo generates its own tasks; leave rollout.tasks empty")
        from teamrl.rewards import addition

        self.name = name
        self.engine = engine
        self.incarnation = incarnation
        self.train, self.held = addition.split_tasks(seed=0)
        self._seq = 0

    def train_tasks(self, replica: int, num_replicas: int) -> list[dict]:
        return shard(self.train, replica, num_replicas)

    def held_out_tasks(self, n: int) -> list[dict]:
        return self.held[:n]

    async def _generate(self, task: dict, temperature: float, seed: int) -> tuple[Any, Any, str]:
        from teamrl.rewards import addition
        from teamrl.rollout.engine import Sampling

        samp = Sampling(max_tokens=5, temperature=temperature, stop_token_ids=(EOS_ID,))
        sol = await self.engine.generate(
            encode(addition.solver_prompt(task)), samp, ADAPTERS[SOLVER], seed=seed
        )
        cand = addition.parse_answer(decode(sol.token_ids))[:3].rjust(3, "0")
        ver = await self.engine.generate(
            encode(addition.verifier_prompt(task, cand)), samp, ADAPTERS[VERIFIER], seed=seed + 1
        )
        return sol, ver, cand

    async def episode(self, task: dict, seed: int, *, group_id: str, seq: int = 0, temperature: float = 1.0):
        """One episode at ``temperature``; a cancelled episode raises and returns nothing."""
        sol, ver, cand = await self._generate(task, temperature, seed)
        self._seq += 1
        return self.trajectory(task, group_id, sol, ver, cand, self._seq - 1)

    def trajectory(self, task: dict, group: str, sol: Any, ver: Any, candidate: str, seq: int):
        from teamrl.protocol.trajectory import AgentStep, GraphTrajectory
        from teamrl.rewards import addition

        r_s = addition.solver_reward(task, candidate)
        r_v = addition.verifier_reward(task, candidate, decode(ver.token_ids))

        def step(agent: str, gen: Any, prompt: list[int], parents: list[int], reward: float) -> AgentStep:
            return AgentStep(
                agent_id=agent,
                role=agent,
                model_id="embedded-v1",
                adapter=ADAPTERS[agent],
                policy_version=gen.version,
                turn=0,
                parents=np.asarray(parents, np.int32),
                prompt_ids=np.asarray(prompt, np.int32),
                response_ids=np.asarray(gen.token_ids, np.int32),
                logprobs=np.asarray(gen.logprobs, np.float32),
                finish_reason=gen.finish_reason,
                reward=reward,
                response_text=decode(gen.token_ids),
                t_start=gen.t_start,
                t_end=gen.t_end,
            )

        return GraphTrajectory(
            episode_id=uuid.uuid4().hex,
            incarnation=self.incarnation,
            seq=seq,
            task_id=task["id"],
            group_id=group,
            workflow=self.name,
            steps=[
                step(SOLVER, sol, encode(addition.solver_prompt(task)), [], r_s),
                step(VERIFIER, ver, encode(addition.verifier_prompt(task, candidate)), [0], r_v),
            ],
            reward=r_s,
            turn_rewards=np.asarray([r_s], np.float32),
        )

    async def evaluate(self, tasks: list[dict]) -> dict[str, float]:
        """Greedy episodes on ``tasks``: team reward and each agent's accuracy."""
        from teamrl.rewards import addition

        res = await asyncio.gather(*[self._generate(t, 0.0, 0) for t in tasks])
        sol = [addition.solver_reward(t, c) for t, (_, _, c) in zip(tasks, res, strict=True)]
        ver = [
            addition.verifier_reward(t, c, decode(v.token_ids))
            for t, (_, v, c) in zip(tasks, res, strict=True)
        ]
        return {
            "reward_mean": sum(sol) / len(sol),
            "solver_accuracy": sum(sol) / len(sol),
            "verifier_accuracy": sum(ver) / len(ver),
        }
