"""Transport benchmark: realistic trajectory batches end to end over ZeroMQ tcp loopback.

Three paths move the same batches (~256 agent steps x ~1,024 tokens each) in the same run, with
the same arrangement: a sender *process* (in deployment, a rollout service) whose DEALER connects
to a ROUTER bound in this process (the replay buffer), each side with its own zmq context, the
same message count and high-water marks. The sender rebuilds the batches from the same seeds and
proves they are the same by a digest of their Arrow encoding. One warm-up message per trial
establishes the connection before the clock starts; the clock runs from "go" to the last message
received *and processed* here.

* raw:    the Arrow payloads, encoded before the clock, DEALER -> ROUTER, copy=False; the
          receiver only receives: the ceiling for these bytes;
* codec:  encode_trajectories_buffer (from Python trajectories, as the rollout service does) ->
          ZmqDataSender (credit window, acks) -> ZmqDataReceiver -> decode_batches (full Arrow
          validation + every field check, into zero-copy columns: what the replay buffer service
          does with a frame) -> ack;
* pickle: pickle.dumps(protocol 5) -> DEALER -> ROUTER -> pickle.loads (no validation at all);
* peer:   what a peer system sends (prime-rl-style): msgpack of each step's token-id and log-prob
          lists -> DEALER -> ROUTER -> msgpack.unpackb into Python lists (no validation);
* frames: (diagnostic, not in the ratio) the pre-encoded payloads through ZmqDataSender ->
          ZmqDataReceiver -> ack, no encode or decode: what the transport itself costs;
* enc-only, dec-only: (diagnostics) the codec path with one side's work left out: the sender
          encodes and the receiver only acks, or the sender sends the pre-encoded payloads and the
          receiver decodes. Their ratios to raw show which side bounds the codec path.

The "alone" line times each stage of the codec path in one thread, without transport, and also
``decode_trajectories`` (the same checks, then a Python object per step: what a consumer that
wants objects pays). ``--threads`` runs the sender as a thread of this process instead; encode and decode then share
one GIL, which the services never do. Trials interleave the three paths; the median time of each
is reported (this machine is shared, single runs are noisy). Prints MB/s (of Arrow payload bytes),
trajectories/s, the ratio codec / raw and the codec against its peers (codec/peer, codec/pickle: > 1 is
faster). The last line is exactly ``transport_ratio=<float>`` (codec / raw).
The "cpu" lines add each side's CPU time per batch (user + system, all threads of the process:
ZeroMQ's I/O threads and the kernel's loopback copies included) and the ceiling it implies: a path
that costs c CPU-seconds per batch cannot move more than cores / c batches a second, whatever
overlaps. The "share" line turns the sender's CPU per generated token into the part of a rollout
service's CPU time that publishing takes, at a generation rate (``--gen-rate``, default the rollout
bench's measured engine rate on 2 cores) on ``--rollout-cores`` cores. A script, not a test: nothing
here asserts a timing.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import pickle
import resource
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgpack
import zmq

from teamrl.protocol import decode_trajectories, encode_trajectories_buffer, example_trajectories
from teamrl.protocol.codec import decode_batches
from teamrl.protocol.zmq_transport import ZmqDataReceiver, ZmqDataSender

HWM = 64
WINDOW = 16
PATHS = ("raw", "codec", "pickle", "peer", "frames", "enc-only", "dec-only")
GEN_RATE = 1779.0  # tokens/s of the rollout engine on 2 cores (tests/bench/rollout.py, docs/results.md)


def make_batches(n_batches: int, steps_per_batch: int, tokens: int) -> list[list]:
    batches = []
    for b in range(n_batches):
        pool = example_trajectories(steps_per_batch // 4 + 8, seed=b, tokens=tokens)
        batch, steps = [], 0
        for t in pool:
            if steps >= steps_per_batch:
                break
            batch.append(t)
            steps += len(t.steps)
        batches.append(batch)
    return batches


def peer_pack(batch: list) -> bytes:
    """A batch as a peer system ships it: per step, token ids and log-probs as msgpack lists."""
    return msgpack.packb(
        [
            {
                "episode": t.episode_id,
                "reward": t.reward,
                "steps": [
                    {
                        "agent": s.agent_id,
                        "prompt_ids": s.prompt_ids.tolist(),
                        "response_ids": s.response_ids.tolist(),
                        "logprobs": s.logprobs.tolist(),
                        "reward": s.reward,
                    }
                    for s in t.steps
                ],
            }
            for t in batch
        ]
    )


def digest(payloads: list) -> str:
    h = hashlib.sha256()
    for p in payloads:
        h.update(memoryview(p))
    return h.hexdigest()


def cpu_s() -> float:
    """CPU seconds (user + system) of this whole process so far: every thread, ZeroMQ's I/O threads too."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --------------------------------------------------------------------------------------------
