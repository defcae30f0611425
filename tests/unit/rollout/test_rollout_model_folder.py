"""A rollout service never builds a model: it uses its config's folder or the embedded model's, and
says how to get one when neither is there (exit code 2, before any engine starts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from teamrl.rollout.config import RolloutConfig, RolloutConfigError, with_model


def test_the_embedded_folder_is_used_when_built_and_named_when_not(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TEAMRL_CACHE", str(tmp_path / "cache"))
    cfg = RolloutConfig(workflow="addition-duo")
    with pytest.raises(RolloutConfigError, match=r"teamrl model build"):
        with_model(cfg)
    folder = tmp_path / "cache" / "models" / "embedded-v1"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert with_model(cfg).model == str(folder)
    with pytest.raises(RolloutConfigError, match="not a model folder"):
        with_model(RolloutConfig(workflow="addition-duo", model=str(tmp_path / "nowhere")))


def test_the_command_refuses_before_starting_anything(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "teamrl.cli.main", "rollout", "--insecure", "--buffer", "tcp://127.0.0.1:9"]
        + ["--weights", "tcp://127.0.0.1:9", "--set", 'workflow="addition-duo"'],
        capture_output=True,
        text=True,
        timeout=60,
        env={"TEAMRL_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2 and "teamrl model build" in proc.stderr, proc.stderr
