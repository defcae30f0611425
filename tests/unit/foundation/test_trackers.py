"""W&B (offline) and MLflow (local file store) receive a run's config, learner steps and evaluations:
written through ``teamrl.cli.trackers`` with the real libraries, read back from what they stored."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from teamrl.cli.trackers import RunTrackers, make_trackers, parse_loggers

CONFIG = {"learner": {"lr": 1e-4, "batch_size": 8}, "rollout": {"group_size": 4}, "seed": 3}


def write_run(run: Path, steps: range) -> None:
    with (run / "metrics.jsonl").open("a") as f:
        for s in steps:
            f.write(
                json.dumps({"step": s, "time": 1.0 + s, "version": s + 1, "loss": {"solver": -0.5 * s}})
                + "\n"
            )
    with (run / "eval.jsonl").open("a") as f:
        f.write(
            json.dumps({"step": steps[-1] + 1, "version": steps[-1] + 1, "accuracy": 0.25 * len(steps)})
            + "\n"
        )


def forward_two_ticks(run: Path, names: list[str]) -> None:
    trackers = RunTrackers(make_trackers(names, run), run)
    trackers.start(CONFIG)
    write_run(run, range(0, 3))
    trackers.update()
    write_run(run, range(3, 5))  # only the new rows are sent on the next tick
    trackers.close()


def wandb_records(path: Path):
    """The protobuf records of a .wandb file (W&B's LevelDB-style log: 7-byte header, then blocks of
    32 KiB holding [crc32c][length u16][type] chunks), decoded with wandb's own Record class."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, i, block, buf = path.read_bytes(), 7, 32768, b""
    while i + 7 <= len(data):
        if block - (i % block) < 7:  # block trailer
            i += block - (i % block)
            continue
        (n,) = struct.unpack("<H", data[i + 4 : i + 6])
        kind = data[i + 6]
        buf += data[i + 7 : i + 7 + n]
        i += 7 + n
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""
        elif kind == 0:
            break


def test_wandb_offline_run_has_config_metrics_and_evals(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    forward_two_ticks(tmp_path, ["wandb"])
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    (log,) = folder.glob("run-*.wandb")
    history, config = [], {}
    for rec in wandb_records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {"/".join(x.nested_key) or x.key: json.loads(x.value_json) for x in rec.history.item}
            )
        elif kind == "config":
            config.update({x.key: json.loads(x.value_json) for x in rec.config.update})
    train = [(h["step"], h["train/loss/solver"]) for h in history if "train/loss/solver" in h]
    assert train == [(s, -0.5 * s) for s in range(5)]
    assert [(h["step"], h["eval/accuracy"]) for h in history if "eval/accuracy" in h] == [(3, 0.75), (5, 0.5)]
    assert config["learner"] == {"lr": 1e-4, "batch_size": 8} and config["seed"] == 3


def test_mlflow_file_store_has_metric_history_params_and_config(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    forward_two_ticks(tmp_path, ["mlflow"])
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("teamrl").experiment_id])
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"
    loss = client.get_metric_history(run.info.run_id, "train/loss/solver")
    assert sorted((m.step, m.value) for m in loss) == [(s, -0.5 * s) for s in range(5)]
    acc = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert sorted((m.step, m.value) for m in acc) == [(3, 0.75), (5, 0.5)]
    assert run.data.params["learner/lr"] == "0.0001" and run.data.params["seed"] == "3"
    assert "train/time" in run.data.metrics  # every number of a row goes; "step" is the x axis


def test_logger_names_are_checked() -> None:
    assert parse_loggers("tensorboard, wandb,mlflow") == ["tensorboard", "wandb", "mlflow"]
    with pytest.raises(ValueError, match="comet"):
        parse_loggers("wandb,comet")


def test_run_flag_and_config_key(tmp_path: Path) -> None:
    from teamrl.cli.run import parse_args

    args = parse_args(
        ["--workflow", "addition-duo", "--logger", "tensorboard,mlflow"], "teamrl run", None, "r"
    )
    assert (args.logger, args.tensorboard) == (["tensorboard", "mlflow"], True)
    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\nlogger = "wandb"\n')
    args = parse_args(["--workflow", "addition-duo", "--config", str(cfg)], "teamrl run", None, "r")
    assert (args.logger, args.tensorboard) == (["wandb"], False)
    assert parse_args(["--workflow", "addition-duo"], "teamrl run", None, "r").logger == []


def test_no_logger_no_tracker(tmp_path: Path) -> None:
    from teamrl.cli.trackers import start_trackers

    trackers = start_trackers([], tmp_path, CONFIG)
    write_run(tmp_path, range(2))
    trackers.close()  # nothing to send, nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.jsonl", "metrics.jsonl"]
