"""Rows: a sample's Arrow columns -> right-padded tensors, one agent step per row (docs/architecture.md).

``build_rows`` turns a sample (the ``TrajectoryBatch`` es decoded once from the buffer's reply
frame) into a :class:`RowBatch` for the adapters a learner trains (steps of other adapters are
counted and left out): each row's token slices are copied straight from the flat Arrow token
buffers through their offsets, with no Python object per step. ``StepColumns`` gives the per-step metrics the
same way; ``row_advantages`` gives every row its outcome advantage. The engine
(:mod:`teamrl.learner.engine`) runs its forward passes on these tensors.

A train step's data only grows by new values: :func:`build_rows` makes the :class:`RowBatch`,
:func:`step_rows` the :class:`StepRows` (each row's sample weight and HAPPO joint sample), the
advantage stage an :class:`Advantages`; each is frozen and complete when made, so a stage reads what
the stages before it returned and nothing is filled in later.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from teamrl.learner.advantages import broadcast_to_tokens, outcome_advantages
from teamrl.learner.errors import LearnerError
from teamrl.learner.update import FactorMode, joint_rows
from teamrl.protocol.codec import TrajectoryBatch
from teamrl.protocol.errors import ProtocolError
from teamrl.protocol.trajectory import GraphTrajectory


@dataclass(frozen=True)
class RowBatch:
    """One agent step per row, right-padded. N rows, L = max prompt+response, R = max response.

    input_ids [N, L] int64 (pad 0), attention_mask [N, L], prompt_lens / resp_lens [N],
    response_ids [N, R], behav_logp [N, R] float32 (0 on padding), resp_mask [N, R] bool,
    rewards [N], group_idx / agent_idx / traj_idx / turn_idx [N] int64, versions [N] int64,
    adapter_of_row [N] str.
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
    turn_idx: Tensor
    versions: Tensor
    adapter_of_row: list[str]
    agent_of_row: list[str]
    n_traj: int
    team_rewards: list[float] = field(default_factory=list)

    @property
    def n_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def row_lengths(self) -> Tensor:
        """[N] prompt + response tokens of each row (what a micro-batch pads to its longest of)."""
        return self.prompt_lens + self.resp_lens

    def rows_of(self, adapter: str) -> Tensor:
        return torch.tensor([i for i, a in enumerate(self.adapter_of_row) if a == adapter], dtype=torch.long)


@dataclass(frozen=True)
class StepRows:
    """A train step's rows with what the step gives each of them (:func:`step_rows`), made once
    before its first forward pass.

    of_adapter: each adapter's row indices; weights [N] float32: the sample weight of the row's
    trajectory (``SampleReply.weights``; None: all 1); joint_idx [N] int64: the row's joint sample of
    the HAPPO factor, one of ``n_joint`` (:func:`teamrl.learner.update.joint_rows`).
    """

    batch: RowBatch
    of_adapter: Mapping[str, Tensor]
    weights: Tensor | None
    joint_idx: Tensor
    n_joint: int


def step_rows(
    batch: RowBatch, adapters: Sequence[str], weights: Sequence[float] | None, happo_factor: FactorMode
) -> StepRows:
    """``batch`` with each adapter's rows, each row's sample weight (``weights``: one per trajectory,
    None or empty: all 1) and its joint sample of the HAPPO factor (``happo_factor``)."""
    row_weights = None
    if weights is not None and len(weights) > 0:  # SampleReply.weights, one per trajectory
        if len(weights) != batch.n_traj:
            raise LearnerError(f"{len(weights)} sample weights for {batch.n_traj} trajectories")
        row_weights = torch.tensor(list(weights), dtype=torch.float32)[batch.traj_idx]
    joint_idx, n_joint = joint_rows(batch.traj_idx, batch.turn_idx, batch.n_traj, happo_factor)
    return StepRows(batch, {a: batch.rows_of(a) for a in adapters}, row_weights, joint_idx, n_joint)


@dataclass(frozen=True)
class Advantages:
    """A step's advantages, and the KL reference log-probs made in the same stage (the critic's base
    pass gives both): row [N], one per row (None at token level); tok [N, R], per response token;
    ref: each adapter with a KL term -> its rows' reference log-probs [rows, R]."""

    row: Tensor | None
    tok: Tensor
    ref: Mapping[str, Tensor] = field(default_factory=dict)


Samples = Sequence[TrajectoryBatch] | Sequence[GraphTrajectory]


def as_batches(samples: Samples) -> list[TrajectoryBatch]:
    """The columnar form of a sample: decoded batches as they are; Python trajectories (in-process
    callers, tests) encoded once with the encoder's checks, a failure raised as a ``LearnerError``."""
    items = list(samples)
    if all(isinstance(x, TrajectoryBatch) for x in items):
        return items  # type: ignore[return-value]
    try:
        return [TrajectoryBatch.from_trajectories(items)]  # type: ignore[arg-type]
    except ProtocolError as e:
        raise LearnerError(f"trajectories cannot be trained on: {e}") from e


