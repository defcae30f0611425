"""Rollout benchmark: our engine's generate path against bare vLLM ``AsyncLLM.generate``, same run.

Both sides use the same started engine, the same LoRA adapter, the same prompts and sampling
parameters (n sequences of a fixed token count, no stop token, ``logprobs=0``). Ours adds the
adapter-version bookkeeping, the ``Generation`` record and the per-token behaviour log-prob extraction.
Prints tokens/s of each and the ratio ours / bare (target >= 0.9). Not a timed test.

    python tests/bench/rollout.py [--quick] [--model smollm2-135m] [--dtype bfloat16]

``--model`` takes a folder or a model name (``smollm2-135m``: the real SmolLM2-135M-Instruct,
built into ``$TEAMRL_CACHE`` on first use; docs/real-model.md); its prompt is a chat-templated
question. Both sides always share the engine, so the ratio isolates our per-request path.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path


def _adapter(model: Path, out: Path, dtype: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    m = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    m.save_pretrained(out)


def _prompt(model: Path, named: bool) -> list[int]:
    """A real model's chat-templated question; the embedded model's fixed digit prompt."""
    if not named:
        return [1, 16, 2, 3, 12, 4, 5, 13]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    msgs = [{"role": "user", "content": "Mia has 23 apples. She buys 7 more. How many apples does she have?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


async def bench(n: int, tokens: int, rounds: int, model_name: str, dtype: str) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from teamrl.learner.modelbuild import build
    from teamrl.rollout.engine import EngineConfig, RolloutEngine, Sampling

    if model_name:
        from teamrl.cli.plan import resolve_model

        model = Path(resolve_model(model_name))
    else:
        model = build()
    tmp = Path(tempfile.mkdtemp())
    _adapter(model, tmp / "solver", dtype)
    prompt = _prompt(model, bool(model_name))
    # context: the prompt and the tokens, rounded up (vLLM reserves KV for max_model_len per sequence)
    ctx = -(-(len(prompt) + tokens + 16) // 128) * 128
    eng = RolloutEngine(
        EngineConfig(model=str(model), dtype=dtype, max_model_len=ctx, kv_cache_bytes=1 << 30)
    )
    await eng.start()
    # Load without the probe check (the bench measures generation, not verification).
    lora = LoRARequest("solver@v1", 999, str(tmp / "solver"))
    await eng._llm.add_lora(lora)
    from teamrl.rollout.engine import _Loaded

    eng._current["solver"] = _Loaded(1, 999, "solver@v1", str(tmp / "solver"))

    async def ours() -> int:
        s = Sampling(max_tokens=tokens, temperature=1.0, ignore_eos=True)
        gs = await asyncio.gather(*[eng.generate(prompt, s, "solver", seed=i) for i in range(n)])
        return sum(len(g.token_ids) for g in gs)

    counter = iter(range(10**9))

    async def bare_one(i: int) -> int:
        p = SamplingParams(max_tokens=tokens, temperature=1.0, logprobs=0, seed=i, ignore_eos=True)
        final = None
        async for out in eng._llm.generate(
            TokensPrompt(prompt_token_ids=prompt), p, f"b{next(counter)}", lora_request=lora
        ):
            final = out
        return len(final.outputs[0].token_ids)

    async def bare() -> int:
        return sum(await asyncio.gather(*[bare_one(i) for i in range(n)]))

    await ours()
    await bare()  # warm-up both
    res = {"ours": [], "bare": []}
    for _ in range(rounds):
        for name, fn in (("bare", bare), ("ours", ours)):
            t = time.perf_counter()
            k = await fn()
            res[name].append(k / (time.perf_counter() - t))
    await eng.close()
    o, b = max(res["ours"]), max(res["bare"])
    print(
        f"rollout bench: {model.name} {dtype}, {n} sequences x {tokens} tokens, LoRA applied, best of {rounds}"
    )
    print(f"  bare vLLM AsyncLLM : {b:8.0f} tok/s")
    print(f"  teamrl RolloutEngine: {o:8.0f} tok/s")
    print(f"  ratio ours/bare    : {o / b:.3f}  (target >= 0.9)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument(
        "--model", default="", help="model folder or name, e.g. smollm2-135m (default: the embedded model)"
    )
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a = ap.parse_args()
    asyncio.run(bench(a.n, a.tokens, 2 if a.quick else 5, a.model, a.dtype))


if __name__ == "__main__":
    main()
