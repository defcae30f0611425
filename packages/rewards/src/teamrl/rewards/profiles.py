"""Policy improvement in language space (LangMARL; docs/running.md, "The services"): agent profiles.

A *profile* is an agent's system prompt, the text parameter of its policy. One improvement round
reads replayed graph trajectories with their credits (``AgentStep.reward``) and critiques
(``GraphTrajectory.metadata``), and for each agent asks a judge model to say what in that agent's
behaviour caused the team's successes and failures and to rewrite the agent's whole profile.
Accepted profiles become a new version in a :class:`ProfileStore` and are announced as a
``ProfilesPublished`` message; rollouts pick them up with :func:`apply_profiles`, the way they
pick up adapters on ``WeightsPublished``.

The parts: this module holds what a profile version is, its errors and metrics, and the rollout's
side (:func:`apply_profiles`, which checks a ``ProfilesPublished`` before use);
``teamrl.rewards.profile_store`` the versions of a run on disk (:class:`ProfileStore`);
``teamrl.rewards.profile_answer`` the judge's answer format and its parser;
``teamrl.rewards.profile_learner`` the judge prompt, :class:`ProfileLearner` and one round
(:func:`improve_profiles`).

**Combined with weight training or alone.** :func:`improve_profiles` does one round and knows
nothing of adapters. Alone: the loop samples trajectories from the replay buffer and calls it
every round; rollouts keep fixed weights. Combined: the learner loop calls it every few weight
steps on the batch it trained on; both announcements go out and rollouts apply each on its own.
Rollouts should record the profile version an episode ran with in
``metadata["profile_version"]``, so ``max_staleness`` can leave out episodes of old profiles.

Call sequence::

    store = ProfileStore("/runs/r1/profiles")
    store.init({"planner": "You plan...", "solver": "You solve..."})   # v0, once
    msg = await improve_profiles(trajectories, store, judge)            # judge: async str -> str
    if msg is not None:
        publisher.publish(msg)                 # rollouts: profiles = apply_profiles(profiles, msg)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge

from teamrl.protocol.control import MAX_PROFILE_CHARS, ProfilesPublished
from teamrl.rewards.errors import RewardError

PROFILE_VERSION_KEY = "profile_version"  # trajectory metadata: the profile version it ran with
CRITIQUE_KEY = "critique"
TASK_KEY = "task"
STORE_FORMAT = "teamrl-profiles-v1"
MAX_ID_CHARS = 256  # the protocol's Id bound

PROPOSALS_REJECTED = Counter(
    "teamrl_profile_proposals_rejected",
    "Profile proposals refused (the old profile was kept), by reason.",
    ["reason"],
)
PROPOSALS = Counter(
    "teamrl_profile_proposals",
    "Profile proposals by outcome: accepted, unchanged, rejected, skipped.",
    ["status"],
)
UPDATES_REFUSED = Counter(
    "teamrl_profile_updates_refused",
    "ProfilesPublished messages a rollout refused (apply_profiles), by reason.",
    ["reason"],
)
PROFILE_VERSION = Gauge("teamrl_profile_version", "Latest profile version this process stored or applied.")


class ProfileError(RewardError):
    """Base class of the profile learner's, store's and rollout helper's errors."""


class ProfileStoreError(ProfileError):
    """A version file is missing, corrupt, or already exists; or profiles to store are invalid."""


class ProfileNotFound(ProfileStoreError, KeyError):
    """``ProfileStore.get`` was asked for a version that was never stored."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "profile version not found"


class ProfilesRefused(ProfileError):
    """``apply_profiles`` refused a message: ``reason`` is a metric label, the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ProposalRejected(ProfileError, ValueError):
    """The judge's answer gave no usable profile: ``reason`` is the counter's label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# -- canonical form and the rollout-side helper --------------------------------------------------


def canonical_json(version: int, profiles: Mapping[str, str]) -> bytes:
    """The bytes the sha256 of a profile version is taken over (sorted keys, no spaces, UTF-8)."""
    doc = {"profiles": dict(profiles), "version": int(version)}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def profiles_sha256(version: int, profiles: Mapping[str, str]) -> str:
    """Hex sha256 of :func:`canonical_json` (what ``ProfilesPublished.sha256`` carries)."""
    return hashlib.sha256(canonical_json(version, profiles)).hexdigest()


def apply_profiles(current: Mapping[str, str], msg: Any, have_version: int = -1) -> dict[str, str]:
    """The profile map to use after ``msg``; raises :class:`ProfilesRefused` (counted) instead.

    The message's profiles replace those of the same agents; agents it does not name keep theirs.
    Refused: anything but a ``ProfilesPublished`` (``not_profiles``), a version not newer than
    ``have_version`` (``stale``), a sha256 that does not match the content (``sha_mismatch``).
    """
    try:
        if not isinstance(msg, ProfilesPublished):
            raise ProfilesRefused(
                "not_profiles", f"expected a ProfilesPublished message, got {type(msg).__name__}"
            )
        if msg.version <= have_version:
            raise ProfilesRefused("stale", f"profile version {msg.version} is not newer than {have_version}")
        try:
            actual = profiles_sha256(msg.version, msg.profiles)
        except UnicodeEncodeError as exc:  # a lone surrogate cannot be UTF-8: content is not text
            raise ProfilesRefused(
                "sha_mismatch", f"profile version {msg.version} is not UTF-8 text: {exc}"
            ) from None
        if actual != msg.sha256:
            raise ProfilesRefused(
                "sha_mismatch",
                f"profile version {msg.version}: sha256 of the content is {actual}, the message says {msg.sha256}",
            )
    except ProfilesRefused as exc:
        UPDATES_REFUSED.labels(reason=exc.reason).inc()
        raise
    PROFILE_VERSION.set(msg.version)
    return {**current, **msg.profiles}


@dataclass(frozen=True)
class ProfileVersion:
    """One stored version: the whole profile map and why it was made."""

    version: int
    profiles: dict[str, str]
    sha256: str
    parent: int = -1  # the version it was derived from; -1 for the initial one
    created: float = 0.0  # unix seconds
    notes: dict[str, Any] = field(default_factory=dict)  # {agent: {"status", "reason", "summary"}}

    def message(self) -> ProfilesPublished:
        """The announcement of this version."""
        return ProfilesPublished(version=self.version, profiles=dict(self.profiles), sha256=self.sha256)


def check_profiles(profiles: Any) -> dict[str, str]:
    """``profiles`` as a ``{agent: text}`` dict, or :class:`ProfileStoreError` saying what is wrong."""
    if not isinstance(profiles, Mapping) or not profiles:
        raise ProfileStoreError(
            f"profiles must be a non-empty map agent -> text, got {type(profiles).__name__}"
        )
    out: dict[str, str] = {}
    for agent, text in profiles.items():
        if not isinstance(agent, str) or not 1 <= len(agent) <= MAX_ID_CHARS:
            raise ProfileStoreError(
                f"agent id must be a string of 1..{MAX_ID_CHARS} characters, got {agent!r}"[:300]
            )
        if not isinstance(text, str) or len(text) > MAX_PROFILE_CHARS:
            raise ProfileStoreError(
                f"profile of {agent!r} must be a string of at most {MAX_PROFILE_CHARS} characters, "
                f"got {type(text).__name__} of length {len(text) if isinstance(text, str) else '?'}"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ProfileStoreError(f"profile of {agent!r} is not UTF-8 text (lone surrogate)") from None
        out[agent] = text
    return out
