"""Byte-mutation fuzzing of both decoders (docs/reliability.md R-fuzz), in subprocess chunks so that a
segfault fails its chunk instead of killing pytest: 20,000 Arrow and 100,000 msgpack frames, every
one a valid decode or a typed, counted ProtocolError."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("protocol_fuzz_worker.py")


@pytest.mark.parametrize(
    ("kind", "chunks", "per_chunk"),
    [("arrow", 4, 5_000), ("msgpack", 4, 25_000)],
)
def test_mutated_frames_never_crash(kind, chunks, per_chunk):
    total_valid = total_rejected = 0
    for chunk in range(chunks):
        proc = subprocess.run(
            [sys.executable, str(WORKER), kind, str(1000 + chunk), str(per_chunk)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, (
            f"chunk {chunk} rc={proc.returncode} (negative = signal)\n{proc.stderr[-3000:]}"
        )
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        assert res["valid"] + res["rejected"] == per_chunk
        assert res["counted"] == res["rejected"]  # every rejection moved the counter exactly once
        total_valid += res["valid"]
        total_rejected += res["rejected"]
    print(
        f"{kind}: {chunks * per_chunk} mutated frames, {total_valid} still valid, {total_rejected} rejected"
    )
    assert total_rejected > 0
