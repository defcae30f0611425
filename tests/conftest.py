"""Suite-wide fixtures.

``embedded_model``: the embedded default model (README, "The embedded default model"), built once per
session into ``$TEAMRL_CACHE`` (default ``~/.cache/teamrl``). Every test that needs it, in-process or
through a service it starts, depends on this fixture (usually ``pytestmark =
pytest.mark.usefixtures("embedded_model")``), so the suite passes from an empty cache in any test order
and no test relies on a cache left by an earlier run. The build takes a file lock: two pytest runs (or a
test and a ``teamrl`` command) on the same cache never write the same half-built folder.
"""

from __future__ import annotations

import fcntl
import time
from pathlib import Path

import pytest

BUILD_LOCK_WAIT_S = 1800.0  # a build takes minutes on 2 busy cores


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    from teamrl.learner.modelbuild import build, default_model_dir

    target = default_model_dir()
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
            return build(target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
