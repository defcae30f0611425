"""One rank of the two-rank DeepSpeed test (run by test_learner_two_ranks.py, not by pytest).

argv: OUT_FILE. RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT come from the environment. Each rank
trains one step on its own trajectories (different per rank), then writes its adapter parameters.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from teamrl.learner.engine import AdapterSettings, LearnerEngine, init_distributed
from teamrl.learner.modelbuild import build
from teamrl.protocol.trajectory import AgentStep, GraphTrajectory


def trajectories(rank: int) -> list[GraphTrajectory]:
    rng = np.random.default_rng(100 + rank)  # each rank its own data
    out = []
    for g in range(2):
        for k in range(4):
            step = AgentStep(
                agent_id="solver",
                role="solver",
                model_id="m",
                adapter="solver-lora",
                policy_version=0,
                turn=0,
                parents=np.zeros(0, np.int32),
                prompt_ids=np.asarray([1, 16, 2, 3, 12, 4, 5, 13], np.int32),
                response_ids=rng.integers(2, 19, size=4).astype(np.int32),
                logprobs=np.full(4, -2.0, np.float32),
                reward=float(k % 2) + 0.1 * k,
            )
            out.append(GraphTrajectory(f"r{rank}-{g}-{k}", "w", g * 4 + k, "t", f"r{rank}g{g}", "w", [step]))
    return out


def main() -> int:
    rank, world = init_distributed("cpu")
    assert world == 2, world
    s = AdapterSettings(lr=1e-2, clip_low=0.2, clip_high=0.2)
    eng = LearnerEngine.build(
        build(), ["solver-lora"], adapter_settings={"solver-lora": s}, logprob_tolerance=None
    )
    before = {k: v.clone() for k, v in eng.adapter_state("solver-lora").items()}
    res = eng.train_step(trajectories(rank), 0, 0)
    after = eng.adapter_state("solver-lora")
    moved = max(float((after[k] - before[k]).abs().max()) for k in after)
    torch.save({"params": after, "moved": moved, "loss": res.losses, "world": world}, sys.argv[1])
    print(f"rank {rank}: moved {moved:.3e}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.exit(main())
