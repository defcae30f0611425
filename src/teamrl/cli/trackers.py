"""Experiment trackers: a run's config, the learner's per-step metrics and its held-out evaluations sent
to Weights & Biases and MLflow (docs/trackers.md).

The run folder stays the source (``config.toml``, ``metrics.jsonl`` of each learner group,
``eval.jsonl``); ``RunTrackers`` forwards the rows it has not sent yet each time it is called, so the
services need no tracker code and a tracker that fails cannot stop a run's training. TensorBoard
stays the learner's own (``--tensorboard``, ``teamrl.learner.tensorboard``).

Call sequence::

    trackers = RunTrackers(make_trackers(["wandb", "mlflow"], run_dir), run_dir, groups=[""])
    trackers.start(config)      # the resolved config: W&B config, MLflow params + config.json
    trackers.update()           # every tick: new metrics.jsonl / eval.jsonl rows
    trackers.close()            # a last update, then finish the runs

W&B: ``WANDB_MODE=offline`` writes ``RUN/wandb/offline-run-*`` with no network (``wandb sync`` later);
its project is ``WANDB_PROJECT`` (default ``teamrl``). MLflow: ``MLFLOW_TRACKING_URI`` if set, else a
file store in ``RUN/mlruns`` (``mlflow ui --backend-store-uri RUN/mlruns``); experiment
``MLFLOW_EXPERIMENT_NAME`` (default ``teamrl``).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from teamrl.cli.plots import group_dir

LOGGERS = ("tensorboard", "wandb", "mlflow")


class Tracker(Protocol):
    """One experiment tracker: ``log_config`` once, ``log`` per row, ``close`` at the end."""

    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def flatten(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``("a/b", v)`` for every leaf of nested tables, separated by ``/``."""
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            yield from flatten(v, key + "/")
        else:
            yield key, v


def numbers(row: Mapping[str, Any], prefix: str = "", skip: tuple[str, ...] = ()) -> dict[str, float]:
    """The finite numbers of a JSONL row (nested tables flattened), keys prefixed."""
    return {
        prefix + k: float(v)
        for k, v in flatten(row)
        if k not in skip and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class WandbTracker:
    """A W&B run in ``run_dir/wandb``; every key is plotted against the learner step ``step``."""

    def __init__(self, run_dir: Path, name: str) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "teamrl"),
            name=name,
            dir=str(run_dir),
            reinit="create_new",
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # eval rows may arrive after later train rows

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({**values, "step": step})

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before wandb-core has written the run's file (wandb 0.31, the first run
        # of a process: a 7-byte file); teardown waits for the service to flush and stop.
        wandb.teardown()


class MlflowTracker:
    """An MLflow run; a local file store in ``run_dir/mlruns`` unless ``MLFLOW_TRACKING_URI`` names one."""

    def __init__(self, run_dir: Path, name: str, tracking_uri: str | None = None) -> None:
        from mlflow.tracking import MlflowClient

        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless asked (it prefers a database); a folder in the run
            # is what works offline with mlflow-skinny, so ask.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "teamrl")
        exp = self.client.get_experiment_by_name(exp_name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(exp_name)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in flatten(config)]
        for i in range(0, len(params), 100):  # MLflow's batch limit for params
            self.client.log_batch(
                self.run_id, params=[Param(p.key, p.value[:6000]) for p in params[i : i + 100]]
            )
        self.client.log_dict(self.run_id, dict(config), "config.json")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit for metrics
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def parse_loggers(text: str) -> list[str]:
    """``"tensorboard,wandb"`` -> the names, checked against ``LOGGERS``."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in LOGGERS]
    if unknown:
        raise ValueError(
            f"unknown logger(s) {', '.join(unknown)}: expected a comma list of {', '.join(LOGGERS)}"
        )
    return names


def make_trackers(names: list[str], run_dir: Path) -> list[Tracker]:
    """The W&B / MLflow trackers among ``names`` (TensorBoard is the learner's own), named after the run."""
    makers = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    return [makers[n](run_dir, run_dir.resolve().name) for n in names if n in makers]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break  # a line being written now: taken on the next update
    return rows


class RunTrackers:
    """Forwards a run folder's rows to ``trackers``: each update sends only the rows not sent before.

    Learner rows go as ``train/<key>`` at their ``step`` (``train/<group>/<key>`` for learner groups),
    evaluations as ``eval/<key>`` at their ``step`` (else ``version``)."""

    def __init__(self, trackers: list[Tracker], run_dir: Path, groups: list[str] | None = None) -> None:
        self.trackers = trackers
        self.run_dir = run_dir
        self.groups = groups or [""]
        self.sent: dict[Path, int] = {}

    def start(self, config: Mapping[str, Any]) -> None:
        for t in self.trackers:
            t.log_config(config)

    def _new_rows(self, path: Path) -> list[dict[str, Any]]:
        rows = _read_jsonl(path)
        new, self.sent[path] = rows[self.sent.get(path, 0) :], len(rows)
        return new

    def update(self) -> None:
        if not self.trackers:
            return
        for g in self.groups:
            path = group_dir(self.run_dir, g) / "metrics.jsonl"
            prefix = f"train/{g}/" if g else "train/"
            for row in self._new_rows(path):
                self._log(int(row.get("step", 0)), numbers(row, prefix, skip=("step",)))
        for row in self._new_rows(self.run_dir / "eval.jsonl"):
            self._log(int(row.get("step", row.get("version", 0))), numbers(row, "eval/", skip=("step",)))

    def _log(self, step: int, values: dict[str, float]) -> None:
        if values:
            for t in self.trackers:
                t.log(step, values)

    def close(self) -> None:
        self.update()
        for t in self.trackers:
            t.close()


def start_trackers(
    loggers: list[str], run_dir: Path, config: Mapping[str, Any], groups: list[str] | None = None
) -> RunTrackers:
    """``teamrl run --logger ...``: the trackers named, started with the run's resolved config."""
    trackers = RunTrackers(make_trackers(loggers, run_dir), run_dir, groups)
    trackers.start(config)
    return trackers