# sender side (a spawned process, or a thread with --threads)


def _send_plain(conn: Connection, endpoint: str, items: list, rounds: int, make: Callable) -> None:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, HWM)
    dealer.connect(endpoint)
    dealer.send(b"warm-up")
    conn.recv()  # go
    c0 = cpu_s()
    for _ in range(rounds):
        for item in items:
            dealer.send(make(item), copy=False)
    conn.recv()  # the receiver has everything: closing cannot drop a message now
    cpu = cpu_s() - c0
    dealer.close(0)
    ctx.term()
    conn.send(cpu)


def _send_codec(conn: Connection, endpoint: str, items: list, rounds: int, make: Callable) -> None:
    sender = ZmqDataSender(endpoint, "bench", window=WINDOW, ack_timeout_s=60)
    sender.send(encode_trajectories_buffer([]))  # warm-up
    sender.flush(60)
    conn.recv()  # go
    c0 = cpu_s()
    for _ in range(rounds):
        for item in items:
            sender.send(make(item))
    if not sender.flush(60):
        raise RuntimeError(f"codec sender: {sender.unacked} frames never acked")
    conn.recv()
    cpu = cpu_s() - c0
    sender.close()
    conn.send(cpu)


def sender_main(conn: Connection, n_batches: int, steps: int, tokens: int) -> None:
    """Build the batches, report their digest, then serve ``(path, endpoint, rounds)`` commands."""
    batches = make_batches(n_batches, steps, tokens)
    payloads = [encode_trajectories_buffer(b) for b in batches]
    conn.send(digest(payloads))
    while (cmd := conn.recv()) is not None:
        path, endpoint, rounds = cmd
        if path == "raw":
            _send_plain(conn, endpoint, payloads, rounds, lambda p: p)
        elif path == "pickle":
            _send_plain(conn, endpoint, batches, rounds, lambda b: pickle.dumps(b, protocol=5))
        elif path == "peer":
            _send_plain(conn, endpoint, batches, rounds, peer_pack)
        elif path in ("frames", "dec-only"):
            _send_codec(conn, endpoint, payloads, rounds, lambda p: p)
        else:
            _send_codec(conn, endpoint, batches, rounds, encode_trajectories_buffer)


# --------------------------------------------------------------------------------------------
# receiver side (this process); each returns (seconds from "go" to the last message processed,
# CPU seconds of this process over that time, CPU seconds of the sender process over its part)


def _recv_plain(
    conn: Connection, path: str, total: int, rounds: int, process: Callable
) -> tuple[float, float, float]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, HWM)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    conn.send((path, f"tcp://127.0.0.1:{port}", rounds))
    router.recv_multipart()  # warm-up
    conn.send("go")
    t0, c0 = time.perf_counter(), cpu_s()
    for _ in range(total):
        process(router.recv_multipart(copy=False)[1])
    dt, cpu = time.perf_counter() - t0, cpu_s() - c0
    conn.send("done")
    sender_cpu = conn.recv()
    router.close(0)
    ctx.term()
    return dt, cpu, sender_cpu


