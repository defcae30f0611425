"""Engines sized for the workflow (teamrl.rollout.sizing, docs/real-model.md "Sizing")."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from teamrl.rollout import sizing
from teamrl.rollout.workflows import load


def test_context_is_prompt_plus_every_budget() -> None:
    wf = load("math-duo")  # planner 256 tokens, solver 512
    ctx = sizing.agent_contexts(wf, {"planner": 97, "solver": 103})
    # planner: 97 + the solver's 512 (a DAG's budget counts every other agent) + 256 + 16 = 881 -> 896
    assert ctx == {"planner": 896, "solver": 896}
    assert sizing.model_contexts(wf, {"planner": 97, "solver": 103}) == {"policy": 896}


def _config(tmp_path: Path, **kw: int) -> Path:
    cfg = {"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576}
    cfg |= {"num_hidden_layers": 30, "max_position_embeddings": 8192, **kw}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_kv_cache_between_floor_and_cap(tmp_path: Path) -> None:
    d = _config(tmp_path)
    assert sizing.kv_bytes_per_token(d) == 2 * 30 * 3 * 64 * 4 == 46080
    assert sizing.kv_cache_bytes(d, 896, 1) == sizing.KV_FLOOR
    assert sizing.kv_cache_bytes(d, 896, 64) == sizing.KV_CAP  # 2.6 GB wanted, capped
    assert sizing.kv_cache_bytes(d, 8192, 1) == 46080 * 8192  # one sequence at least, whatever the floor


def test_check_refuses_what_vllm_would(tmp_path: Path) -> None:
    d = _config(tmp_path)
    with pytest.raises(sizing.SizingError, match="cannot hold one sequence of 896 tokens"):
        sizing.check(d, "policy", 896, 10_000_000)
    with pytest.raises(sizing.SizingError, match="above the model's 8192"):
        sizing.check(d, "policy", 9000, sizing.KV_CAP)
    sizing.check(d, "policy", 896, sizing.KV_FLOOR)


@pytest.mark.slow
def test_plan_sizes_the_real_model_and_refuses_a_small_cache(smollm2_model: Path) -> None:
    from teamrl.cli.plan import PlanError, plan
    from teamrl.cli.run import build_parser

    p = build_parser()
    t0 = time.monotonic()
    rollout = plan(p.parse_args(["--workflow", "math-duo", "--model", str(smollm2_model)])).config["rollout"]
    took = time.monotonic() - t0
    assert rollout["max_model_len"] == 896 and rollout["kv_cache_bytes"] == sizing.KV_CAP
    args = p.parse_args(
        ["--workflow", "math-duo", "--model", str(smollm2_model), "--set", "rollout.kv_cache_bytes=1000000"]
    )
    with pytest.raises(PlanError, match="kv_cache_bytes = 1,000,000 cannot hold one sequence"):
        plan(args)
    print(f"plan of math-duo on smollm2-135m: {took:.2f} s", file=sys.stderr)
