"""``teamrl run --mode sync`` builds its one vLLM engine as a rollout service builds its engines
(``teamrl.cli.run_sync.sync_bases``: ``resolve_bases`` then ``Bases.build``), from the plan's
``[rollout]`` table: its context length, KV cache, dtype and versions kept. Before, the sync run had a
builder of its own that took vLLM's defaults, and on SmolLM2-135M (an 8,192-token context) it did not
start."""

from __future__ import annotations

from teamrl.cli.run_sync import sync_bases


def engine_of(rcfg: dict, seed: int):
    _cfg, bases = sync_bases(rcfg, seed)
    return next(iter(bases.values())).engine


def test_the_sync_engine_takes_the_plans_context_cache_and_dtype() -> None:
    rcfg = {"workflow": "addition-duo", "model": "/m", "max_lora_rank": 8, "lora_target_modules": ["q_proj"]}
    sized = rcfg | {"max_model_len": 608, "kv_cache_bytes": 96 << 20, "dtype": "bfloat16", "keep_versions": 3}
    cfg = engine_of(sized, seed=3).cfg
    assert (cfg.model, cfg.seed, cfg.max_model_len, cfg.kv_cache_bytes) == ("/m", 3, 608, 96 << 20)
    assert cfg.lora_target_modules == ("q_proj",) and cfg.dtype == "bfloat16" and cfg.keep_versions == 3
    plain = engine_of(rcfg, seed=0).cfg  # a table without them: the model's own context, the default cache
    assert plain.max_model_len == 0 and plain.kv_cache_bytes == 256 * 1024 * 1024
