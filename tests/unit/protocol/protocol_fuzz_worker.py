"""Fuzz worker, run in a subprocess so a segfault shows as a failed chunk, not a dead pytest.

Usage: python protocol_fuzz_worker.py {arrow|msgpack} SEED COUNT
Prints one JSON line {"valid": n, "rejected": n, "counted": n}; exits 2 on an untyped exception.
"""

from __future__ import annotations

import json
import random
import sys
import traceback

from teamrl.protocol import ProtocolError, decode_trajectories, encode_trajectories, example_trajectories
from teamrl.protocol import control as C
from teamrl.protocol.metrics import REJECTED_FRAMES

INTERESTING = [
    b"\x00\x00\x00\x00",
    b"\xff\xff\xff\xff",
    b"\xff\xff\xff\x7f",
    b"\x00\x00\x00\x80",
    b"\x10\x00\x00\x00",
]


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    op = rng.random()
    if op < 0.1 and len(b) > 1:
        return bytes(b[: rng.randrange(len(b))])  # truncation
    if op < 0.2:
        pos = rng.randrange(len(b) + 1)
        return bytes(b[:pos] + rng.randbytes(rng.randint(1, 8)) + b[pos:])  # insertion
    if op < 0.45 and len(b) >= 4:
        pos = rng.randrange(0, len(b) - 3) & ~3  # aligned int32 overwrite (offsets, lengths)
        b[pos : pos + 4] = rng.choice(INTERESTING)
        return bytes(b)
    for _ in range(rng.randint(1, 4)):
        b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


def seeds(kind: str, rng: random.Random) -> list[bytes]:
    if kind == "arrow":
        return [
            encode_trajectories(example_trajectories(rng.randint(1, 2), seed=s, tokens=24)) for s in range(4)
        ]
    w = C.WeightsPublished(
        announce_seq=3,
        version=9,
        adapters={"solver": "solver-v9", "critic": "critic-v9"},
        location=C.InlineWeights(chunks=[b"\x00" * 16]),
        sha256="ab" * 32,
        probe=C.Probe(prompt_ids=[1, 2, 3], completion_ids=[4], expected_logprobs=[-0.25]),
    )
    msgs = [
        w,
        C.Hello(service="rollout", incarnation="r-1", capabilities=["arrow-v1"]),
        C.Ack(incarnation="r-1", seqs=[1, 2, 3], rejected=[4], reason="schema_mismatch"),
        C.SampleRequest(request_id=5, agent_id="solver", batch_size=8, rank=1),
        C.SampleReply(request_id=5, nbytes=40, count=1, weights=[1.0]),
        C.BufferStats(size=3, per_agent={"solver": 10}),
        C.Heartbeat(incarnation="r-1", seq=7, time=1.5),
    ]
    return [C.pack_message(m) for m in msgs]


def main() -> int:
    kind, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    corpus = seeds(kind, rng)
    decode = decode_trajectories if kind == "arrow" else C.unpack_message
    valid = rejected = 0
    for _ in range(count):
        data = mutate(rng, rng.choice(corpus))
        try:
            decode(data)
            valid += 1
        except ProtocolError:
            rejected += 1
        except Exception:  # noqa: BLE001 - the point: anything untyped is a failure
            print(f"UNTYPED on input {data.hex()[:400]}... ({len(data)} bytes)", file=sys.stderr)
            traceback.print_exc()
            return 2
    counted = sum(s.value for s in REJECTED_FRAMES.collect()[0].samples if s.name.endswith("_total"))
    # the decoder still works after all that
    for data in corpus:
        decode(data)
    print(json.dumps({"valid": valid, "rejected": rejected, "counted": counted}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
