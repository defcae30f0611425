"""Learner checkpoints: every DeepSpeed engine's state, the RNG states and ``engine_state.json``
(docs/architecture.md §7; the failures they cover: docs/reliability.md R-kill-learner and R-torn).

Call sequence (what :meth:`teamrl.learner.engine.LearnerEngine.save_checkpoint` and ``load_checkpoint``
do)::

    save_checkpoint(net, folder, EngineState(...), objective=..., critic_level=...)   # every rank
    state = load_checkpoint(net, folder, objective=...)                              # every rank

Design decisions:

* **What is saved**: every adapter engine's and the critic's DeepSpeed state (LoRA weights, AdamW
  moments, step counts; the frozen base is excluded), per-rank torch/numpy/python RNG states, and
  ``engine_state.json`` (next step, adapter versions, optimiser step counts, the caller's ``extra``).
  A restarted learner that loads it continues bit-for-bit (``tests/unit/learner/test_learner_resume.py``):
  nothing else in a step depends on state (the update order is seeded by the step number).
* **Completion marker**: rank 0 writes ``engine_state.json`` last and atomically, after a barrier, so a
  folder without it is an incomplete checkpoint that :func:`load_checkpoint` refuses.
* **A checkpoint fits one learner**: it is refused for other adapters, and for another objective
  when that would create or drop the critic's state.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from teamrl.learner.distributed import _barrier, _world
from teamrl.learner.errors import LearnerError
from teamrl.learner.model import AdapterModel

__all__ = ["EngineState", "save_checkpoint", "load_checkpoint"]

_CHECKPOINT_FORMAT = 1
_STATE_FILE = "engine_state.json"
_CRITIC_TAG = "critic"


@dataclass(frozen=True)
class EngineState:
    """What a checkpoint says beyond tensors: resume at ``next_step`` with these adapter versions.

    adapter_updates: optimiser steps taken per adapter; extra: the caller's JSON data (``save_checkpoint``).
    """

    next_step: int
    adapter_versions: dict[str, int]
    adapter_updates: dict[str, int]
    extra: dict[str, Any]


def save_checkpoint(
    net: AdapterModel, folder: str | Path, state: EngineState, *, objective: str, critic_level: str | None
) -> None:
    """Every rank: each engine's DeepSpeed checkpoint and this rank's RNG states; rank 0 then writes
    ``engine_state.json`` from ``state`` (``extra`` must be JSON-serialisable)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rank, _ = _world()
    for name, eng in net.engines.items():
        net.trainable(name)  # exclude_frozen_parameters keeps only this adapter's weights
        eng.save_checkpoint(str(folder / "ds"), tag=name, save_latest=False, exclude_frozen_parameters=True)
    net.trainable(None)
    if net.critic is not None:
        net.critic.save_checkpoint(str(folder / "ds"), tag=_CRITIC_TAG, save_latest=False)
    torch.save(
        {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        folder / f"rng_rank{rank}.pt",
    )
    _barrier()  # every rank's files exist before the completion marker does
    if rank == 0:
        raw = {
            "format": _CHECKPOINT_FORMAT,
            "next_step": state.next_step,
            "adapter_versions": dict(state.adapter_versions),
            "adapter_updates": dict(state.adapter_updates),
            "adapters": list(net.adapters),
            "objective": objective,
            "critic_level": critic_level if net.critic is not None else None,
            "extra": dict(state.extra),
        }
        tmp = folder / f".{_STATE_FILE}.tmp"
        tmp.write_text(json.dumps(raw, indent=1, sort_keys=True))
        os.replace(tmp, folder / _STATE_FILE)
    _barrier()


def load_checkpoint(net: AdapterModel, folder: str | Path, *, objective: str) -> EngineState:
    """Every rank: restore what :func:`save_checkpoint` wrote into ``net`` and the RNGs; returns the
    saved :class:`EngineState`. Raises LearnerError if the checkpoint is incomplete or does not fit."""
    folder = Path(folder)
    raw = _read_state(folder, net, objective)
    for name, eng in net.engines.items():
        net.trainable(name)
        path, _ = eng.load_checkpoint(str(folder / "ds"), tag=name, load_module_strict=False)
        if path is None:
            raise LearnerError(f"checkpoint {folder} has no DeepSpeed state for adapter {name!r}")
    net.trainable(None)
    if net.critic is not None:
        path, _ = net.critic.load_checkpoint(str(folder / "ds"), tag=_CRITIC_TAG)
        if path is None:
            raise LearnerError(f"checkpoint {folder} has no DeepSpeed state for the critic")
    rank, _ = _world()
    rng_file = folder / f"rng_rank{rank}.pt"
    if not rng_file.is_file():
        raise LearnerError(f"checkpoint {folder} lacks {rng_file.name}")
    rng = torch.load(rng_file, weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    return EngineState(
        next_step=int(raw["next_step"]),
        adapter_versions={str(k): int(v) for k, v in raw["adapter_versions"].items()},
        adapter_updates={a: int(raw["adapter_updates"].get(a, 0)) for a in net.adapters},
        extra=dict(raw.get("extra") or {}),
    )


def _read_state(folder: Path, net: AdapterModel, objective: str) -> dict[str, Any]:
    """``engine_state.json``, checked against this learner's adapters and critic."""
    state_file = folder / _STATE_FILE
    if not state_file.is_file():
        raise LearnerError(f"checkpoint {folder} is incomplete: {_STATE_FILE} is missing")
    try:
        raw: dict[str, Any] = json.loads(state_file.read_text())
    except json.JSONDecodeError as e:
        raise LearnerError(f"checkpoint {folder}: {_STATE_FILE} is not valid JSON: {e}") from None
    if raw.get("format") != _CHECKPOINT_FORMAT:
        raise LearnerError(
            f"checkpoint {folder} has format {raw.get('format')!r}, expected {_CHECKPOINT_FORMAT}"
        )
    if sorted(raw["adapters"]) != sorted(net.adapters):
        raise LearnerError(
            f"checkpoint {folder} holds adapters {raw['adapters']}, this learner trains {net.adapters}"
        )
    if (raw["critic_level"] is not None) != (net.critic is not None):
        raise LearnerError(
            f"checkpoint {folder} was written with objective {raw['objective']!r}, this learner uses "
            f"{objective!r} (the critic state cannot be created or dropped on resume)"
        )
    return raw