def _recv_codec(
    conn: Connection, path: str, total: int, rounds: int, process: Callable
) -> tuple[float, float, float]:
    recv = ZmqDataReceiver("tcp://127.0.0.1:0", hwm=HWM)
    conn.send((path, recv.endpoint, rounds))

    def one() -> None:
        frame = recv.recv(30_000)
        if frame is None:
            raise RuntimeError(f"{path} path stalled")
        process(frame.payload)
        recv.ack(frame)

    one()  # warm-up
    conn.send("go")
    t0, c0 = time.perf_counter(), cpu_s()
    for _ in range(total):
        one()
    dt, cpu = time.perf_counter() - t0, cpu_s() - c0
    conn.send("done")
    sender_cpu = conn.recv()
    recv.close()
    return dt, cpu, sender_cpu


def run_path(conn: Connection, path: str, n_batches: int, rounds: int) -> tuple[float, float, float]:
    total = n_batches * rounds
    if path in ("codec", "dec-only"):
        return _recv_codec(conn, path, total, rounds, decode_batches)
    if path in ("frames", "enc-only"):
        return _recv_codec(conn, path, total, rounds, lambda payload: None)
    if path == "raw":
        return _recv_plain(conn, "raw", total, rounds, lambda frame: None)
    if path == "peer":
        return _recv_plain(conn, "peer", total, rounds, lambda frame: msgpack.unpackb(frame.buffer))
    return _recv_plain(conn, "pickle", total, rounds, lambda frame: pickle.loads(frame.buffer))


