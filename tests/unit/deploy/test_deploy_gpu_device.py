"""The GPU overlays run the learner on CUDA as written, not by detection (issue 21, "GPU as deployed").

The learner's ``--device`` default is ``auto``; the GPU overlays still say ``--device cuda``, keep
every argument of the base (a patch replaces the list whole), and pin ``LOCAL_RANK`` to 0 (one GPU
per pod, whatever the StatefulSet ordinal). The CPU overlay keeps the default.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import render_tree


def _learner(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "learner"]
    (c,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "learner"]
    return c


@pytest.mark.parametrize("overlay", ["overlays/gpu", "overlays/gpu-keda"])
def test_gpu_learner_selects_cuda_and_keeps_the_base_arguments(overlay: str) -> None:
    base, gpu = _learner(render_tree("base")), _learner(render_tree(overlay))
    args = gpu["args"]
    assert args[args.index("--device") + 1] == "cuda"
    assert args[: len(base["args"])] == base["args"]  # nothing of the base lost
    env = {e["name"]: e.get("value") for e in gpu.get("env", [])}
    assert env.get("LOCAL_RANK") == "0"


def test_cpu_overlay_leaves_the_device_to_auto() -> None:
    assert "--device" not in _learner(render_tree("overlays/cpu-dev"))["args"]
