"""A resumed learner's first version is above every version it ever exported (teamrl.learner.resume).

Rollouts drop an announcement older than the version they hold, so a learner killed before its
first checkpoint that started again at version 0 was never taken up: the rollouts' version budget
never refilled and the run waited with no end (docs/reliability.md R-kill-learner). The engine here
records the checkpoint it is asked to load; this test is about the version arithmetic only.
"""

from __future__ import annotations

import json
from pathlib import Path

from teamrl.learner.resume import DONE, RunCheckpoints


class _Engine:
    def __init__(self) -> None:
        self.loaded: list[Path] = []

    def load_checkpoint(self, folder: Path) -> None:
        self.loaded.append(folder)


def _exported(run: Path, *versions: int, adapter: str = "solver-lora") -> None:
    for v in versions:
        (run / "adapters" / f"v{v}" / adapter).mkdir(parents=True)


def _checkpoint(run: Path, step: int, version: int) -> Path:
    folder = run / "checkpoints" / f"step-{step:06d}"
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"step": step, "version": version}))
    (folder / DONE).write_text("")
    return folder


def _resume(run: Path) -> tuple[tuple[int, int] | None, _Engine]:
    engine = _Engine()
    got = RunCheckpoints(run, engine, rank=0, world=1, keep=2).resume("solver-lora")
    return got, engine


def test_a_fresh_run_folder_is_a_fresh_run(tmp_path: Path) -> None:
    assert _resume(tmp_path)[0] is None


def test_killed_before_the_first_checkpoint_goes_on_above_what_it_published(tmp_path: Path) -> None:
    _exported(tmp_path, 1, 2, 3, 4)
    got, engine = _resume(tmp_path)
    assert got == (0, 5), "step 0 (nothing to load), published as a version the rollouts will take"
    assert engine.loaded == []


def test_versions_published_after_the_checkpoint_are_skipped_not_reissued(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, 2, 2)
    _exported(tmp_path, 1, 2, 3, 4)
    got, engine = _resume(tmp_path)
    assert got == (2, 5) and engine.loaded == [folder]


def test_a_checkpoint_with_nothing_published_after_it_keeps_its_version(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2, 2)
    _exported(tmp_path, 1, 2)
    _exported(tmp_path, 7, adapter="other-groups-lora")  # another learner group's folders do not count
    assert _resume(tmp_path)[0] == (2, 2)


def test_only_version_0_exported_and_no_checkpoint_starts_at_0(tmp_path: Path) -> None:
    _exported(tmp_path, 0)  # a sync run exports v0 for its lagged loads
    got, engine = _resume(tmp_path)
    assert got == (0, 0) and engine.loaded == []
