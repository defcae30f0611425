"""Valid, realistic example trajectories for tests, fuzzing and the transport benchmark.

Shape of one example episode: a 2- or 3-agent workflow ("solver" -> "critic" [-> "judge"]) run
for several turns; within a turn each agent depends on the agents before it (MARFT's chain D),
and the first agent of turn t > 0 also depends on the last step of turn t-1, so parents always
point backwards. Prompt lengths grow with the dialogue like a real chat transcript. ``tokens``
sets the mean tokens per step (prompt + response) so the benchmark can ask for realistic
1,024-token steps.
"""

from __future__ import annotations

import numpy as np

from teamrl.protocol.trajectory import AgentStep, GraphTrajectory, ToolCall

_ROLES = ("solver", "critic", "judge")


def example_trajectories(
    n: int, seed: int, *, tokens: int = 256, turns: int | None = None, vocab: int = 151_936
) -> list[GraphTrajectory]:
    """``n`` valid trajectories, deterministic in ``seed``; ``tokens`` ~ mean tokens per step."""
    rng = np.random.default_rng(seed)
    out = []
    for e in range(n):
        n_agents = int(rng.integers(2, 4))
        n_turns = turns if turns is not None else int(rng.integers(2, 5))
        steps: list[AgentStep] = []
        t0 = 1.7e9 + float(rng.uniform(0, 1e5))
        for turn in range(n_turns):
            for a in range(n_agents):
                i = len(steps)
                parents = [i - 1] if (a > 0 or turn > 0) else []
                if a == 2:
                    parents.append(i - 2)  # the judge reads both the solver and the critic
                resp_len = max(1, int(rng.normal(tokens * 0.4, tokens * 0.1)))
                prompt_len = max(1, tokens - resp_len + int(rng.integers(0, 16)))
                dt = float(rng.uniform(0.1, 3.0))
                role = _ROLES[a]
                steps.append(
                    AgentStep(
                        agent_id=role,
                        role=role,
                        model_id="Qwen/Qwen3-0.6B",
                        adapter=f"{role}-lora",
                        policy_version=int(rng.integers(0, 50)),
                        turn=turn,
                        parents=np.asarray(sorted(parents), dtype=np.int32),
                        prompt_ids=rng.integers(0, vocab, prompt_len, dtype=np.int32),
                        response_ids=rng.integers(0, vocab, resp_len, dtype=np.int32),
                        logprobs=-rng.exponential(0.7, resp_len).astype(np.float32),
                        finish_reason="length" if rng.random() < 0.05 else "stop",
                        reward=float(rng.normal()),
                        response_text=f"{role} turn {turn}: the answer is {int(rng.integers(0, 1000))}",
                        tool_calls=(
                            [ToolCall("python", '{"code": "print(1+1)"}', "2")] if rng.random() < 0.2 else []
                        ),
                        t_start=t0,
                        t_end=t0 + dt,
                    )
                )
                t0 += dt
        out.append(
            GraphTrajectory(
                episode_id=f"ep-{seed}-{e}",
                incarnation=f"rollout-{seed}",
                seq=e,
                task_id=f"task-{int(rng.integers(0, 10_000))}",
                group_id=f"group-{e // 4}",
                workflow="solver-critic" if n_agents == 2 else "solver-critic-judge",
                steps=steps,
                reward=float(rng.integers(0, 2)),
                turn_rewards=rng.normal(size=n_turns).astype(np.float32),
                metadata={"dataset": "addition", "split": "train"},
            )
        )
    return out
