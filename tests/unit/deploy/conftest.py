"""Shared fixtures of the deploy/ tests: the shipped config and every overlay, rendered once.

Rendering uses ``kustomize_lite`` (no binary needed); test_deploy_manifests.py checks that it
agrees exactly with ``kubectl kustomize`` wherever kubectl is installed.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import kustomize_lite  # noqa: E402

ROOT = HERE.parents[2]
DEPLOY = ROOT / "deploy"
CONFIG_FILE = DEPLOY / "config" / "teamrl.toml"
OVERLAYS = sorted(p.parent.name for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
# Rendered trees that are applied to a cluster: the overlays plus the monitoring bundle.
TREES = [f"overlays/{o}" for o in OVERLAYS] + ["monitoring"]


def render_tree(tree: str) -> list[dict[str, Any]]:
    """Render ``deploy/<tree>`` with the lite renderer."""
    return kustomize_lite.render(DEPLOY / tree)


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
