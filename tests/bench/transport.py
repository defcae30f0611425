"""Transport benchmark: realistic trajectory batches end to end over ZeroMQ tcp loopback.

Three paths move the same batches (~256 agent steps x ~1,024 tokens each) in the same run:

* raw:    pre-encoded Arrow bytes, DEALER -> ROUTER, copy=False: the ceiling for these bytes;
* codec:  encode_trajectories_buffer -> ZmqDataSender (credit window, acks) -> ZmqDataReceiver ->
          decode_trajectories (full validation + field checks) -> ack;
* pickle: pickle.dumps(protocol 5) -> raw DEALER -> ROUTER -> pickle.loads (no validation at all).

Prints MB/s (of Arrow payload bytes), trajectories/s and the ratio codec / raw. The last line is
exactly ``transport_ratio=<float>``. A script, not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import pickle
import threading
import time

import zmq

from teamrl.protocol import decode_trajectories, encode_trajectories_buffer, example_trajectories
from teamrl.protocol.zmq_transport import ZmqDataReceiver, ZmqDataSender


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


def raw_zmq(payloads: list, rounds: int) -> float:
    """Seconds to push every payload ``rounds`` times through DEALER -> ROUTER and receive it."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 64)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, 64)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    total = len(payloads) * rounds

    def send() -> None:
        for _ in range(rounds):
            for p in payloads:
                dealer.send(p, copy=False)

    dealer.send(b"warm-up")
    router.recv_multipart()
    t0 = time.perf_counter()
    th = threading.Thread(target=send)
    th.start()
    for _ in range(total):
        router.recv_multipart(copy=False)
    dt = time.perf_counter() - t0
    th.join()
    dealer.close(0)
    router.close(0)
    ctx.term()
    return dt


def codec_path(batches: list, rounds: int) -> float:
    recv = ZmqDataReceiver("tcp://127.0.0.1:0", hwm=64)
    total = len(batches) * rounds

    def send() -> None:
        sender = ZmqDataSender(recv.endpoint, "bench", window=16, ack_timeout_s=30)
        for _ in range(rounds):
            for b in batches:
                sender.send(encode_trajectories_buffer(b))
        sender.flush(60)
        sender.close()

    t0 = time.perf_counter()
    th = threading.Thread(target=send)
    th.start()
    n = 0
    while n < total:
        frame = recv.recv(10_000)
        if frame is None:
            raise RuntimeError("codec path stalled")
        decode_trajectories(frame.payload)
        recv.ack(frame)
        n += 1
    dt = time.perf_counter() - t0
    th.join()
    recv.close()
    return dt


def pickle_path(batches: list, rounds: int) -> float:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    total = len(batches) * rounds

    def send() -> None:
        for _ in range(rounds):
            for b in batches:
                dealer.send(pickle.dumps(b, protocol=5), copy=False)

    t0 = time.perf_counter()
    th = threading.Thread(target=send)
    th.start()
    for _ in range(total):
        pickle.loads(router.recv_multipart(copy=False)[1].buffer)
    dt = time.perf_counter() - t0
    th.join()
    dealer.close(0)
    router.close(0)
    ctx.term()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (< 30 s)")
    ap.add_argument("--steps", type=int, default=256, help="agent steps per batch")
    ap.add_argument("--tokens", type=int, default=1024, help="mean tokens per step")
    args = ap.parse_args()
    n_batches, rounds = (8, 3) if args.quick else (16, 10)

    batches = make_batches(n_batches, args.steps, args.tokens)
    payloads = [encode_trajectories_buffer(b) for b in batches]
    n_bytes = sum(p.size for p in payloads) * rounds
    n_traj = sum(len(b) for b in batches) * rounds
    n_steps = sum(len(t.steps) for b in batches for t in b) / n_batches
    print(
        f"{n_batches} batches x {rounds} rounds; {n_steps:.0f} steps/batch, {n_bytes / n_batches / rounds / 1e6:.2f} MB/batch"
    )

    t0 = time.perf_counter()
    for b in batches:
        encode_trajectories_buffer(b)
    t_enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in payloads:
        decode_trajectories(p)
    t_dec = time.perf_counter() - t0
    single = n_bytes / rounds
    print(
        f"encode alone: {single / t_enc / 1e6:8.0f} MB/s   decode+validate alone: {single / t_dec / 1e6:8.0f} MB/s"
    )

    results = {
        "raw zmq": raw_zmq(payloads, rounds),
        "codec": codec_path(batches, rounds),
        "pickle": pickle_path(batches, rounds),
    }
    for name, dt in results.items():
        print(f"{name:>8}: {n_bytes / dt / 1e6:8.0f} MB/s  {n_traj / dt:10.0f} trajectories/s  ({dt:.2f} s)")
    ratio = results["raw zmq"] / results["codec"]
    print(f"codec/raw = {ratio:.3f}   pickle/raw = {results['raw zmq'] / results['pickle']:.3f}")
    print(f"transport_ratio={ratio:.4f}")


if __name__ == "__main__":
    main()