def trajectory_objects(samples: Samples) -> list[GraphTrajectory]:
    """Python trajectories of a sample (built on demand, for consumers that read text)."""
    return [t for b in as_batches(samples) for t in b.trajectories()]


@dataclass
class StepColumns:
    """Every step of a sample as flat columns (all batches concatenated): what per-step metrics need."""

    agent_codes: np.ndarray  # [S] int64 into ``agents``
    agents: list[str]
    policy_version: np.ndarray  # [S] int64
    reward: np.ndarray  # [S] float64
    traj_reward: np.ndarray  # [T] float64

    @classmethod
    def of(cls, samples: Samples) -> StepColumns:
        batches = as_batches(samples)
        labels: dict[str, int] = {}
        codes = []
        for b in batches:
            c, names = b.step_strings("agent_id")
            remap = np.array([labels.setdefault(n, len(labels)) for n in names], np.int64)
            codes.append(remap[c] if len(names) else np.zeros(0, np.int64))
        cat = np.concatenate
        return cls(
            agent_codes=cat(codes) if codes else np.zeros(0, np.int64),
            agents=list(labels),
            policy_version=cat([b.step_numpy("policy_version") for b in batches] or [np.zeros(0, np.int64)]),
            reward=cat([b.step_numpy("reward") for b in batches] or [np.zeros(0)]),
            traj_reward=cat([b.reward for b in batches] or [np.zeros(0)]),
        )

    def versions_of(self, agents: list[str] | None = None) -> np.ndarray:
        """Policy versions of the steps by ``agents`` (all steps when None): a learner group's own
        steps, whose versions are of its base (another group's count on another sequence)."""
        if agents is None:
            return self.policy_version
        codes = [i for i, a in enumerate(self.agents) if a in set(agents)]
        return self.policy_version[np.isin(self.agent_codes, codes)]

    def mean_reward_by_agent(self) -> dict[str, float]:
        sums = np.bincount(self.agent_codes, self.reward, minlength=len(self.agents))
        counts = np.bincount(self.agent_codes, minlength=len(self.agents))
        return {a: float(sums[i] / counts[i]) for i, a in enumerate(self.agents) if counts[i]}


@dataclass
class _Selected:
    """The rows one batch contributes: step positions and what each row needs (numpy, no objects)."""

    batch: TrajectoryBatch
    steps: np.ndarray  # [n] step positions in the batch
    p: np.ndarray  # prompt lengths
    r: np.ndarray  # response lengths
    reward: np.ndarray
    traj: np.ndarray  # trajectory index in the whole sample
    agents: list[str]
    adapters: list[str]


def _select(
    b: TrajectoryBatch, wanted: set[str], reward_source: str, traj_base: int, ignored: dict[str, int]
) -> _Selected:
    n_steps = np.diff(b.step_offsets)
    traj_of_step = np.repeat(np.arange(len(b), dtype=np.int64), n_steps) + traj_base
    ad_codes, ad_names = b.step_strings("adapter")
    ours = np.isin(ad_codes, [i for i, a in enumerate(ad_names) if a in wanted])
    p_off, _ = b.tokens("prompt_ids")
    r_off, _ = b.tokens("response_ids")
    r_len = np.diff(r_off)
    ignored["foreign_adapter"] += int((~ours).sum())
    ignored["empty_response"] += int((ours & (r_len == 0)).sum())
    steps = np.flatnonzero(ours & (r_len > 0))
    ag_codes, ag_names = b.step_strings("agent_id")
    if reward_source == "step":
        reward = b.step_numpy("reward")[steps]
    else:
        reward = b.reward[traj_of_step[steps] - traj_base]
    return _Selected(
        batch=b,
        steps=steps,
        p=np.diff(p_off)[steps].astype(np.int64),
        r=r_len[steps].astype(np.int64),
        reward=reward.astype(np.float32),
        traj=traj_of_step[steps],
        agents=[ag_names[i] for i in ag_codes[steps]],
        adapters=[ad_names[i] for i in ad_codes[steps]],
    )


def _fill(x: _Selected, row: int, ids: np.ndarray, resp: np.ndarray, behav: np.ndarray) -> int:
    """Copy each selected step's token slices of the Arrow buffers into its padded row, from ``row``
    on; returns the next free row. One slice copy per row and column: measured faster than fancy
    indexing over every token (3.5 vs 8 ms for 487 rows of ~500 tokens on 2 CPU cores)."""
    p_off, p_vals = x.batch.tokens("prompt_ids")
    r_off, r_vals = x.batch.tokens("response_ids")
    l_off, l_vals = x.batch.tokens("logprobs")
    spans = zip(p_off[x.steps].tolist(), r_off[x.steps].tolist(), l_off[x.steps].tolist(), strict=True)
    for (ps, rs, ls), p, r in zip(spans, x.p.tolist(), x.r.tolist(), strict=True):
        ids[row, :p] = p_vals[ps : ps + p]
        ids[row, p : p + r] = resp[row, :r] = r_vals[rs : rs + r]
        behav[row, :r] = l_vals[ls : ls + r]
        row += 1
    return row


