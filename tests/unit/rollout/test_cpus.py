"""How vLLM's CPU worker is sized and pinned in a container (teamrl.rollout.cpus)."""

from __future__ import annotations

from pathlib import Path

import pytest

from teamrl.rollout.cpus import core_shares, cpu_quota, vllm_cpu_env


def write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "200000 100000\n"}, 2.0),
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4.0),
        ({"cpu,cpuacct/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 0.5),
        ({"cpu.max": "garbage\n"}, None),
        ({}, None),
    ],
)
def test_cpu_quota_reads_cgroup_v2_and_v1(
    tmp_path: Path, files: dict[str, str], expected: float | None
) -> None:
    for name, text in files.items():
        write(tmp_path, name, text)
    assert cpu_quota(tmp_path) == expected


def test_a_quota_below_the_visible_cores_unpins_the_worker_with_quota_threads() -> None:
    # a pod limited to 2.5 CPUs on a 64-core node: not 31 pinned threads, 2 unpinned ones
    assert vllm_cpu_env({}, allowed=64, quota=2.5) == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "2",
    }
    assert vllm_cpu_env({}, allowed=64, quota=0.5)["OMP_NUM_THREADS"] == "1"
    # the operator's thread count is kept
    assert vllm_cpu_env({"OMP_NUM_THREADS": "3"}, allowed=64, quota=2)["OMP_NUM_THREADS"] == "3"


def test_vllm_binding_is_kept_without_a_quota_an_exclusive_cpuset_or_an_operator_choice() -> None:
    assert vllm_cpu_env({}, allowed=2, quota=None) == {}  # no quota: this machine
    assert vllm_cpu_env({}, allowed=4, quota=4.0) == {}  # static CPU manager: cpuset == quota
    assert vllm_cpu_env({"VLLM_CPU_OMP_THREADS_BIND": "0-3"}, allowed=64, quota=2) == {}


def test_core_shares_are_disjoint_and_one_service_keeps_vllms_choice() -> None:
    def lists(n: int, cores: list[int], environ: dict[str, str] | None = None) -> list[str | None]:
        return [e.get("VLLM_CPU_OMP_THREADS_BIND") for e in core_shares(n, cores, environ or {})]

    assert lists(1, [0, 1]) == [None]
    assert lists(2, [0, 1]) == ["0", "1"]
    assert lists(2, [0, 1, 2, 3]) == ["0,1", "2,3"]
    assert lists(3, [4, 5, 6, 7, 8, 9]) == ["4,5", "6,7", "8,9"]
    assert lists(4, [0, 1]) == ["0", "1", "0", "1"]  # more services than cores: round robin
    # the operator's own binding wins: nothing is added
    assert lists(2, [0, 1], {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}) == [None, None]
