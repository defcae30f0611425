"""Graph trajectories: one episode of a multi-agent workflow (MARFT's Flex-MG).

An episode is a DAG of agent steps. Step ``i`` is one agent acting once: it read a prompt
(token ids), produced a response (token ids) sampled by a behaviour policy whose per-token
log-probs are recorded (needed for off-policy correction), and depends on earlier steps
through ``parents`` (the dependency function D(a_i, a_j): step i saw the outputs of its
parents). Invariant: every parent index is smaller than the step's own index, so the step
list is a topological order of the graph.

Rewards live at three levels (UnityMAS-O): ``AgentStep.reward`` (role/step level),
``GraphTrajectory.turn_rewards`` (one per turn) and ``GraphTrajectory.reward`` (trajectory).

These are plain dataclasses holding numpy arrays; ``codec`` turns lists of them into Arrow IPC
bytes and back (zero-copy views on decode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class ToolCall:
    """A tool an agent called during its step, and what the tool returned."""

    name: str
    arguments: str
    result: str = ""


@dataclass
class AgentStep:
    """One node of the graph: one agent's action."""

    agent_id: str  # logical agent (role instance), e.g. "solver"
    role: str  # role name, e.g. "solver"; several agents may share a role
    model_id: str  # physical base model the agent maps to
    adapter: str  # LoRA adapter name it was sampled with ("" = base weights)
    policy_version: int  # version of that adapter at sampling time (>= 0)
    turn: int  # turn index (>= 0)
    parents: np.ndarray  # int32 [n_parents], indices of earlier steps
    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [R]
    logprobs: np.ndarray  # float32 [R], behaviour log-prob of each response token
    finish_reason: str = "stop"  # "stop" | "length" | "abort"
    reward: float = 0.0  # step-level (role) reward / credit
    response_text: str = ""  # decoded response, for reports and judges
    tool_calls: list[ToolCall] = field(default_factory=list)
    t_start: float = 0.0  # unix seconds when the request was submitted
    t_end: float = 0.0  # unix seconds when the response finished


@dataclass
class GraphTrajectory:
    """One episode of a workflow, as published by a rollout service."""

    episode_id: str
    incarnation: str  # producer incarnation id (a new one per process start)
    seq: int  # producer sequence number; (incarnation, seq) de-duplicates
    task_id: str
    group_id: str  # episodes of the same task sampled together (group baselines)
    workflow: str
    steps: list[AgentStep]
    reward: float = 0.0  # trajectory-level reward
    turn_rewards: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # float32 [T]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def agents(self) -> list[str]:
        """Agent ids in order of first appearance."""
        return list(dict.fromkeys(s.agent_id for s in self.steps))

    @property
    def num_tokens(self) -> int:
        return int(sum(len(s.prompt_ids) + len(s.response_ids) for s in self.steps))
