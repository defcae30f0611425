"""Two DeepSpeed ranks on CPU (gloo, ZeRO-2): each trains on its own data, and the adapters stay equal.

Data parallelism is only right if the ranks' gradients are averaged before each optimiser step; then
both ranks hold identical adapter parameters after the step even though their batches differed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]

WORKER = Path(__file__).with_name("two_rank_worker.py")


def test_two_cpu_ranks_average_gradients_and_stay_in_sync(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "DS_ACCELERATOR": "cpu",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(tmp_path / f"rank{rank}.pt")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["world"] == r1["world"] == 2
    assert r0["moved"] > 1e-6 and r1["moved"] > 1e-6, "the step did not move the adapter"
    assert r0["loss"] != r1["loss"], "the ranks saw the same data"
    for k in r0["params"]:
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=1e-6)
