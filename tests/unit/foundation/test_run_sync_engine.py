"""``teamrl run --mode sync`` starts its one vLLM engine as the plan sized it (teamrl.cli.run_sync): the
context length and KV cache of the plan's ``[rollout]`` table, as a rollout service gets them. Before,
the sync engine took vLLM's defaults, and on SmolLM2-135M (an 8,192-token context) it did not start."""

from __future__ import annotations

from teamrl.cli.run_sync import engine_config


def test_the_sync_engine_takes_the_plans_context_and_cache() -> None:
    rcfg = {"max_lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"], "dtype": "bfloat16"}
    cfg = engine_config("/m", rcfg | {"max_model_len": 608, "kv_cache_bytes": 96 << 20}, seed=3)
    assert (cfg.model, cfg.seed, cfg.max_model_len, cfg.kv_cache_bytes) == ("/m", 3, 608, 96 << 20)
    assert cfg.lora_target_modules == ("q_proj", "v_proj") and cfg.dtype == "bfloat16"
    plain = engine_config("/m", rcfg, seed=0)  # a table without them: the model's own context, vLLM's cache
    assert plain.max_model_len == 0 and plain.kv_cache_bytes == 256 * 1024 * 1024
