"""``teamrl run`` authenticates its links by default: the run's keys in RUN/curve (made once, kept
on --resume) and a ``[transport]`` table in RUN/config.toml that the buffer, learner and rollout
read from ``--config``; ``--insecure`` turns it off. docs/transport-security.md."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from teamrl.cli.config import to_toml
from teamrl.cli.run import parse_args
from teamrl.cli.run_async import transport_table
from teamrl.learner.buffer_service import load_transport as buffer_transport
from teamrl.learner.config import LearnerConfigError
from teamrl.learner.service import load_transport as learner_transport
from teamrl.protocol.curve import ROLES
from teamrl.rollout.config import RolloutConfigError
from teamrl.rollout.config import load_transport as rollout_transport


def test_insecure_flag_defaults_off() -> None:
    assert parse_args(["--workflow", "addition-duo"], "teamrl run", None, "runs/run").insecure is False
    assert parse_args(["--workflow", "addition-duo", "--insecure"], "teamrl run", None, "runs/run").insecure


def test_run_keys_made_once_and_read_by_every_service(tmp_path: Path) -> None:
    run = tmp_path / "run"
    table = transport_table(argparse.Namespace(insecure=False), run)
    keys = run / "curve"
    assert table == {"transport": {"curve": True, "curve_dir": str(keys.resolve())}}
    assert sorted(p.name for p in keys.iterdir()) == sorted(f"{r}.{e}" for r in ROLES for e in ("key", "pub"))
    assert all((keys / f"{r}.key").stat().st_mode & 0o077 == 0 for r in ROLES)
    before = {p.name: p.read_bytes() for p in keys.iterdir()}
    transport_table(argparse.Namespace(insecure=False), run)  # --resume: the same keys
    assert {p.name: p.read_bytes() for p in keys.iterdir()} == before

    cfg = run / "config.toml"
    cfg.write_text(to_toml({"learner": {"lr": 1e-4}, "rollout": {"group_size": 4}, **table}) + "\n")
    assert tomllib.loads(cfg.read_text())["transport"]["curve"] is True
    for load in (learner_transport, rollout_transport):
        t = load(str(cfg))
        assert t.curve and t.curve_dir == keys.resolve()
    b = buffer_transport(argparse.Namespace(config=str(cfg)))
    assert b.server_curve("buffer_data") is not None

    (keys / "rollout.key").unlink()  # a broken key folder fails at start-up, naming the file
    with pytest.raises(RolloutConfigError, match="rollout.key"):
        rollout_transport(str(cfg))
    (keys / "learner.pub").unlink()
    with pytest.raises(LearnerConfigError, match="learner.pub"):
        learner_transport(str(cfg))


def test_insecure_writes_no_transport_table(tmp_path: Path) -> None:
    assert transport_table(argparse.Namespace(insecure=True), tmp_path / "run") == {}
    assert not (tmp_path / "run" / "curve").exists()
    assert learner_transport(None).curve is False and rollout_transport(None).curve is False
