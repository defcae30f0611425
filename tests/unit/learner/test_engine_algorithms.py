"""The engine wires the algorithm options (docs/algorithms.md): two agents on 2-turn episodes.

Solver and verifier both act on each of 2 turns of every episode (sampled by the learner itself, so the
behaviour log-probs are the current policy's). Checks: the second agent's HAPPO factor departs from 1
after the first agent's update, per turn and per trajectory; sample weights reach the loss (all-zero
weights move nothing); every advantage algorithm and off-policy option runs a step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]

CHARS = list("0123456789+=;?SVR")
NAMES = ["solver-lora", "verifier-lora"]


def enc(text: str) -> list[int]:
    return [1] + [2 + CHARS.index(c) for c in text]


def _engine(**kw):
    from teamrl.learner.engine import AdapterSettings, LearnerEngine, init_distributed
    from teamrl.learner.modelbuild import build

    init_distributed("cpu")
    s = AdapterSettings(lr=5e-2, clip_low=0.2, clip_high=0.2)
    return LearnerEngine.build(
        build(), NAMES, adapter_settings={n: s for n in NAMES}, order="fixed", logprob_tolerance=None, **kw
    )


@pytest.fixture(scope="module")
def engine():
    return _engine()


def _episodes(engine, n_groups: int = 2, group: int = 3):
    """Episodes of 2 turns x (solver, verifier); rewards vary per row so every group has a spread."""
    from teamrl.protocol.trajectory import AgentStep, GraphTrajectory

    gen = torch.Generator().manual_seed(0)
    out = []
    for gi in range(n_groups):
        for k in range(group):
            steps = []
            for turn in range(2):
                for agent, adapter, prompt in (
                    ("solver", "solver-lora", f"S0{gi}+1{turn}="),
                    ("verifier", "verifier-lora", f"V0{gi}+1{turn}=2?"),
                ):
                    ids, lps = engine.sample(adapter, [enc(prompt)], 4, 14, gen)[0]
                    steps.append(
                        AgentStep(
                            agent_id=agent,
                            role=agent,
                            model_id="m",
                            adapter=adapter,
                            policy_version=0,
                            turn=turn,
                            parents=np.zeros(0, np.int32),
                            prompt_ids=np.asarray(enc(prompt), np.int32),
                            response_ids=np.asarray(ids, np.int32),
                            logprobs=np.asarray(lps, np.float32),
                            reward=float((k + turn + (agent == "verifier")) % 2),
                        )
                    )
            out.append(GraphTrajectory(f"e{gi}-{k}", "inc", gi * group + k, f"t{gi}", f"g{gi}", "w", steps))
    return out


def _lora(eng) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in eng.model.named_parameters() if "lora_B" in n}


@pytest.mark.parametrize("mode", ["turn", "trajectory"])
def test_second_agents_factor_departs_from_one_after_the_first_update(engine, mode) -> None:
    engine.settings = engine.settings.replace(happo_factor=mode)
    res = engine.train_step(_episodes(engine), step=0, current_version=0)
    assert res.order == NAMES
    assert res.metrics["factor_mean/solver-lora"] == 1.0
    assert res.metrics["factor_mean/verifier-lora"] != pytest.approx(1.0, abs=1e-6)
    assert res.metrics["singleton_groups"] == 0.0


def test_a_factor_clip_bounds_the_second_agents_factor_and_counts_the_rows(engine) -> None:
    engine.settings = engine.settings.replace(happo_factor_clip=1.0001)
    try:
        res = engine.train_step(_episodes(engine), step=1, current_version=0)
    finally:
        engine.settings = engine.settings.replace(happo_factor_clip=None)
    assert 1 / 1.0001 - 1e-6 <= res.metrics["factor_mean/verifier-lora"] <= 1.0001 + 1e-6
    assert res.metrics["factor_max/verifier-lora"] <= 1.0001 + 1e-6
    assert res.metrics["factor_clipped_rows/verifier-lora"] > 0
    assert res.metrics["factor_clipped_rows/solver-lora"] == 0.0


def test_simultaneous_update_keeps_factor_one(engine) -> None:
    engine.settings = engine.settings.replace(update_order="simultaneous")
    try:
        res = engine.train_step(_episodes(engine), step=1, current_version=0)
    finally:
        engine.settings = engine.settings.replace(update_order="sequential")
    assert res.metrics["factor_mean/verifier-lora"] == 1.0


def test_sample_weights_reach_the_loss(engine) -> None:
    from teamrl.learner.engine import LearnerError

    trajs = _episodes(engine)
    engine = _engine()  # no AdamW moments yet: a zero gradient moves nothing
    before = _lora(engine)
    res = engine.train_step(trajs, step=2, current_version=0, weights=[0.0] * len(trajs))
    assert res.metrics["loss/solver-lora"] == 0.0
    assert all(torch.equal(p, before[n]) for n, p in _lora(engine).items())  # weight 0: no move
    res = engine.train_step(trajs, step=3, current_version=0, weights=[1.0] * len(trajs))
    assert any(not torch.equal(p, before[n]) for n, p in _lora(engine).items())
    with pytest.raises(LearnerError, match="sample weights"):
        engine.train_step(trajs, step=4, current_version=0, weights=[1.0])


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "drmas", "at_grpo", "grpo_trajectory"])
def test_every_advantage_algorithm_trains(engine, algorithm) -> None:
    engine.settings = engine.settings.replace(algorithm=algorithm)
    try:
        res = engine.train_step(_episodes(engine), step=5, current_version=0)
    finally:
        engine.settings = engine.settings.replace(algorithm="drmas")
    assert np.isfinite(res.metrics["loss/solver-lora"]) and np.isfinite(res.metrics["loss/verifier-lora"])


@pytest.mark.parametrize(
    ("mode", "level", "cap"), [("mask", "token", 5.0), ("clamp", "sequence", 2.0), ("mask", "sequence", 2.0)]
)
def test_off_policy_options_train(engine, mode, level, cap) -> None:
    engine.settings = engine.settings.replace(tis_mode=mode, tis_level=level, tis_cap=cap)
    try:
        res = engine.train_step(_episodes(engine), step=6, current_version=1)
    finally:
        engine.settings = engine.settings.replace(tis_mode="clamp", tis_level="token", tis_cap=2.0)
    assert np.isfinite(res.metrics["loss/verifier-lora"])
    assert res.metrics["is_weight_max/solver-lora"] > 0
