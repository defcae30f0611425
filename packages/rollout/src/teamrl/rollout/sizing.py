"""How long a team's contexts get, and the KV cache an engine needs for them (docs/real-model.md,
"Sizing").

vLLM reserves KV cache for ``max_model_len`` tokens per sequence; left at a real model's
``max_position_embeddings`` (8,192 for SmolLM2) a 256 MiB CPU cache cannot hold one sequence and the
engine refuses to start. The context an agent can reach is set by the workflow, not the model:

    context(agent) = prompt(longest sampled task, every other output empty)
                   + Σ other agents' max_tokens × reads   (reads: 2 for a multi-turn static graph
                                                           whose nodes see the last turn, else 1)
                   + rounds × (max_tokens + tool result)  (each tool round appends both)
                   + max_tokens                            (its own answer)

rounded up to a multiple of ``ROUND``; a credit judge reads every agent's output. An engine's
``max_model_len`` is the largest context of the agents (and judge) on its model, and its KV cache
holds that many tokens for every sequence the rollout keeps in flight, between a floor (the
embedded models' 256 MiB, so their runs schedule as before) and a cap (most of the context wanted
is never reached: vLLM queues what does not fit).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROUND = 128
CHARS_PER_TOKEN = 3  # a tool result of max_chars characters, counted conservatively (BPE: ~4 for English)
KV_FLOOR = 256 * 1024 * 1024
KV_CAP = 2 * 1024 * 1024 * 1024
CHAT_MARGIN = 16  # the chat template's turn markers around the agent's own answer


class SizingError(ValueError):
    """A team's context or KV cache cannot fit its model or the cache given."""


def _round(n: int) -> int:
    return -(-n // ROUND) * ROUND


def _reads(wf: Any) -> int:
    g = wf.graph
    return 2 if (g.kind == "static" and g.turns > 1 and g.history != "none") else 1


def _tool_tokens(wf: Any, agent: Any) -> int:
    if not agent.tools:
        return 0
    tools = wf.built_tools()
    chars = max(int(getattr(tools[t], "max_chars", 2000)) for t in agent.tools)
    return agent.max_tool_rounds * (agent.sampling.max_tokens + chars // CHARS_PER_TOKEN)


def agent_contexts(wf: Any, prompt_len: Mapping[str, int]) -> dict[str, int]:
    """agent id -> the most tokens its sequence can hold (module docstring); ``prompt_len``: agent id
    -> its longest prompt with every other output empty."""
    total = sum(a.sampling.max_tokens for a in wf.agents)
    out = {}
    for a in wf.agents:
        others = (total - a.sampling.max_tokens) * _reads(wf)
        own = _tool_tokens(wf, a) + a.sampling.max_tokens + CHAT_MARGIN
        out[a.id] = _round(prompt_len[a.id] + others + own)
    return out


def model_contexts(wf: Any, prompt_len: Mapping[str, int]) -> dict[str, int]:
    """model id -> ``max_model_len`` for its engine: the largest context of its agents (and of the
    credit judge, which reads every output)."""
    per_agent = agent_contexts(wf, prompt_len)
    out: dict[str, int] = {}
    for a in wf.agents:
        out[a.model] = max(out.get(a.model, 0), per_agent[a.id])
    if wf.credit.rule == "judge":
        judge = wf.credit.judge_model or wf.agents[0].model
        reads = sum(a.sampling.max_tokens for a in wf.agents) * _reads(wf) + max(prompt_len.values())
        out[judge] = max(out.get(judge, 0), _round(reads + wf.credit.max_tokens + 256))
    return out


def model_limit(model_dir: str | Path) -> int:
    """The model's own context limit (``max_position_embeddings``)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings", 2048))


def kv_bytes_per_token(model_dir: str | Path, dtype: str = "float32") -> int:
    """Bytes of K and V cache one token takes in every layer of ``model_dir``'s model (0 when its
    config.json does not say: the cache is then sized by ``KV_FLOOR`` and never refused)."""
    cfg: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    if not all(k in cfg for k in ("num_attention_heads", "num_hidden_layers", "hidden_size")):
        return 0
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    width = 4 if dtype == "float32" else 2
    return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * width


def kv_cache_bytes(model_dir: str | Path, context: int, sequences: int, dtype: str = "float32") -> int:
    """The KV cache for ``sequences`` sequences of ``context`` tokens, between ``KV_FLOOR`` and
    ``KV_CAP`` (never below one sequence)."""
    per_seq = kv_bytes_per_token(model_dir, dtype) * context
    return max(per_seq, min(max(KV_FLOOR, per_seq * sequences), KV_CAP))


def check(model_dir: str | Path, model_id: str, context: int, kv_bytes: int, dtype: str = "float32") -> None:
    """Raise :class:`SizingError` when ``context`` exceeds the model's limit or one sequence of it does
    not fit ``kv_bytes``: what vLLM would refuse minutes later, said before any process starts."""
    limit = model_limit(model_dir)
    if context > limit:
        raise SizingError(
            f"model {model_id!r}: the workflow's agents need contexts of up to {context} tokens (prompts "
            f"plus agents.sampling.max_tokens), above the model's {limit}: lower the agents' max_tokens"
        )
    need = kv_bytes_per_token(model_dir, dtype) * context
    if kv_bytes < need:
        raise SizingError(
            f"model {model_id!r}: rollout.kv_cache_bytes = {kv_bytes:,} cannot hold one sequence of "
            f"{context} tokens ({need:,} bytes at {dtype}); give at least {need:,} or lower max_tokens"
        )


def capped_contexts(wf: Any, longest: Mapping[str, int], limits: Mapping[str, int]) -> dict[str, int]:
    """:func:`model_contexts` capped at each model's own limit (``limits``: model id ->
    ``max_position_embeddings``); raises :class:`SizingError` when an agent's longest prompt alone
    leaves it no room to answer."""
    for a in wf.agents:
        if longest[a.id] >= limits[a.model]:
            raise SizingError(
                f"agent {a.id!r}: its prompt reaches {longest[a.id]} tokens, the whole of model "
                f"{a.model!r}'s context ({limits[a.model]}): shorten its profile/template or the tasks"
            )
    return {m: min(n, limits[m]) for m, n in model_contexts(wf, longest).items()}
