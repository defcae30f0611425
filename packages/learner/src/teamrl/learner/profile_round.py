"""LangMARL in the learner loop: agent profiles improved in language space, beside (or instead of) weights.

Every ``interval`` learner steps, rank 0 runs one :func:`teamrl.rewards.profile_learner.improve_profiles`
round on the trajectories it just trained on: a judge model reads each agent's best and worst
episodes with their credits and critiques and rewrites that agent's profile (system prompt). An
accepted version is stored under ``<run-dir>/profiles`` (one JSON file per version, never deleted)
and announced on the learner's weights socket (topic ``profiles``); rollouts check its sha256, swap
their workflow's profiles for new episodes and record ``metadata["profile_version"]`` in each
trajectory. ``[learner] profile_interval = 0`` (the default) turns this off; ``lr = 0`` trains
profiles alone (the weights then never change).

The judge is the learner's base model with its adapters disabled, sampled through
:meth:`LearnerEngine.sample` and the model folder's tokenizer (``judge_from_engine``), or any
``str -> str`` callable passed in. On the embedded model (a character vocabulary of digits and
``+=;?SVR``) the judge cannot read the English prompt: each round is refused with
``judge_error`` and counted (``teamrl_profile_proposals_rejected_total``), the profiles stay as they
are, and training goes on. A real instruction-tuned model folder is what this is for.

Call sequence (what ``LearnerService`` does)::

    rounds = ProfileRound.from_config(cfg, engine, model_folder, run_dir / "profiles")
    msg = rounds.maybe_run(step, trajectories)        # after the weight step
    if msg is not None:
        publisher.publish_profiles(msg)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from teamrl.learner.rows import Samples, trajectory_objects
from teamrl.protocol.control import ProfilesPublished

log = logging.getLogger("teamrl.learner.profiles")


def judge_from_engine(
    engine: Any,
    model_folder: str | Path,
    max_new_tokens: int,
    seed: int = 0,
    *,
    temperature: float | None = None,
    prefill: bool = False,
) -> Callable:
    """A ``str -> str`` judge: the learner's base model (adapters disabled), sampled at ``temperature``
    (None: the engine's, 1).

    ``prefill``: the answer is begun with ``<profile>`` (the format's block, in the chat's assistant
    turn), so the model writes only the revised profile; an answer that ends at the model's end of
    text without ``</profile>`` is closed there. A small judge seldom writes the whole tagged format
    by itself: SmolLM2-135M wrote no complete block in any of its first 4 proposals at temperature 1
    (docs/real-model.md). The summary, optional in the format, is then absent."""
    import torch

    from teamrl.rewards.profile_answer import PREFILL
    from teamrl.rewards.tokenizer import tokenizer_for

    tok = tokenizer_for(model_folder)
    gen = torch.Generator().manual_seed(seed)
    eos = tok.eos_token_id if tok.eos_token_id is not None else -1

    def judge(prompt: str) -> str:
        chat = tok.chat([{"role": "user", "content": prompt}])
        ids = chat or tok.encode(prompt)
        head = PREFILL if prefill and chat else ""
        if head:
            ids = [*ids, *tok.encode(head, add_special=False)]
        ((out, _logps),) = engine.sample(None, [ids], max_new_tokens, eos, gen, temperature)
        answer = head + tok.decode(out)
        if head and out and out[-1] == eos and "</profile>" not in answer.lower():
            answer += "\n</profile>"
        return answer

    return judge


class NoStartingProfiles(RuntimeError):
    """A profile round found no stored version and was given no starting profiles."""


class ProfileRound:
    """Runs one profile-improvement round every ``interval`` steps; never raises into the learner."""

    def __init__(
        self,
        store_dir: Path,
        judge: Callable[[str], Any],
        interval: int,
        *,
        workflow: str = "",
        initial: Mapping[str, str] | None = None,
        max_staleness: int | None = 2,
        fsync: bool = True,
        min_length_ratio: float = 0.0,
    ) -> None:
        from teamrl.rewards.profile_store import ProfileStore

        if interval < 1:
            raise ValueError(f"profile interval must be >= 1, got {interval}")
        self.store = ProfileStore(store_dir, fsync=fsync)
        self.judge = judge
        self.interval = interval
        self.workflow = workflow
        self.initial = dict(initial or {})  # the workflow's own profiles: version 0 of the store
        self.max_staleness = max_staleness
        self.min_length_ratio = min_length_ratio  # ProfileLearner's: shorter proposals are too_short
        self.rounds = 0
        self.published = 0
        self.failures = 0

    @classmethod
    def from_config(cls, cfg: Any, engine: Any, model_folder: str | Path, store_dir: Path) -> ProfileRound:
        """The rounds a ``LearnerConfig`` asks for (its ``profile_*`` fields), judged by ``engine``'s
        base model (:func:`judge_from_engine`)."""
        judge = judge_from_engine(
            engine,
            model_folder,
            cfg.profile_max_new_tokens,
            cfg.seed,
            temperature=cfg.profile_temperature,
            prefill=cfg.profile_prefill,
        )
        return cls(
            store_dir,
            judge,
            cfg.profile_interval,
            initial=cfg.profiles,
            max_staleness=cfg.profile_max_staleness,
            min_length_ratio=cfg.profile_min_length_ratio,
        )

    def latest(self) -> ProfilesPublished | None:
        """The newest stored version's announcement (re-announced after a learner restart)."""
        v = self.store.latest()
        return v.message() if v is not None else None

    def maybe_run(self, step: int, sample: Samples) -> ProfilesPublished | None:
        """After learner step ``step`` (1-based count of steps done): a new version, or None.

        ``sample``: the step's ``TrajectoryBatch`` es (or trajectories); the judge reads text, so the
        Python trajectories are built here, only on the steps a round runs."""
        if step % self.interval or not sample:
            return None
        from teamrl.rewards.profile_learner import ProfileLearner, improve_profiles

        trajectories = trajectory_objects(sample)

        self.rounds += 1
        try:
            initial = None
            if self.store.latest() is None:
                if not self.initial:
                    raise NoStartingProfiles(
                        f"no starting profiles for workflow {self.workflow or trajectories[0].workflow!r}: "
                        "set [learner] profiles (teamrl run fills them from the workflow)"
                    )
                initial = self.initial
            msg = asyncio.run(
                improve_profiles(
                    trajectories,
                    self.store,
                    None,
                    learner=ProfileLearner(self.judge, min_length_ratio=self.min_length_ratio),
                    initial=initial,
                    max_staleness=self.max_staleness,
                )
            )
        # The fault boundary of the language learner: a failing round keeps the profiles and the
        # weight training goes on; it is logged and counted here (the judge's own failures are
        # counted by reason in teamrl_profile_proposals_rejected_total).
        except Exception as exc:
            self.failures += 1
            log.warning("profile round at step %d failed: %s: %s", step, type(exc).__name__, exc)
            return None
        if msg is not None:
            self.published += 1
            log.info(
                "profiles v%d stored and announced (agents %s)", msg.version, ", ".join(sorted(msg.profiles))
            )
        return msg
