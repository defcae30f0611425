"""What a peer claims, checked before the replay buffer changes anything: a frame's step versions and
ids, a sample request's hint, view and rank (docs/security.md). Each check raises the typed refusal
the buffer counts (``buffer_errors``); none changes state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from teamrl.learner.buffer_errors import ViewLimit
from teamrl.learner.buffer_ids import KnownIds
from teamrl.learner.buffer_versions import PolicyVersions
from teamrl.learner.buffer_views import check_agent_ids, view_agents, view_name
from teamrl.protocol.codec import TrajectoryRow

MAX_RANKS = 4096  # data-parallel ranks per view: rank rounds are kept per (view, rank)
MAX_VIEWS = 256  # views (agent sets) with rank rounds: both maps are keyed by request data


@dataclass
class Request:
    """What a sample request asks, as ``ReplayBuffer.sample`` got it."""

    rank: int
    agent_id: str | None
    agent_ids: Iterable[str] | None
    model_id: str | None
    min_policy_version: int


def check_frame(
    rows: list[TrajectoryRow],
    models: list[dict[str, tuple[int, int]]],
    versions: PolicyVersions,
    ids: KnownIds,
) -> None:
    """Raise ``VersionOutOfRange`` (a step above ``versions.ceiling()``), ``VersionUnpublished``
    (above its base's announced version), ``InvalidAgentId`` (an agent id no control message or view
    name can carry) or ``UnknownId`` (an id the plan does not name). ``models``: each row's
    ``versions_per_model()``."""
    versions.check(max((r.versions(-1)[1] for r in rows), default=-1), "policy version")
    versions.check_claims(models)
    agents = {a for r in rows for a in r.steps_per_agent()}
    check_agent_ids(agents)
    ids.check({m for per_model in models for m in per_model}, agents)


def check_request(
    req: Request,
    trusted: bool,
    versions: PolicyVersions,
    ids: KnownIds,
    rounds: Mapping[str, object],
) -> str:
    """The request's view name, or raise: a malformed agent list, or one view or rank too many
    (``InvalidView``); a hint above the version window or the announced version
    (``VersionOutOfRange``; only with ``from_data`` does a ``trusted`` learner skip the window); an id
    the plan does not name (``UnknownId``). ``rounds``: the views that have rank rounds now."""
    view = view_name(req.agent_id, req.agent_ids)
    if req.rank >= MAX_RANKS or (view not in rounds and len(rounds) >= MAX_VIEWS):
        raise ViewLimit(f"rank {req.rank} of view {view!r}: at most {MAX_RANKS} ranks and {MAX_VIEWS} views")
    if not (trusted and versions.from_data):
        versions.check(req.min_policy_version, "min_policy_version")
    versions.check_hint(req.model_id, req.min_policy_version)
    ids.check([] if req.model_id is None else [req.model_id], view_agents(view))
    return view
