"""LangMARL's judge on a real model: how often its credit split parses, free text against vLLM's
structured outputs (the credit object's JSON schema), on the same episodes.

    python tests/bench/judge_credit.py [--model smollm2-135m] [--workflow math-duo] [--episodes 24]

One vLLM engine serves the team and the judge (base weights, the workflow's first model). For each
setting the workflow is run with ``[credit] rule = "judge"`` and ``structured`` true or false, and the
episodes' ``credit_reason`` is counted (``ok``; ``unparsable``: no credit object, or a zero split;
``untokenizable``). Prints each setting's parse rate, the judge's mean share per agent, two
critiques, and ``judge_parse_structured=<rate>``. Prints figures, asserts none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import tomli_w


def judge_workflow(name: str, structured: bool, max_tokens: int, folder: Path) -> Path:
    """``name`` with ``[credit] rule = "judge"`` (``structured`` as given), written to ``folder``."""
    from teamrl.rollout.workflows import load

    data = load(name).model_dump(mode="json", exclude_none=True)
    data["credit"] = {"rule": "judge", "structured": structured, "max_tokens": max_tokens}
    path = folder / f"{name}-judge-{'structured' if structured else 'free'}.toml"
    path.write_text(tomli_w.dumps(data))
    return path


async def measure(args: argparse.Namespace) -> dict[str, dict]:
    from teamrl.cli.plan import resolve_model
    from teamrl.rollout.engine import EngineConfig, RolloutEngine
    from teamrl.rollout.runner import WorkflowRunner

    model = resolve_model(args.model)
    eng = RolloutEngine(EngineConfig(model=str(model), max_model_len=2048, kv_cache_bytes=1 << 30))
    t0 = time.time()
    await eng.start()
    print(f"engine up in {time.time() - t0:.0f} s ({model})", flush=True)
    out: dict[str, dict] = {}
    folder = Path(tempfile.mkdtemp(prefix="teamrl-judge-"))
    try:
        for structured in (False, True):
            path = judge_workflow(args.workflow, structured, args.max_tokens, folder)
            runner = WorkflowRunner(str(path), eng, "judge-bench")
            tasks = [runner.train[i % len(runner.train)] for i in range(args.episodes)]
            t0 = time.time()
            trajs = await asyncio.gather(
                *[runner.episode(t, 1000 + i, group_id=f"j{i}") for i, t in enumerate(tasks)]
            )
            reasons = Counter(str(t.metadata.get("credit_reason", "?")) for t in trajs)
            shares: dict[str, list[float]] = {}
            for t in trajs:
                if t.metadata.get("credit_reason") == "ok" and t.reward > 0:
                    for s in t.steps:
                        shares.setdefault(s.agent_id, []).append(float(s.reward) / float(t.reward))
            key = "structured" if structured else "free"
            out[key] = {
                "episodes": len(trajs),
                "reasons": dict(reasons),
                "parse_rate": reasons.get("ok", 0) / len(trajs),
                "team_reward_mean": sum(float(t.reward) for t in trajs) / len(trajs),
                "share_mean": {a: sum(x) / len(x) for a, x in shares.items()},
                "critiques": [t.metadata["critique"] for t in trajs if t.metadata.get("critique")][:2],
                "seconds": time.time() - t0,
            }
            print(f"{key}: {json.dumps(out[key])}", flush=True)
    finally:
        await eng.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a model folder or name (default smollm2-135m)")
    p.add_argument("--workflow", default="math-duo")
    p.add_argument("--episodes", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=160, help="the judge's answer length")
    p.add_argument("--out", default="", help="write the figures here as JSON")
    args = p.parse_args(argv)
    res = asyncio.run(measure(args))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"judge_parse_free={res['free']['parse_rate']:.3f}")
    print(f"judge_parse_structured={res['structured']['parse_rate']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
