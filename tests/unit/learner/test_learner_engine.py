"""The DeepSpeed learner engine on the embedded model (world of one, CPU accelerator).

Trajectories are sampled by the learner itself (``LearnerEngine.sample``), so the behaviour
log-probs are exactly the current policy's: the recompute check must agree, a step must move the
adapters that had rows, and the export must be a loadable PEFT folder.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]

CHARS = list("0123456789+=;?SVR")


def enc(text: str) -> list[int]:
    return [1] + [2 + CHARS.index(c) for c in text]


@pytest.fixture(scope="module")
def engine():
    from teamrl.learner.engine import AdapterSettings, LearnerEngine, init_distributed
    from teamrl.learner.modelbuild import build

    init_distributed("cpu")
    s = AdapterSettings(lr=1e-3, clip_low=0.2, clip_high=0.2)
    names = ["solver-lora", "verifier-lora"]
    return LearnerEngine.build(build(), names, adapter_settings={n: s for n in names}, logprob_tolerance=0.05)


def _trajectories(engine, n_tasks: int = 4, group: int = 4):
    from teamrl.protocol.trajectory import AgentStep, GraphTrajectory
    from teamrl.rewards import addition

    tasks, _ = addition.split_tasks(0)
    gen = torch.Generator().manual_seed(0)
    out = []
    for ti, task in enumerate(tasks[:n_tasks]):
        prompts = [enc(addition.solver_prompt(task))] * group
        for k, (ids, lps) in enumerate(engine.sample("solver-lora", prompts, 5, 14, gen)):
            text = "".join(CHARS[i - 2] for i in ids if i >= 2)
            step = AgentStep(
                agent_id="solver",
                role="solver",
                model_id="m",
                adapter="solver-lora",
                policy_version=0,
                turn=0,
                parents=np.zeros(0, np.int32),
                prompt_ids=np.asarray(prompts[0], np.int32),
                response_ids=np.asarray(ids, np.int32),
                logprobs=np.asarray(lps, np.float32),
                reward=addition.solver_reward(task, text) + 0.1 * k,  # distinct rewards: non-zero advantages
            )
            out.append(
                GraphTrajectory(f"e{ti}-{k}", "inc", ti * group + k, task["id"], f"g{ti}", "w", [step])
            )
    return out


def test_train_step_moves_only_the_adapter_with_rows_and_exports(engine, tmp_path) -> None:
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters() if "lora_B" in n}
    res = engine.train_step(_trajectories(engine), step=0, current_version=0, fresh_version=0)
    assert np.isfinite(res.metrics["loss/solver-lora"])
    moved = {n for n, p in engine.model.named_parameters() if "lora_B" in n and not torch.equal(p, before[n])}
    assert moved and all(".solver-lora." in n for n in moved)  # the verifier had no rows: untouched
    folders = engine.export_adapters(tmp_path)
    for name, folder in folders.items():
        assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
        assert name in str(folder)
    lp = engine.completion_logprobs("solver-lora", enc("S01+23="), [2, 4, 6, 14])
    base = engine.completion_logprobs(None, enc("S01+23="), [2, 4, 6, 14])
    assert len(lp) == 4 and max(abs(a - b) for a, b in zip(lp, base, strict=True)) > 0


def test_trajectory_without_trainable_rows_is_a_typed_error(engine) -> None:
    from teamrl.learner.engine import LearnerError

    trajs = _trajectories(engine, 1, 2)
    for t in trajs:
        t.steps[0].adapter = "someone-else"
    with pytest.raises(LearnerError, match="no trainable rows"):
        engine.train_step(trajs, step=1, current_version=0)


@pytest.mark.parametrize("level", ["action", "token"])
def test_ppo_critic_trains_the_value_head_and_reports_its_metrics(engine, level) -> None:
    from teamrl.learner.engine import AdapterSettings, LearnerEngine
    from teamrl.learner.modelbuild import build

    s = AdapterSettings(lr=1e-3, clip_low=0.2, clip_high=0.2)
    names = ["solver-lora", "verifier-lora"]
    eng = LearnerEngine.build(
        build(),
        names,
        adapter_settings={n: s for n in names},
        objective="ppo-critic",
        critic_level=level,
        critic_lr=2e-3,  # 1e-2 overshot on some builds of the model (0.39 -> 0.14 -> 0.82 -> 0.23)
        gamma=1.0,
        kl_coef=0.01,
    )
    trajs = _trajectories(engine)
    head_before = [p.detach().clone() for p in eng.critic.module.parameters()]
    lora_before = {n: p.detach().clone() for n, p in eng.model.named_parameters() if "lora_B" in n}
    value_losses = []
    for step in range(4):
        res = eng.train_step(trajs, step=step, current_version=step, fresh_version=0 if step == 0 else None)
        value_losses.append(res.metrics["value_loss"])
        for key in ("value_loss", "explained_variance", "value_mean", "critic_grad_norm", "kl/solver-lora"):
            assert np.isfinite(res.metrics[key]), key
    assert value_losses[-1] < value_losses[0]  # same data every step: the head fits its returns
    assert any(
        not torch.equal(a, b) for a, b in zip(head_before, eng.critic.module.parameters(), strict=True)
    )
    moved = {
        n for n, p in eng.model.named_parameters() if "lora_B" in n and not torch.equal(p, lora_before[n])
    }
    assert moved and all(".solver-lora." in n for n in moved)


def test_the_learner_side_judge_samples_the_base_and_refuses_text_its_vocabulary_lacks(engine):
    from teamrl.learner.modelbuild import build
    from teamrl.learner.profile_round import ProfileRound, judge_from_engine
    from teamrl.rewards.profiles import PROPOSALS_REJECTED
    from teamrl.rewards.tokenizer import TokenizerError

    judge = judge_from_engine(engine, build(), max_new_tokens=6)
    out = judge("S01+23=")  # the embedded character vocabulary: a real (tiny) sample
    assert isinstance(out, str) and len(out) <= 6 and set(out) <= set("0123456789+=;?SVR")
    with pytest.raises(TokenizerError):
        judge("Rewrite the solver's profile.")  # English: the embedded model cannot be a judge
    # ... and inside a profile round that is a counted rejection, not a crash
    from teamrl.protocol.trajectory import AgentStep, GraphTrajectory

    def ep(i: int) -> GraphTrajectory:
        step = AgentStep(
            "solver",
            "solver",
            "m",
            "solver-lora",
            0,
            0,
            np.zeros(0, np.int32),
            np.asarray([1, 2], np.int32),
            np.asarray([3], np.int32),
            np.asarray([-1.0], np.float32),
            reward=float(i % 2),
            response_text="5;",
        )
        return GraphTrajectory(f"e{i}", "inc", i, "t", "g", "math-duo", [step], reward=float(i % 2))

    before = PROPOSALS_REJECTED.labels(reason="judge_error")._value.get()
    with tempfile.TemporaryDirectory() as d:
        solver_profile = {"solver": "You are the solver of a math team."}  # [learner] profiles
        rounds = ProfileRound(Path(d), judge, interval=1, initial=solver_profile, fsync=False)
        assert rounds.maybe_run(1, [ep(i) for i in range(4)]) is None
    assert PROPOSALS_REJECTED.labels(reason="judge_error")._value.get() == before + 1


def test_float32_probe_of_the_exported_files_reproduces_the_learner(engine, tmp_path) -> None:
    """``probe_ref.Float32Probe`` (a fresh float32 base with the exported PEFT folder) gives the
    float32 learner's own probe log-probs: the reference a bfloat16 learner publishes instead."""
    from types import SimpleNamespace

    from teamrl.learner.modelbuild import build
    from teamrl.learner.probe_ref import Float32Probe
    from teamrl.learner.publish import make_probes

    engine.train_step(_trajectories(engine), step=5, current_version=0, fresh_version=None)
    folders = engine.export_adapters(tmp_path)
    prompt, completion = enc("S01+23="), [2, 4, 6, 14]
    ref = Float32Probe(build())  # the folder the engine was built on
    got = ref.logprobs(folders["solver-lora"], prompt, completion)
    want = engine.completion_logprobs("solver-lora", prompt, completion)
    base = engine.completion_logprobs(None, prompt, completion)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(want, base, strict=True)) > 1e-3  # the adapter moved them
    again = ref.logprobs(folders["solver-lora"], prompt, completion)  # the base was restored between
    assert again == got
    cfg = SimpleNamespace(
        adapters=list(folders), probe_prompt=prompt, probe_completion=completion, probe_atol=0.0
    )
    probes = make_probes(engine, cfg, folders, ref)
    assert probes["solver-lora"].expected_logprobs == got and probes["solver-lora"].atol == 1e-3
