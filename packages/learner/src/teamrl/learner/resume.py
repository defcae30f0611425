"""A learner's checkpoints in its run folder: save every few steps, resume from the newest.

``RunCheckpoints`` (owned by ``teamrl.learner.service.LearnerService``) keeps
``RUN/checkpoints/step-N``: every rank saves its engine state there (``LearnerEngine.save_checkpoint``,
``teamrl.learner.checkpoint``), then rank 0 writes ``state.json`` (step, version) and the ``DONE``
marker, and only then does the folder count; older complete ones are pruned. A restarted learner
resumes from the newest folder with a marker (or, killed before its first, from the initial
adapters), and its version never goes backwards: versions published after that checkpoint (before a
kill) are skipped, never issued again with other weights.
docs/architecture.md §7 ("Learners") and docs/reliability.md R-kill-learner and R-torn describe the guarantees.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from teamrl.learner import metrics as M

log = logging.getLogger("teamrl.learner")

DONE = "DONE"


class RunCheckpoints:
    """The checkpoints of one learner rank under ``run_dir / "checkpoints"``."""

    def __init__(self, run_dir: Path, engine: Any, *, rank: int, world: int, keep: int) -> None:
        self.run_dir = run_dir
        self.root = run_dir / "checkpoints"
        self.engine = engine  # LearnerEngine: saves and loads every rank's own state
        self.rank, self.world = rank, world
        self.keep = keep  # complete checkpoints kept on disk

    def folder(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def complete(self) -> list[Path]:
        """The checkpoints with a ``DONE`` marker, oldest first."""
        if not self.root.is_dir():
            return []
        done = [p for p in self.root.iterdir() if p.name.startswith("step-") and (p / DONE).is_file()]
        return sorted(done, key=lambda p: int(p.name.split("-")[1]))

    def is_complete(self, step: int) -> bool:
        return (self.folder(step) / DONE).exists()

    def resume(self, first_adapter: str) -> tuple[int, int] | None:
        """Load the newest complete checkpoint; its (step, version), or None for a fresh run.

        Versions never go back and are never issued twice with different weights: when versions
        were exported (a folder ``adapters/vV`` holding ``first_adapter``) after the checkpoint, or
        with no checkpoint at all (a learner killed before its first), the weights it resumes with
        become a new version above the highest exported. Rollouts drop announcements older than what
        they hold, so a resumed learner that announced a lower version would never be taken up and
        their version budget would never refill (docs/reliability.md R-kill-learner)."""
        ckpts = self.complete()
        step, version = 0, 0
        if ckpts:
            last = ckpts[-1]
            state = json.loads((last / "state.json").read_text())
            self.engine.load_checkpoint(last)
            step, version = int(state["step"]), int(state["version"])
        exported = self.exported_versions(first_adapter)
        if self.world > 1:  # every rank has read the folder before rank 0 exports the resumed version
            import torch.distributed as dist

            dist.barrier()
        if not ckpts and not exported:
            return None
        where = f"resumed from {ckpts[-1]}" if ckpts else "no checkpoint, resumed from the initial adapters"
        highest = max([version, *exported])
        if highest > version:  # versions after the checkpoint were lost with the process
            log.warning(
                "%s: step %d; version(s) %d..%d were published after it and are lost: "
                "the weights resumed with are published as version %d",
                where,
                step,
                version + 1,
                highest,
                highest + 1,
            )
            version = highest + 1
        else:
            log.info("%s: step %d, version %d", where, step, version)
        M.VERSION.set(version)
        return step, version

    def exported_versions(self, first_adapter: str) -> list[int]:
        """The versions exported to ``RUN/adapters/vV`` (that hold ``first_adapter``)."""
        return [
            int(p.name[1:])
            for p in (self.run_dir / "adapters").glob("v*")
            if p.name[1:].isdigit() and (p / first_adapter).is_dir()
        ]

    def save(self, step: int, version: int) -> None:
        """Every rank saves its state; rank 0 then marks the folder complete and prunes old ones."""
        import torch.distributed as dist

        folder = self.folder(step)
        if self.rank == 0 and folder.exists():
            shutil.rmtree(folder)
        if self.world > 1:
            dist.barrier()
        folder.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(folder)
        if self.world > 1:
            dist.barrier()
        if self.rank == 0:
            (folder / "state.json").write_text(json.dumps({"step": step, "version": version}))
            (folder / DONE).write_text("")  # only now does the checkpoint count
            M.CHECKPOINTS.inc()
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
            log.info("checkpoint %s", folder)
