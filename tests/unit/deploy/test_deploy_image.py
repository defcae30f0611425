"""The container image recipe and the CURVE secret generator.

Design: no Docker engine runs in CI, so the Dockerfile is linted (hadolint, where installed) and
checked for what would only fail at build or run time: a COPY of a path the build context
excludes, a variant the setup script does not know, an entry point other than ``teamrl``. The
CURVE secret generator's output is schema-validated and its keys decoded.
"""

from __future__ import annotations

import base64
import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import DEPLOY, ROOT

DOCKERFILE = ROOT / "Dockerfile"
BIN = Path(sys.executable).parent


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether ``path`` (or a folder above it) matches a .dockerignore pattern (no ! rules used)."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/"))
        for p in prefixes
        for pat in patterns
    )


def test_hadolint_clean() -> None:
    exe = shutil.which("hadolint") or (str(BIN / "hadolint") if (BIN / "hadolint").exists() else None)
    if exe is None:
        pytest.skip("hadolint not installed")
    res = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dockerfile_variants_entrypoint_and_sources() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    # Both variants must exist as stages and be what scripts/setup.sh installs as TEAMRL_EXTRA.
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "TEAMRL_EXTRA" in setup and 'TEAMRL_EXTRA="$VARIANT"' in text
    for variant in ("cpu", "gpu"):
        assert f"AS runtime-{variant}" in text
    assert re.search(r"^FROM runtime-\$\{VARIANT\}$", text, re.M)
    entry = re.findall(r"^ENTRYPOINT (.+)$", text, re.M)
    assert entry and entry[-1].rstrip().endswith('"teamrl"]'), entry
    assert re.search(r"^USER 10001", text, re.M), "the image must not run as root"
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns), "negations are not handled by this check"
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        *sources, _dest = line.split()
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert not _ignored(src, patterns), f"COPY {src}: excluded by .dockerignore"


def test_pods_use_the_image_user() -> None:
    uid = re.findall(r"^USER (\d+):(\d+)$", DOCKERFILE.read_text(), re.M)[-1]
    for path in (DEPLOY / "base").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in ("Deployment", "StatefulSet"):
                sc = doc["spec"]["template"]["spec"]["securityContext"]
                assert (str(sc["runAsUser"]), str(sc["runAsGroup"])) == uid, path.name


def test_curve_secret_generator(tmp_path: Path) -> None:
    pytest.importorskip("zmq")
    res = subprocess.run(
        [sys.executable, str(DEPLOY / "scripts" / "curve_secret.py"), "--namespace", "teamrl"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    doc = yaml.safe_load(res.stdout)
    assert doc["kind"] == "Secret" and doc["metadata"]["name"] == "teamrl-curve"
    files = {k: base64.b64decode(v) for k, v in doc["data"].items()}
    # the layout of a local run's RUN/curve (teamrl.protocol.curve.generate_run_keys), admin included
    curve = pytest.importorskip("teamrl.protocol.curve")
    made = curve.generate_run_keys(tmp_path / "run-curve")
    assert set(files) == {p.name for p in made.iterdir()}
    import zmq

    for role in ("buffer", "learner", "rollout", "admin"):
        pub, key = files[f"{role}.pub"].strip(), files[f"{role}.key"].strip()
        assert len(pub) == 40 and len(key) == 40  # Z85 of 32 bytes
        assert zmq.curve_public(key) == pub  # a matching pair
    assert len({files[f"{r}.pub"] for r in ("buffer", "learner", "rollout", "admin")}) == 4
    keep = tmp_path / "kept"
    kept = subprocess.run(
        [sys.executable, str(DEPLOY / "scripts" / "curve_secret.py"), "--dir", str(keep)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    data = {k: base64.b64decode(v) for k, v in yaml.safe_load(kept.stdout)["data"].items()}
    assert {p.name: p.read_bytes() for p in keep.iterdir()} == data
    assert (keep / "admin.key").stat().st_mode & 0o077 == 0
    exe = BIN / "kubernetes-validate"
    if exe.exists():
        path = tmp_path / "secret.yaml"
        path.write_text(res.stdout)
        check = subprocess.run([str(exe), "--strict", str(path)], capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
