"""What replica 0 of the rollout services writes besides trajectories: held-out evaluations and
sample groups.

``Evaluator`` (owned by ``teamrl.rollout.service.RolloutService``) evaluates the live adapter
version on held-out tasks every ``eval_interval`` versions and on the run's last one, appending a
JSON line to ``eval_file``, and writes one finished group per new version to ``samples_dir`` (what
``teamrl show`` reads). Other replicas write neither. docs/architecture.md §3 ("Rollout services")
describes the service around it.

With several base models (one engine and one learner group each, docs/architecture.md §3) the
service passes the lowest live version over the bases as ``v`` and each base's version as
``versions``; a row then reads ``{"version": <lowest>, "step": <lowest>, "versions": {model_id: v},
...}`` (single-base rows have no ``versions``), and "final" means every base's learner announced its
final version.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("teamrl.rollout")


class Evaluator:
    """Held-out evaluations and sample groups of one rollout service (replica 0 only)."""

    def __init__(self, cfg: Any, runner: Any, replica: int) -> None:
        self.runner = runner  # WorkflowRunner: held-out tasks and their evaluation
        self.eval_interval = cfg.eval_interval
        self.eval_file = Path(cfg.eval_file) if cfg.eval_file and replica == 0 else None
        self.samples_dir = Path(cfg.samples_dir) if cfg.samples_dir and replica == 0 else None
        if self.samples_dir is not None:
            self.samples_dir.mkdir(parents=True, exist_ok=True)
        self.held_out = runner.held_out_tasks(cfg.eval_tasks)
        self._evaluated: set[int] = set()
        self._last_versions: dict[str, int] = {}  # each base's version at the last evaluation
        self._sampled_versions: set[int] = set()

    async def maybe_evaluate(
        self, v: int, final: bool = False, versions: dict[str, int] | None = None
    ) -> None:
        """Evaluate version ``v`` (the live one; several bases: the lowest) when it is the first one
        at or past the next multiple of ``eval_interval`` (versions can be skipped when the learner
        outpaces loading), or when the learner announced it as the run's last. ``versions``: each
        base's live version, written to the row when there is more than one base."""
        if self.eval_file is None or self.eval_interval == 0:
            return
        k = self.eval_interval
        last = max(self._evaluated, default=-1)
        seen = v in self._evaluated
        if final and versions is not None and len(versions) > 1:
            # several bases: the lowest version may have been evaluated while another base was still
            # behind its final one; the final row has every base's last version
            seen = self._last_versions == dict(versions)
        if seen or not (final or v // k > last // k):
            return
        self._evaluated.add(v)
        self._last_versions = dict(versions or {})
        t0 = time.time()
        res = await self.runner.evaluate(self.held_out)
        t_run = float(os.environ.get("TEAMRL_RUN_T0", t0))
        row: dict[str, Any] = {"version": v, "step": v}
        if versions is not None and len(versions) > 1:
            row["versions"] = dict(versions)
        row.update(time=t0 - t_run, eval_seconds=time.time() - t0, **res)
        with self.eval_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
        log.info(
            "held-out at v%d%s: %s", v, f" {row['versions']}" if "versions" in row else "", json.dumps(res)
        )

    def maybe_write_sample(self, trajs: list[Any]) -> None:
        """Write a finished group as the sample of its version, when that version has none yet."""
        from teamrl.protocol.codec import encode_trajectories

        version = min(s.policy_version for t in trajs for s in t.steps)
        if self.samples_dir is not None and version not in self._sampled_versions:
            self._sampled_versions.add(version)
            out = self.samples_dir / f"step-{version:06d}.arrow"
            tmp = out.with_suffix(".tmp")
            tmp.write_bytes(encode_trajectories(list(trajs)))
            os.replace(tmp, out)  # readers (teamrl show) never see half a file