def _padded(
    picked: list[_Selected], p: np.ndarray, r: np.ndarray, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rows' padded arrays (``p``, ``r``: their prompt and response lengths): input ids and
    attention mask [n, max(p + r)], response ids, behaviour log-probs and response mask [n, max(r)]."""
    n = len(p)
    big_l, big_r = int((p + r).max()), int(r.max())
    ids_np = np.full((n, big_l), pad_id, dtype=np.int64)
    resp_np = np.zeros((n, big_r), dtype=np.int64)
    behav_np = np.zeros((n, big_r), dtype=np.float32)
    row = 0
    for x in picked:
        row = _fill(x, row, ids_np, resp_np, behav_np)
    attn_np = (np.arange(big_l)[None, :] < (p + r)[:, None]).astype(np.int64)
    mask_np = np.arange(big_r)[None, :] < r[:, None]
    return ids_np, attn_np, resp_np, behav_np, mask_np


def _first_seen(labels: list[str]) -> np.ndarray:
    index: dict[str, int] = {}
    return np.array([index.setdefault(x, len(index)) for x in labels], np.int64)


def build_rows(
    samples: Samples,
    adapters: Sequence[str],
    reward_source: Literal["step", "trajectory"] = "step",
    pad_id: int = 0,
) -> tuple[RowBatch, dict[str, int]]:
    """Flatten a sample into a :class:`RowBatch`; returns it and ``{reason: rows ignored}``.

    Columnar: rows are gathered straight from the Arrow token buffers and offsets of the decoded
    batches (``TrajectoryBatch``), with no object per step or dict per row (docs/architecture.md,
    the data path). ``samples`` may also be Python trajectories; they are encoded once first.
    Rows are ignored (and counted) when their adapter is not trained here (``foreign_adapter``) or
    their response is empty (``empty_response``). Raises :class:`LearnerError` when nothing is left.
    (A step's log-probs always match its response length: the codec checks that on decode.)
    """
    batches = as_batches(samples)
    wanted = set(adapters)
    ignored = {"foreign_adapter": 0, "empty_response": 0}
    picked, base = [], 0
    for b in batches:
        picked.append(_select(b, wanted, reward_source, base, ignored))
        base += len(b)
    n_traj = base
    n = sum(len(x.steps) for x in picked)
    if n == 0:
        raise LearnerError(f"no trainable rows in {n_traj} trajectories (ignored: {ignored})")
    p = np.concatenate([x.p for x in picked])
    r = np.concatenate([x.r for x in picked])
    ids_np, attn_np, resp_np, behav_np, mask_np = _padded(picked, p, r, pad_id)
    group_of_traj = _first_seen([g for b in batches for g in b.group_id])
    traj = np.concatenate([x.traj for x in picked])

    def col(parts: list[np.ndarray], dtype: torch.dtype) -> Tensor:
        return torch.from_numpy(np.concatenate(parts)).to(dtype)

    batch = RowBatch(
        input_ids=torch.from_numpy(ids_np),
        attention_mask=torch.from_numpy(attn_np),
        prompt_lens=torch.from_numpy(p),
        resp_lens=torch.from_numpy(r),
        response_ids=torch.from_numpy(resp_np),
        behav_logp=torch.from_numpy(behav_np),
        resp_mask=torch.from_numpy(mask_np),
        rewards=col([x.reward for x in picked], torch.float32),
        group_idx=torch.from_numpy(group_of_traj[traj]),
        agent_idx=torch.from_numpy(_first_seen([a for x in picked for a in x.agents])),
        traj_idx=torch.from_numpy(traj),
        turn_idx=col([x.batch.step_numpy("turn")[x.steps] for x in picked], torch.long),
        versions=col([x.batch.step_numpy("policy_version")[x.steps] for x in picked], torch.long),
        adapter_of_row=[a for x in picked for a in x.adapters],
        agent_of_row=[a for x in picked for a in x.agents],
        n_traj=n_traj,
        team_rewards=np.concatenate([b.reward for b in batches]).tolist(),
    )
    return batch, ignored


def row_advantages(
    batch: RowBatch,
    algorithm: Literal["grpo", "drmas", "dr_grpo", "at_grpo", "grpo_trajectory"],
    singleton: Literal["batch", "zero", "raw"] = "batch",
    scale: bool = True,
) -> Tensor:
    """Outcome advantage of every row [N] (:func:`teamrl.learner.advantages.outcome_advantages`)."""
    ids = (batch.group_idx, batch.agent_idx, batch.traj_idx, batch.turn_idx)
    return outcome_advantages(algorithm, batch.rewards, *ids, singleton, scale=scale)


def outcome(
    batch: RowBatch,
    algorithm: Literal["grpo", "drmas", "dr_grpo", "at_grpo", "grpo_trajectory"],
    singleton: Literal["batch", "zero", "raw"],
    scale: bool = True,
) -> Advantages:
    """The outcome advantages of ``batch``, per row and broadcast to its response tokens (no KL
    reference: :meth:`teamrl.learner.engine.LearnerEngine.train_step` adds it where it is wanted)."""
    row = row_advantages(batch, algorithm, singleton, scale)
    return Advantages(row, broadcast_to_tokens(row, batch.resp_mask))