def report_cpu(
    cpu: dict[str, list[tuple[float, float]]],
    med: dict[str, float],
    messages: int,
    generated_per_batch: float,
    gen_rate: float,
    rollout_cores: int,
) -> None:
    """CPU per batch on each side (median over trials) and the ceiling the cores put on codec/raw.

    However well encode and decode overlap, a path that costs ``c`` CPU-seconds per batch moves at
    most ``cores / c`` batches a second, so codec/raw <= cores * (raw seconds per batch) / c.
    """
    cores = len(os.sched_getaffinity(0))
    per = {p: tuple(statistics.median(x[i] for x in cpu[p]) / messages * 1e3 for i in (0, 1)) for p in PATHS}
    print(
        "cpu ms/batch (receiver + sender): "
        + "   ".join(f"{p} {r:.2f}+{s:.2f}" for p, (r, s) in per.items() if p not in ("pickle", "peer"))
    )
    raw_s = med["raw"] / messages * 1e3
    ceiling = cores * raw_s / sum(per["codec"])
    print(
        f"ceiling: codec uses {sum(per['codec']):.2f} CPU-ms per batch; on {cores} cores it can reach at most "
        f"{ceiling:.2f} of raw ({raw_s:.2f} ms/batch) even with perfect overlap"
    )
    # The rollout side of the codec path (encode, send, acks) per generated (response) token
    per_token_ms = per["codec"][1] / generated_per_batch
    share = gen_rate * per_token_ms / 1e3 / rollout_cores
    print(
        f"share: publishing costs the rollout {per_token_ms * 1e3:.2f} CPU-us per generated token; at "
        f"{gen_rate:,.0f} tok/s on {rollout_cores} cores that is {100 * share:.3f} % of the rollout's CPU time"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (< 30 s)")
    ap.add_argument("--steps", type=int, default=256, help="agent steps per batch")
    ap.add_argument("--tokens", type=int, default=1024, help="mean tokens per step")
    ap.add_argument("--trials", type=int, default=None, help="interleaved trials per path (median reported)")
    ap.add_argument("--threads", action="store_true", help="sender as a thread of this process (one GIL)")
    ap.add_argument(
        "--gen-rate",
        type=float,
        default=GEN_RATE,
        help="rollout generation rate, tokens/s, for the share line",
    )
    ap.add_argument(
        "--rollout-cores", type=int, default=2, help="cores of the rollout service, for the share line"
    )
    args = ap.parse_args()
    n_batches, rounds, trials = (8, 4, 5) if args.quick else (16, 10, 7)
    trials = args.trials or trials

    batches = make_batches(n_batches, args.steps, args.tokens)
    payloads = [encode_trajectories_buffer(b) for b in batches]
    n_bytes = sum(p.size for p in payloads) * rounds
    n_traj = sum(len(b) for b in batches) * rounds
    n_steps = sum(len(t.steps) for b in batches for t in b) / n_batches
    generated = sum(len(s.response_ids) for b in batches for t in b for s in t.steps) / n_batches
    print(
        f"{n_batches} batches x {rounds} rounds x {trials} trials; {n_steps:.0f} steps/batch, "
        f"{n_bytes / n_batches / rounds / 1e6:.2f} MB/batch; sender in a {'thread' if args.threads else 'process'}"
    )

    # Where the codec path's time goes, one thread, no transport: median of the trials.
    single = n_bytes / rounds
    stages: dict[str, list[float]] = {"encode": [], "decode_batches": [], "decode_trajectories": []}
    for _ in range(trials):
        for name, fn, items in (
            ("encode", encode_trajectories_buffer, batches),
            ("decode_batches", decode_batches, payloads),
            ("decode_trajectories", decode_trajectories, payloads),
        ):
            t0 = time.perf_counter()
            for item in items:
                fn(item)
            stages[name].append(time.perf_counter() - t0)
    print(
        "alone:  "
        + "   ".join(
            f"{name} {single / statistics.median(ts) / 1e6:.0f} MB/s "
            f"({statistics.median(ts) / n_batches * 1e3:.2f} ms/batch)"
            for name, ts in stages.items()
        )
    )

    here, there = multiprocessing.Pipe()
    sender_args = (there, n_batches, args.steps, args.tokens)
    if args.threads:
        sender = threading.Thread(target=sender_main, args=sender_args, daemon=True)
    else:
        sender = multiprocessing.get_context("spawn").Process(
            target=sender_main, args=sender_args, daemon=True
        )
    sender.start()
    if here.recv() != digest(payloads):
        raise RuntimeError("the sender built different batches")

    times: dict[str, list[float]] = {p: [] for p in PATHS}
    cpu: dict[str, list[tuple[float, float]]] = {p: [] for p in PATHS}  # (receiver, sender) CPU s
    for _ in range(trials):
        for path in PATHS:
            dt, recv_cpu, send_cpu = run_path(here, path, n_batches, rounds)
            times[path].append(dt)
            cpu[path].append((recv_cpu, send_cpu))
    here.send(None)
    sender.join(30)

    med = {p: statistics.median(ts) for p, ts in times.items()}
    for p in PATHS:
        print(
            f"{p:>8}: {n_bytes / med[p] / 1e6:8.0f} MB/s  {n_traj / med[p]:10.0f} trajectories/s  "
            f"(median {med[p]:.3f} s, min {min(times[p]):.3f}, max {max(times[p]):.3f})"
        )
    per_trial = sorted(r / c for r, c in zip(times["raw"], times["codec"], strict=True))
    ratio = med["raw"] / med["codec"]
    print(
        f"codec/raw = {ratio:.3f} (per trial {per_trial[0]:.3f}..{per_trial[-1]:.3f})   "
        f"pickle/raw = {med['raw'] / med['pickle']:.3f}"
    )
    print(
        f"peers: codec/peer = {med['peer'] / med['codec']:.3f} (msgpack token lists)   "
        f"codec/pickle = {med['pickle'] / med['codec']:.3f}   (> 1: the codec is faster, and it validates)"
    )
    print(
        f"bound: enc-only/raw = {med['raw'] / med['enc-only']:.3f}   "
        f"dec-only/raw = {med['raw'] / med['dec-only']:.3f}   (the lower one is the side that limits codec)"
    )
    if not args.threads:
        report_cpu(cpu, med, n_batches * rounds, generated, args.gen_rate, args.rollout_cores)
    print(f"transport_ratio={ratio:.4f}")


if __name__ == "__main__":
    main()
