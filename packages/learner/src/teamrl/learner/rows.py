"""Rows: graph trajectories -> right-padded tensors, one agent step per row (docs/architecture.md).

``build_rows`` turns a sample of trajectories into a :class:`RowBatch` for the adapters a learner
trains (steps of other adapters are counted and left out); ``row_advantages`` gives every row its
outcome advantage. The engine (:mod:`teamrl.learner.engine`) runs its forward passes on these tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from teamrl.learner.advantages import outcome_advantages
from teamrl.learner.errors import LearnerError
from teamrl.protocol.trajectory import GraphTrajectory


@dataclass
class RowBatch:
    """One agent step per row, right-padded. N rows, L = max prompt+response, R = max response.

    input_ids [N, L] int64 (pad 0), attention_mask [N, L], prompt_lens / resp_lens [N],
    response_ids [N, R], behav_logp [N, R] float32 (0 on padding), resp_mask [N, R] bool,
    rewards [N], group_idx / agent_idx / traj_idx [N] int64, versions [N] int64, adapter_of_row [N] str.
    """

    input_ids: Tensor
    attention_mask: Tensor
    prompt_lens: Tensor
    resp_lens: Tensor
    response_ids: Tensor
    behav_logp: Tensor
    resp_mask: Tensor
    rewards: Tensor
    group_idx: Tensor
    agent_idx: Tensor
    traj_idx: Tensor
    versions: Tensor
    adapter_of_row: list[str]
    agent_of_row: list[str]
    n_traj: int
    team_rewards: list[float] = field(default_factory=list)
    turn_idx: Tensor | None = None  # [N] int64, the step's turn (None: all 0)
    row_weights: Tensor | None = None  # [N] float32 sample weight of the row's trajectory (None: all 1)
    joint_idx: Tensor | None = None  # [N] int64 joint sample of the HAPPO factor (set by train_step)
    temps: Tensor | None = None  # [N] float32 sampling temperature of the row's adapter (set by train_step)

    @property
    def n_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def rows_of(self, adapter: str) -> Tensor:
        return torch.tensor([i for i, a in enumerate(self.adapter_of_row) if a == adapter], dtype=torch.long)


def build_rows(
    trajectories: Sequence[GraphTrajectory],
    adapters: Sequence[str],
    reward_source: Literal["step", "trajectory"] = "step",
    pad_id: int = 0,
) -> tuple[RowBatch, dict[str, int]]:
    """Flatten trajectories into a :class:`RowBatch`; returns it and ``{reason: rows ignored}``.

    Rows are ignored (and counted) when their adapter is not trained here (``foreign_adapter``) or
    their response is empty (``empty_response``). Raises :class:`LearnerError` when a step's log-probs
    do not match its response length, or when nothing is left.
    """
    wanted = set(adapters)
    ignored = {"foreign_adapter": 0, "empty_response": 0}
    groups: dict[str, int] = {}
    agents: dict[str, int] = {}
    seqs: list[np.ndarray] = []
    rows: list[dict[str, Any]] = []
    team: list[float] = []
    for ti, traj in enumerate(trajectories):
        g = groups.setdefault(traj.group_id, len(groups))
        team.append(float(traj.reward))
        for s in traj.steps:
            if s.adapter not in wanted:
                ignored["foreign_adapter"] += 1
                continue
            if len(s.response_ids) == 0:
                ignored["empty_response"] += 1
                continue
            if len(s.logprobs) != len(s.response_ids):
                raise LearnerError(
                    f"episode {traj.episode_id}: step of {s.agent_id!r} has {len(s.logprobs)} log-probs "
                    f"for {len(s.response_ids)} response tokens"
                )
            seqs.append(np.concatenate([s.prompt_ids, s.response_ids]).astype(np.int64))
            rows.append(
                {
                    "p": len(s.prompt_ids),
                    "r": len(s.response_ids),
                    "resp": np.asarray(s.response_ids, np.int64),
                    "lp": np.asarray(s.logprobs, np.float32),
                    "reward": float(s.reward) if reward_source == "step" else float(traj.reward),
                    "g": g,
                    "a": agents.setdefault(s.agent_id, len(agents)),
                    "t": ti,
                    "v": int(s.policy_version),
                    "adapter": s.adapter,
                    "agent": s.agent_id,
                    "turn": int(s.turn),
                }
            )
    if not rows:
        raise LearnerError(f"no trainable rows in {len(trajectories)} trajectories (ignored: {ignored})")
    n, big_l, big_r = len(rows), max(len(x) for x in seqs), max(r["r"] for r in rows)
    # filled in numpy and wrapped once: per-row torch slice assignments cost more than the copy
    ids_np = np.full((n, big_l), pad_id, dtype=np.int64)
    attn_np = np.zeros((n, big_l), dtype=np.int64)
    resp_np = np.zeros((n, big_r), dtype=np.int64)
    behav_np = np.zeros((n, big_r), dtype=np.float32)
    mask_np = np.zeros((n, big_r), dtype=np.bool_)
    for i, (seq, r) in enumerate(zip(seqs, rows, strict=True)):
        ids_np[i, : len(seq)] = seq
        attn_np[i, : len(seq)] = 1
        resp_np[i, : r["r"]] = r["resp"]
        behav_np[i, : r["r"]] = r["lp"]
        mask_np[i, : r["r"]] = True
    input_ids, attn = torch.from_numpy(ids_np), torch.from_numpy(attn_np)
    resp, behav, mask = torch.from_numpy(resp_np), torch.from_numpy(behav_np), torch.from_numpy(mask_np)

    def col(key: str, dtype: torch.dtype) -> Tensor:
        return torch.tensor([r[key] for r in rows], dtype=dtype)

    batch = RowBatch(
        input_ids=input_ids,
        attention_mask=attn,
        prompt_lens=col("p", torch.long),
        resp_lens=col("r", torch.long),
        response_ids=resp,
        behav_logp=behav,
        resp_mask=mask,
        rewards=col("reward", torch.float32),
        group_idx=col("g", torch.long),
        agent_idx=col("a", torch.long),
        traj_idx=col("t", torch.long),
        turn_idx=col("turn", torch.long),
        versions=col("v", torch.long),
        adapter_of_row=[r["adapter"] for r in rows],
        agent_of_row=[r["agent"] for r in rows],
        n_traj=len(trajectories),
        team_rewards=team,
    )
    return batch, ignored


def row_advantages(
    batch: RowBatch,
    algorithm: Literal["grpo", "drmas", "dr_grpo", "at_grpo", "grpo_trajectory"],
    singleton: Literal["batch", "zero", "raw"] = "batch",
) -> Tensor:
    """Outcome advantage of every row [N] (:func:`teamrl.learner.advantages.outcome_advantages`)."""
    turn = batch.turn_idx if batch.turn_idx is not None else torch.zeros_like(batch.traj_idx)
    return outcome_advantages(
        algorithm, batch.rewards, batch.group_idx, batch.agent_idx, batch.traj_idx, turn, singleton
    )
