"""One launcher per run folder: a second ``teamrl run`` on a folder in use is refused (exit 2, the holder's
pid named) instead of sharing the first run's checkpoints and adapters; the lock goes with its holder."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

import teamrl.cli.plan as plan_module
from teamrl.cli.run import RunFolderBusy, hold_run_folder, main


def test_second_holder_is_refused_until_the_first_lets_go(tmp_path):
    first = hold_run_folder(tmp_path / "run")
    with pytest.raises(RunFolderBusy, match=r"in use by another teamrl launcher \(pid \d+\)"):
        hold_run_folder(tmp_path / "run")
    first.close()
    hold_run_folder(tmp_path / "run").close()


def test_a_dead_holder_leaves_no_lock(tmp_path):
    code = f"from pathlib import Path; from teamrl.cli.run import hold_run_folder; hold_run_folder(Path({str(tmp_path)!r}))"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)  # exits holding it
    hold_run_folder(tmp_path).close()


def test_run_refuses_a_folder_in_use_before_launching(tmp_path, monkeypatch, capsys):
    team = SimpleNamespace(summary=lambda: "a team")
    monkeypatch.setattr(plan_module, "plan", lambda args: SimpleNamespace(team=team, groups={"policy": 0}))
    held = hold_run_folder(tmp_path)
    try:
        assert main(["--workflow", "addition-duo", "--run-dir", str(tmp_path)]) == 2
    finally:
        held.close()
    assert "in use by another teamrl launcher" in capsys.readouterr().err
