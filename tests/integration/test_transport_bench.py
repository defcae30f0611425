"""The transport benchmark still runs end to end (``--quick``): every path, the CPU lines, the last line.

Only the output's shape is checked, never a figure: timings are the benchmark's business, not a test's.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "transport.py"


def test_quick_run_prints_every_path_and_the_ratio_last():
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--trials", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    lines = out.strip().splitlines()
    for path in ("raw", "codec", "pickle", "peer", "frames", "enc-only", "dec-only"):
        assert any(line.strip().startswith(f"{path}:") for line in lines), path
    assert any(line.startswith("cpu ms/batch") for line in lines)
    assert any(line.startswith("ceiling:") for line in lines)
    assert any(line.startswith("peers: codec/peer = ") for line in lines)
    assert any(line.startswith("share: ") for line in lines)
    assert re.fullmatch(r"transport_ratio=\d+\.\d+", lines[-1])
