"""Per-adapter settings (Dr. MAS: each agent its own optimisation and sampling config) in the learner.

Two adapters on the embedded model, one sampled cold (T = 0.5) and one hot (T = 1.5), each with its own
learning rate, KL coefficient and micro-batch size. The learner samples the behaviour itself
(``LearnerEngine.sample`` at each adapter's temperature), so a correct recompute agrees to float
precision; behaviour log-probs taken at temperature 1 must be caught by the recompute check.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]

CHARS = list("0123456789+=;?SVR")
COLD, HOT = "cold-lora", "hot-lora"
LR = {COLD: 1e-2, HOT: 1e-4}
TEMP = {COLD: 0.5, HOT: 1.5}


def enc(text: str) -> list[int]:
    return [1] + [2 + CHARS.index(c) for c in text]


def _engine(**kw):
    from teamrl.learner.engine import AdapterSettings, LearnerEngine, init_distributed
    from teamrl.learner.modelbuild import build

    init_distributed("cpu")
    settings = {
        COLD: AdapterSettings(lr=LR[COLD], clip_low=0.2, clip_high=0.2, temperature=TEMP[COLD], kl_coef=0.05),
        HOT: AdapterSettings(
            lr=LR[HOT], clip_low=0.2, clip_high=0.2, temperature=TEMP[HOT], micro_batch_rows=3
        ),
    }
    return LearnerEngine.build(
        build(),
        [COLD, HOT],
        adapter_settings=settings,
        logprob_tolerance=1e-3,
        weight_decay=0.0,
        seed=0,
        dtype="auto",  # float32 on CPU (bfloat16 on a GPU)
        **kw,
    )


def _trajectories(engine, *, behaviour_at_t1: bool = False, n_tasks: int = 3, group: int = 4):
    """Episodes of two steps: a solver on the cold adapter, then a verifier on the hot one."""
    from teamrl.protocol.trajectory import AgentStep, GraphTrajectory
    from teamrl.rewards import addition

    tasks, _ = addition.split_tasks(0)
    gen = torch.Generator().manual_seed(0)
    out = []
    for ti, task in enumerate(tasks[:n_tasks]):
        sp = enc(addition.solver_prompt(task))
        sols = engine.sample(COLD, [sp] * group, 5, 14, gen)
        vp = enc(f"V{task['question']}123?")
        vers = engine.sample(HOT, [vp] * group, 3, 14, gen)
        for k in range(group):
            steps = []
            for j, (agent, adapter, prompt, (ids, lps)) in enumerate(
                [("solver", COLD, sp, sols[k]), ("verifier", HOT, vp, vers[k])]
            ):
                if behaviour_at_t1:
                    lps = engine.completion_logprobs(adapter, prompt, ids)
                steps.append(
                    AgentStep(
                        agent_id=agent,
                        role=agent,
                        model_id="m",
                        adapter=adapter,
                        policy_version=0,
                        turn=0,
                        parents=np.arange(j, dtype=np.int32),
                        prompt_ids=np.asarray(prompt, np.int32),
                        response_ids=np.asarray(ids, np.int32),
                        logprobs=np.asarray(lps, np.float32),
                        reward=0.3 * k + 0.1 * j,  # distinct rewards: non-zero advantages
                    )
                )
            out.append(GraphTrajectory(f"e{ti}-{k}", "inc", ti * group + k, task["id"], f"g{ti}", "w", steps))
    return out


@pytest.fixture(scope="module")
def engine():
    return _engine()


def test_each_adapter_is_recomputed_at_its_own_temperature_and_stepped_at_its_own_lr(engine) -> None:
    assert engine.dtype == "float32"
    trajs = _trajectories(engine)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters() if "lora_B" in n}
    res = engine.train_step(trajs, step=0, current_version=0, fresh_version=0)
    m = res.metrics
    assert m["logprob_gap_tokens"] > 0 and m["logprob_gap"] < 1e-5, m["logprob_gap"]
    assert m[f"lr/{COLD}"] == LR[COLD] and m[f"lr/{HOT}"] == LR[HOT]
    assert np.isfinite(m[f"kl/{COLD}"])
    # AdamW's first step moves each element by about lr (m / sqrt(v) = sign(g)); lora_B starts at 0
    for adapter, lr in LR.items():
        moved = max(
            float((p - before[n]).abs().max())
            for n, p in engine.model.named_parameters()
            if "lora_B" in n and f".{adapter}." in n
        )
        assert 0.5 * lr < moved <= 1.01 * lr, (adapter, moved, lr)


def test_behaviour_log_probs_at_the_wrong_temperature_are_refused() -> None:
    from teamrl.learner.engine import LogprobMismatch

    eng = _engine(logprob_min_tokens=1)  # judged however few fresh tokens the sampled episodes hold
    with pytest.raises(LogprobMismatch, match="temperature"):
        eng.train_step(_trajectories(eng, behaviour_at_t1=True), step=0, current_version=0, fresh_version=0)


def test_a_gap_over_too_few_fresh_tokens_is_reported_not_judged() -> None:
    """A step whose fresh rows hold fewer than ``logprob_min_tokens`` tokens reports its gap and trains:
    the mean of a couple of tokens is noise (docs/real-model.md: 2 tokens at 0.064 stopped a run)."""
    eng = _engine(logprob_min_tokens=10_000)
    trajs = _trajectories(eng, behaviour_at_t1=True)
    m = eng.train_step(trajs, step=0, current_version=0, fresh_version=0).metrics
    assert 0 < m["logprob_gap_tokens"] < 10_000 and m["logprob_gap"] > 1e-3


def test_config_resolves_each_adapter_from_its_override_else_the_learner_value() -> None:
    from teamrl.learner.config import LearnerConfig
    from teamrl.learner.settings import EngineSettings

    cfg = LearnerConfig(
        adapters=[COLD, HOT],
        lr=3e-4,
        kl_coef=0.01,
        temperature=0.9,
        micro_batch_rows=16,
        agents={COLD: {"temperature": 0.5, "kl_coef": 0.0, "micro_batch_rows": 4, "lr": 1e-3}},
        probe_prompt=[1, 2],
        probe_completion=[3],
    )
    assert cfg.adapter_settings(COLD) == {
        "lr": 1e-3,
        "clip_low": cfg.clip_low,
        "clip_high": cfg.clip_high if cfg.clip_high is not None else cfg.clip_low,
        "temperature": 0.5,
        "kl_coef": 0.0,
        "micro_batch_rows": 4,
        "allowed_token_ids": None,
    }
    hot = cfg.adapter_settings(HOT)
    assert (hot["lr"], hot["temperature"], hot["kl_coef"], hot["micro_batch_rows"]) == (3e-4, 0.9, 0.01, 16)
    assert cfg.dtype == "auto" and EngineSettings.config_kwargs(cfg)["dtype"] == "auto"
    eng_settings = EngineSettings.config_kwargs(cfg)["adapter_settings"]
    assert eng_settings[COLD].temperature == 0.5 and eng_settings[HOT].temperature == 0.9
    chooser = LearnerConfig.model_validate(
        {**cfg.model_dump(), "agents": {COLD: {"allowed_token_ids": [7, 5]}}}
    )
    assert chooser.adapter_settings(COLD)["allowed_token_ids"] == (7, 5)
    assert chooser.adapter_settings(HOT)["allowed_token_ids"] is None
