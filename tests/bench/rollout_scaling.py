"""Rollout scaling: generation throughput with 1, 2 and 4 rollout services on this machine.

Each count starts that many real ``teamrl rollout`` processes (vLLM, the embedded addition-duo
workflow, base weights) publishing to a receiver in this process that acks like the buffer. After
every service reports /readyz, generated tokens (sum of ``teamrl_rollout_tokens_total`` over the
services) and episodes received are counted over ``--window`` seconds. The last line is
``rollout_scaling=<float>``: throughput with the most services over throughput with one. On a
machine with C cores and services that each want all of them, expect about 1.0: the services share
the cores (see docs/results.md). Prints figures; asserts nothing.

``--bind split`` (default) gives service i its own share of the cores through
``VLLM_CPU_OMP_THREADS_BIND``, as pods with their own cpusets have (one service keeps vLLM's
binding); ``--bind auto`` leaves vLLM's automatic binding to every service, under which every
engine on the machine binds its worker to the same core(s).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from teamrl.protocol.codec import decode_trajectories
from teamrl.protocol.ports import free_port
from teamrl.protocol.zmq_transport import ZmqDataReceiver
from teamrl.rollout.cpus import core_shares


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


def tokens(port: int) -> float:
    return sum(
        float(v)
        for v in re.findall(r"^teamrl_rollout_tokens_total\{[^}]*\} ([0-9.e+-]+)$", scrape(port), re.M)
    )


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def measure(n: int, window: float, logs: Path, threads: int, bind: str) -> dict:
    data = f"tcp://127.0.0.1:{free_port()}"
    weights = f"tcp://127.0.0.1:{free_port()}"  # no learner: base weights (version 0)
    rx = ZmqDataReceiver(data)
    ports = [free_port() for _ in range(n)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    shares = core_shares(n) if bind == "split" else [{}] * n
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "teamrl.cli.main", "rollout", "--insecure", "--buffer", data, "--weights", weights,
             "--metrics-port", str(ports[i]), "--set", f"replica={i}", "--set", f"num_replicas={n}",
             "--set", "drain_timeout_s=0.0"],
            stdout=open(logs / f"n{n}-rollout{i}.log", "wb"), stderr=subprocess.STDOUT,
            env={**env, **shares[i]},
        )
        for i in range(n)
    ]  # fmt: skip
    episodes = 0

    def pump(seconds: float) -> int:
        got = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            f = rx.recv(50)
            if f is not None:
                got += len(decode_trajectories(f.payload))
                rx.ack(f)
        return got

    try:
        deadline = time.monotonic() + 600
        while not all(ready(p) for p in ports):
            pump(1.0)
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{n} services did not all become ready; logs in {logs}")
        pump(5.0)  # every engine past its first, slow batches
        t0, k0 = time.monotonic(), sum(tokens(p) for p in ports)
        episodes = pump(window)
        dt, k1 = time.monotonic() - t0, sum(tokens(p) for p in ports)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + 120
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            pump(0.2)
        for p in procs:
            if p.poll() is None:
                p.kill()
        rx.close()
    return {"services": n, "tokens_per_s": (k1 - k0) / dt, "episodes_per_s": episodes / dt}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", default="1,2,4", help="service counts to measure (default 1,2,4)")
    p.add_argument("--window", type=float, default=30.0, help="seconds measured per count")
    p.add_argument("--threads", type=int, default=0, help="OMP threads per service (0: cores / services)")
    p.add_argument("--quick", action="store_true", help="counts 1,2 and a 10 s window")
    p.add_argument(
        "--bind",
        choices=["split", "auto"],
        default="split",
        help="split: each service its own cores (VLLM_CPU_OMP_THREADS_BIND); auto: vLLM's default binding",
    )
    args = p.parse_args(argv)
    counts = [1, 2] if args.quick else [int(x) for x in args.counts.split(",")]
    window = 10.0 if args.quick else args.window
    logs = Path(tempfile.mkdtemp(prefix="teamrl-scaling-"))
    cores = os.cpu_count() or 1
    results = []
    for n in counts:
        r = measure(n, window, logs, args.threads or max(1, cores // n), args.bind)
        results.append(r)
        print(
            f"{n} rollout service(s): {r['tokens_per_s']:,.0f} tok/s, {r['episodes_per_s']:,.1f} episodes/s",
            flush=True,
        )
    base = results[0]["tokens_per_s"]
    for r in results[1:]:
        print(f"  x{r['services']}: {r['tokens_per_s'] / base:.2f} of the 1-service throughput")
    print(f"machine: {cores} cores, binding {args.bind}; logs in {logs}")
    print(f"rollout_scaling={results[-1]['tokens_per_s'] / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
