"""The base models a rollout service serves, at run time: one vLLM engine and one weights applier each.

``Bases`` (owned by ``teamrl.rollout.service.RolloutService``) maps each base model id to its plan
(``ServedBase``: model folder, LoRA settings, the learner weights endpoint it follows, its start
version), its ``RolloutEngine`` and its ``WeightsApplier``, in ``[rollout.models]`` order
(docs/architecture.md §3, "Rollout services"). It starts the engines one after the other, each
on its own share of the cores (:func:`engine_cpu_shares`), closes them together, and answers the
version questions the service asks: the lowest live version over the followed bases, each base's
live version, the bases still below their start version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from teamrl.rollout.weights import WeightsApplier

log = logging.getLogger("teamrl.rollout")


@dataclass(frozen=True)
class ServedBase:
    """One base model the service serves: its engine's settings and the learner link it follows."""

    model_id: str  # the workflow's model id (a key of its [models])
    path: str  # model folder
    max_lora_rank: int
    lora_target_modules: tuple[str, ...]
    weights: str  # learner weights PUB endpoint; "" = not followed (no agent trains on this base)
    start_version: int
    max_model_len: int = 0  # the engine's context (0: the model's max_position_embeddings)


@dataclass
class Base:
    """One base model at run time: its plan, engine and weights applier."""

    plan: ServedBase
    engine: Any  # RolloutEngine
    applier: Any = None  # WeightsApplier, set once the runner exists
    up: bool = False  # engine started


class Bases(dict[str, Base]):
    """``{model_id: Base}`` in ``[rollout.models]`` order (one entry without it)."""

    @classmethod
    def build(
        cls,
        plans: dict[str, ServedBase],
        seed: int,
        keep_versions: int,
        kv_cache_bytes: int,
        dtype: str = "float32",
    ) -> Bases:
        """One engine per planned base (not started yet), seeded with ``seed``, keeping
        ``keep_versions`` adapter versions loaded, with a CPU KV cache of ``kv_cache_bytes``, its
        weights in ``dtype``."""
        from teamrl.rollout.engine import EngineConfig, RolloutEngine

        bases = cls()
        for model_id, plan in plans.items():
            engine = RolloutEngine(
                EngineConfig(
                    model=plan.path,  # one base: set by with_model() (the embedded model when none)
                    seed=seed,
                    max_lora_rank=plan.max_lora_rank,
                    lora_target_modules=plan.lora_target_modules,
                    keep_versions=keep_versions,
                    kv_cache_bytes=kv_cache_bytes,
                    max_model_len=plan.max_model_len,
                    dtype=dtype,
                )
            )
            bases[model_id] = Base(plan, engine)
        return bases

    def attach_appliers(self, runner: Any, adapter_dir: str) -> None:
        """A weights applier per base, unpacking into ``adapter_dir`` (empty: a temp folder; one
        sub-folder per base when there are several). Only the first followed base's applier takes
        profile versions: its learner group runs the profile rounds."""
        root = Path(adapter_dir or tempfile.mkdtemp(prefix="teamrl-adapters-"))
        followed = self.followed()
        first = followed[0] if followed else None
        for b in self.values():
            b.applier = WeightsApplier(
                b.engine,
                runner,
                root if len(self) == 1 else root / b.plan.model_id,
                model_id=b.plan.model_id,
                profiles=b is first,
            )

    def followed(self) -> list[Base]:
        """The bases that follow a learner's weights endpoint."""
        return [b for b in self.values() if b.plan.weights]

    def live_version(self) -> int:
        """The lowest adapter version live over the bases that follow a learner (0: none yet)."""
        return min((b.engine.version for b in self.followed()), default=0)

    def learner_restarts(self) -> int:
        """Announcements from a new learner process seen, over every base's weights link."""
        return sum(b.applier.learner_restarts for b in self.values() if b.applier is not None)

    def live_versions(self) -> tuple[int, ...]:
        """The adapter version live on each base (in order)."""
        return tuple(b.engine.version for b in self.values())

    def behind(self) -> list[ServedBase]:
        """The plans of the bases whose engine is still below their ``start_version``."""
        return [b.plan for b in self.values() if b.engine.version < b.plan.start_version]

    def down(self) -> list[str]:
        """The model ids whose engine is not started."""
        return [m for m, b in self.items() if not b.up]

    def tokens_generated(self) -> int:
        return sum(b.engine.tokens_generated for b in self.values())

    def weights_summary(self) -> str:
        """The endpoints followed, for the start-up log line (``model=endpoint`` with several bases)."""
        return ", ".join(
            f"{m}={b.plan.weights or '(none)'}" if len(self) > 1 else b.plan.weights for m, b in self.items()
        )

    async def start(self) -> None:
        """Start the engines one after the other (start-up and warm-up take most of the time), each
        on its own share of the cores; a failed start closes the engines already up."""
        try:
            for b, share in zip(self.values(), engine_cpu_shares(len(self)), strict=True):
                with _environ(share):  # read when vLLM spawns the engine's process, inside start()
                    await b.engine.start()
                b.up = True
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Close every engine that was started; one failing to close does not keep the others up."""
        for m, b in self.items():
            try:
                await b.engine.close()
            except Exception as e:
                log.warning("closing the engine of %s failed: %s", m, e)
            b.up = False


def engine_cpu_shares(n: int, environ: dict[str, str] | None = None) -> list[dict[str, str]]:
    """Environment additions giving the ``n`` engines of one service disjoint cores.

    With vLLM's automatic binding every engine of a process binds its worker to the same first
    cores, and on the 2-core test machine one of two engines so bound sometimes never finished
    starting (``teamrl.rollout.cpus``). So the cores this service may use (a launcher's
    ``VLLM_CPU_OMP_THREADS_BIND`` list, else its affinity) are split with ``cpus.core_shares``.
    Nothing is added for one engine, for an operator's ``nobind``, or under a CPU quota smaller
    than the cores (the engine then runs its worker unpinned, ``cpus.configure_vllm_cpu_threads``)."""
    from teamrl.rollout.cpus import core_shares, cpu_quota

    env = dict(os.environ) if environ is None else environ
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if n == 1 or bind == "nobind":
        return [{} for _ in range(n)]
    cores = _core_list(bind) if bind and bind not in ("auto", "all") else None
    if cores is None:
        if bind and bind not in ("auto", "all"):  # a form we do not split (e.g. per-rank "a|b")
            return [{} for _ in range(n)]
        allowed = os.sched_getaffinity(0)
        quota = cpu_quota()
        if quota is not None and quota < len(allowed):
            return [{} for _ in range(n)]
        cores = sorted(allowed)
    return core_shares(n, cores, environ={})


def _core_list(bind: str) -> list[int] | None:
    """``"0,2-3"`` -> [0, 2, 3]; None for anything else."""
    out: list[int] = []
    try:
        for part in bind.split(","):
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        return None
    return sorted(set(out)) or None


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    """``os.environ`` with ``extra`` while the block runs, then as it was."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
