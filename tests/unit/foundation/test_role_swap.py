"""The role-swap ablation's assignments (tests/bench/role_swap.py) and ``teamrl eval --serve``,
without vLLM: which trained weights each role is served with."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import role_swap as rs  # noqa: E402

from teamrl.cli.evaluate import _served_as, build_parser  # noqa: E402


def test_assignments_swap_rotate_and_share() -> None:
    got = rs.assignments(["planner-lora", "solver-lora", "verifier-lora"])
    assert got["specialised"] == []
    assert got["swapped"] == [
        ("planner-lora", "solver-lora"),
        ("solver-lora", "verifier-lora"),
        ("verifier-lora", "planner-lora"),
    ]  # a rotation: no role keeps its own adapter
    assert got["all-solver-lora"] == [("planner-lora", "solver-lora"), ("verifier-lora", "solver-lora")]
    assert list(rs.assignments(["only-lora"])) == ["specialised"]


def test_eval_serve_maps_roles_to_the_folder_as_trained(tmp_path: Path) -> None:
    subs = {"solver-lora": tmp_path / "s", "verifier-lora": tmp_path / "v"}
    args = build_parser().parse_args(
        [
            "--workflow",
            "addition-duo",
            "--serve",
            "solver-lora=verifier-lora",
            "--serve",
            "verifier-lora=solver-lora",
        ]
    )
    assert _served_as(subs, args.serve) == {"solver-lora": tmp_path / "v", "verifier-lora": tmp_path / "s"}
    with pytest.raises(SystemExit, match="holds"):
        _served_as(subs, [("judge-lora", "solver-lora")])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--workflow", "w", "--serve", "no-equals-sign"])
    assert rs.last_version(tmp_path) is None
    for v in (2, 10, 9):
        (tmp_path / "adapters" / f"v{v}").mkdir(parents=True)
    assert rs.last_version(tmp_path) == tmp_path / "adapters" / "v10"
