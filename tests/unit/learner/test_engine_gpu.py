"""The learner engine on a CUDA GPU, as deployed: bf16, ``cuda:LOCAL_RANK``, NCCL world of one.

Marked ``gpu``: ``make test`` deselects them, and they skip where torch sees no CUDA device. On a GPU
machine: ``python -m pytest -m gpu tests/unit/learner/test_engine_gpu.py`` (``scripts/gpu_check.sh``
runs them with the learner benchmark). ``TEAMRL_GPU_TEST_DEVICE=cpu`` runs the same bodies on the CPU
(float32), to check the tests themselves without a GPU.

The model is a small random-initialised Qwen2 (built in the test, no download, no embedded-model
build): a train step moves the adapter on the GPU, a checkpoint restores weights and optimiser state
exactly and the next step from it matches the uninterrupted one, and an exported adapter loaded by
PEFT into a fresh copy of the base reproduces the learner's probe log-probs within the publish
tolerance of the dtype (:func:`teamrl.learner.service.probe_atol`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

DEVICE = os.environ.get("TEAMRL_GPU_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
DTYPE = "bfloat16" if DEVICE == "cuda" else "float32"
ADAPTER = "solver-lora"
VOCAB = 512

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not DEVICE, reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("qwen2-tiny")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


def _engine(model_dir: Path):
    from teamrl.learner.engine import AdapterSettings, LearnerEngine, init_distributed

    init_distributed(DEVICE)
    s = AdapterSettings(lr=1e-3, clip_low=0.2, clip_high=0.2)
    return LearnerEngine.build(
        model_dir,
        [ADAPTER],
        adapter_settings={ADAPTER: s},
        dtype=DTYPE,
        device=DEVICE,
        micro_batch_rows=4,  # two micro-batches of 8 rows: gradient accumulation on the device
        logprob_tolerance=None,
    )


def _trajectories(seed: int, rows: int = 8) -> list:
    from teamrl.protocol.trajectory import AgentStep, GraphTrajectory

    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        p, r = int(rng.integers(4, 12)), int(rng.integers(2, 10))  # ragged rows: padding is exercised
        step = AgentStep(
            agent_id="solver",
            role="solver",
            model_id="m",
            adapter=ADAPTER,
            policy_version=0,
            turn=0,
            parents=np.zeros(0, np.int32),
            prompt_ids=rng.integers(2, VOCAB, p, dtype=np.int32),
            response_ids=rng.integers(2, VOCAB, r, dtype=np.int32),
            logprobs=-rng.exponential(1.0, r).astype(np.float32),
            reward=float(rng.normal()),
        )
        out.append(GraphTrajectory(f"e{i}", "t", i, f"task{i // 4}", f"g{i // 4}", "w", [step]))
    return out


def test_train_step_runs_on_the_gpu_and_moves_the_adapter(model_dir: Path) -> None:
    eng = _engine(model_dir)
    p0 = next(p for n, p in eng.model.named_parameters() if "lora_A" in n)
    assert p0.device.type == DEVICE
    if DEVICE == "cuda":
        assert eng.device.index == int(os.environ.get("LOCAL_RANK", "0"))
    before = eng.adapter_state(ADAPTER)
    res = eng.train_step(_trajectories(0), step=0, current_version=0)
    m = res.metrics
    for key in ("loss", "grad_norm", "ratio_mean", "is_weight_mean", "tokens"):
        assert math.isfinite(m[f"{key}/{ADAPTER}"]), key
    assert m[f"grad_norm/{ADAPTER}"] > 0 and m[f"tokens/{ADAPTER}"] > 0
    after = eng.adapter_state(ADAPTER)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())


def test_checkpoint_restores_the_adapter_and_the_next_step(model_dir: Path, tmp_path: Path) -> None:
    eng = _engine(model_dir)
    eng.train_step(_trajectories(1), step=0, current_version=0)
    eng.save_checkpoint(tmp_path / "ck", versions={ADAPTER: 1})
    saved = eng.adapter_state(ADAPTER)
    torch_state = torch.get_rng_state()
    uninterrupted = eng.train_step(_trajectories(2), step=1, current_version=1)

    other = _engine(model_dir)  # fresh LoRA init, then the checkpoint over it
    state = other.load_checkpoint(tmp_path / "ck")
    assert state.next_step == 1 and state.adapter_versions == {ADAPTER: 1}
    restored = other.adapter_state(ADAPTER)
    assert all(torch.equal(saved[k], restored[k]) for k in saved)  # weights exactly as saved
    assert torch.equal(torch.get_rng_state(), torch_state)
    resumed = other.train_step(_trajectories(2), step=1, current_version=1)
    # same weights, same AdamW moments, same data: the same step up to GPU reduction order
    for key in ("loss", "grad_norm"):
        a, b = uninterrupted.metrics[f"{key}/{ADAPTER}"], resumed.metrics[f"{key}/{ADAPTER}"]
        assert a == pytest.approx(b, rel=1e-2, abs=1e-4), key
    fin_a, fin_b = eng.adapter_state(ADAPTER), other.adapter_state(ADAPTER)
    for k in fin_a:
        assert torch.allclose(fin_a[k].float(), fin_b[k].float(), rtol=1e-2, atol=1e-4), k


def test_exported_adapter_reproduces_the_probe_in_a_peft_receiver(model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from teamrl.learner.service import probe_atol
    from teamrl.protocol.adapters import folder_payload, payload_sha256, unpack_adapter_payload

    eng = _engine(model_dir)
    for step in range(2):
        eng.train_step(_trajectories(10 + step), step=step, current_version=step)
    # two small steps barely move LoRA B from its zero start; push it further, so that the probe
    # tells a loaded adapter from a missing one at the dtype's tolerance
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, prm in eng.model.named_parameters():
            if "lora_B" in n:
                prm.add_(0.05 * torch.randn(prm.shape, generator=gen).to(prm))
    prompt, completion = [5, 17, 42, 99, 7], [11, 300, 8, 64]
    want = eng.completion_logprobs(ADAPTER, prompt, completion)
    base_lp = eng.completion_logprobs(None, prompt, completion)
    atol = probe_atol(DTYPE)
    assert max(abs(a - b) for a, b in zip(want, base_lp, strict=True)) > atol  # the adapter matters

    folders = eng.export_adapters(tmp_path / "export")
    payload = folder_payload(tmp_path / "export")
    sha = payload_sha256(payload)
    got = unpack_adapter_payload(payload, tmp_path / "recv")
    assert payload_sha256(payload) == sha and set(got) == set(folders)

    tdtype = torch.bfloat16 if DTYPE == "bfloat16" else torch.float32
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype).to(eng.device)
    receiver = PeftModel.from_pretrained(base, str(got[ADAPTER]), adapter_name=ADAPTER).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt + completion], device=eng.device)
        logp = torch.log_softmax(receiver(input_ids=ids).logits[0].float(), -1)
    live = [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion)]
    err = max(abs(a - b) for a, b in zip(live, want, strict=True))
    assert err <= atol, f"receiver differs from the learner's probe by {err:.2e} > {atol:.2e} ({DTYPE})"
