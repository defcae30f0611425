"""A rollout's side of the weights link: follow the learner's announcements and adopt them.

``WeightsApplier`` (owned by ``teamrl.rollout.service.RolloutService``) subscribes to the learner's
weights PUB, heals gaps through its "latest" endpoint, and applies each announcement: fetch the
payload (inline chunks, or a copy of the shared folder), check its sha256, unpack safely, load it
into vLLM as ``<adapter>@v<version>`` and reproduce every probe; only then do new requests use it.
A refusal (checksum, corrupt, missing, load_failed, probe_failed, stale_version, bad_rank,
bad_targets, wrong_base) is logged and counted, and generation goes on with the last good version.
LangMARL profile versions travel on the same sockets and are adopted here too.
docs/architecture.md §8 ("WeightsPublished and the hot-load") describes the checks.

A service with several base models (docs/architecture.md §3, "Rollout services") runs one applier
per base, each on its own engine and its own learner group's endpoint; only the first base's applier
takes profile versions (``profiles=True``), and each tracks whether its learner announced its final
version (``final``) and has answered at all (``answered``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from teamrl.rollout import metrics as M

log = logging.getLogger("teamrl.rollout")

_VERSION_FOLDER = re.compile(r"v\d+-[0-9a-f]{6}")  # what _checked_folders names
LATEST_POLL_S = 5.0  # ask the learner's latest endpoint after this long without an announcement


class WeightsApplier:
    """Adapter versions and profile versions from the learner, checked, loaded and gauged."""

    def __init__(
        self, engine: Any, runner: Any, adapter_root: Path, *, model_id: str = "", profiles: bool = True
    ) -> None:
        self.engine = engine  # RolloutEngine: loads and probes adapter versions
        self.runner = runner  # WorkflowRunner: takes profile versions
        self.adapter_root = adapter_root  # adapters are unpacked or copied under here, then loaded
        self.model_id = model_id  # the base model whose engine this follows (metric label, logs)
        self.profiles = profiles  # adopt LangMARL profile versions from this link
        self.announced_version = 0  # newest version announced, applied or not
        self.profiles_seen = -1  # newest profile version applied or refused
        self.answered = False  # the learner's latest endpoint answered once (or had nothing yet)
        self.final = False  # the last announcement handled was the learner's final version
        self.learner_restarts = 0  # announcements from a new learner process seen (the version budget's)

    async def follow(
        self,
        endpoint: str,
        curve: Any,
        stopping: Callable[[], bool],
        on_version: Callable[[bool], Awaitable[None]],
    ) -> None:
        """Apply the learner's latest versions, then every announcement, until ``stopping()``.

        ``on_version(final)`` runs after the first answer (whether or not the learner had one) and
        after each announcement applied or refused: the service evaluates there. ``final`` is this
        link's flag, also kept in ``self.final``."""
        from teamrl.protocol.errors import PeerTimeout
        from teamrl.protocol.zmq_transport import WeightsSubscriber, latest_endpoint_for

        sub = WeightsSubscriber(endpoint, latest_endpoint_for(endpoint), timeout_ms=1000, curve=curve)
        try:
            try:
                first = await asyncio.to_thread(sub.latest, 1000)
            except PeerTimeout:
                first = None  # no learner yet: serve the base weights (version 0) until one announces
            if first is not None:
                sub.accept(first)
                await self.apply_weights(first)
            # The first evaluation waits for this answer: a restarted rollout evaluates the run's
            # current version (not the base weights it starts with); a fresh run evaluates v0.
            self.answered, self.final = True, first is not None and bool(first.final)
            await on_version(self.final)
            profiles = await self._latest_profiles(sub) if self.profiles else None
            if profiles is not None:
                self.apply_profiles(profiles)
            last_heard = time.monotonic()
            while not stopping():
                msg = await asyncio.to_thread(sub.poll, 200)
                if msg is None and time.monotonic() - last_heard > LATEST_POLL_S:
                    last_heard = time.monotonic()
                    msg = await self._ask_latest(sub)
                profiles = sub.take_profiles() if self.profiles else None
                if profiles is not None:
                    last_heard = time.monotonic()
                    self.apply_profiles(profiles)
                self.learner_restarts = sub.publisher_restarts
                if msg is not None:
                    last_heard = time.monotonic()
                    await self.apply_weights(msg)
                    self.final = bool(getattr(msg, "final", False))
                    await on_version(self.final)
        finally:
            sub.close()

    async def _ask_latest(self, sub: Any) -> Any:
        """PUB is quiet: a restarted learner's first announcements may have been lost while the
        subscription reconnected; ask its latest endpoint directly. Newer profiles are applied
        here; a newer adapter version is returned for the caller to apply (None if none)."""
        from teamrl.protocol.errors import PeerTimeout

        try:
            newest = await asyncio.to_thread(sub.latest, 1000)
        except PeerTimeout:
            newest = None
        lp = await self._latest_profiles(sub) if self.profiles else None
        if lp is not None and lp.version > self.profiles_seen:
            self.apply_profiles(lp)
        if newest is not None:
            sub.accept(newest)  # the next poll counts gaps from it (a restarted learner's too)
        return newest if newest is not None and newest.version > self.engine.version else None

    @staticmethod
    async def _latest_profiles(sub: Any) -> Any:
        from teamrl.protocol.errors import PeerTimeout

        try:
            return await asyncio.to_thread(sub.latest_profiles, 1000)
        except PeerTimeout:
            return None

    async def apply_weights(self, msg: Any) -> bool:
        """Fetch, check, unpack, load and verify one announcement; False (counted) if refused."""
        from teamrl.protocol.adapters import probe_adapter
        from teamrl.rollout.engine import AdapterRefused

        self.announced_version = max(self.announced_version, msg.version)
        try:
            if msg.version <= self.engine.version and self.engine.adapter_versions():
                raise AdapterRefused("stale_version", f"v{msg.version} <= v{self.engine.version} in use")
            self._check_base(msg)
            # hashing (and, inline, unpacking) reads every adapter byte: off the event loop
            folders = await asyncio.to_thread(self._checked_folders, msg)
            res = await self.engine.load_version(
                msg.version,
                folders,
                probe_adapter(msg.adapters),
                msg.probe.prompt_ids,
                msg.probe.completion_ids,
                msg.probe.expected_logprobs,
                msg.probe.atol,
                more_probes=msg.probes,
            )
        except AdapterRefused as e:
            M.ADAPTER_FAILURES.labels(e.reason).inc()
            log.warning(
                "adapter v%d%s refused (%s): %s",
                msg.version,
                f" of {self.model_id}" if self.model_id else "",
                e.reason,
                e,
            )
            self.gauge_versions()
            self.prune_folders()
            return False
        M.ADAPTER_LOADS.inc()
        log.info(
            "adapters v%d live%s (probe error %.2e, base gap %.3f; %d of %d adapters probed)",
            msg.version,
            f" on {self.model_id}" if self.model_id else "",
            res["probe_err"],
            res["base_gap"],
            res.get("probed", 1),
            len(folders),
        )
        self.gauge_versions()
        self.prune_folders()
        return True

    def _check_base(self, msg: Any) -> None:
        """Every announced adapter is one the workflow trains on this link's base model: a learner
        group configured for another workflow or base (docs/teams.md) is
        refused (``wrong_base``), naming the adapter, its agents and both models."""
        from teamrl.rollout.engine import AdapterRefused

        wf = getattr(self.runner, "workflow", None)
        if wf is None or not self.model_id:
            return
        for name in dict.fromkeys(msg.adapters.values()):
            spec = wf.adapters.get(name)
            if spec is None or spec.model != self.model_id:
                agents = [a.id for a in wf.agents if a.adapter == name]
                where = (
                    f"runs on model {spec.model!r} (agents {agents})"
                    if spec
                    else "is not one of its adapters"
                )
                raise AdapterRefused(
                    "wrong_base",
                    f"v{msg.version} on the link of model {self.model_id!r} names adapter {name!r}, which "
                    f"in workflow {wf.name!r} {where}: the learner group and the rollout disagree on "
                    "the workflow",
                )

    def _checked_folders(self, msg: Any) -> Any:
        """The announcement's adapter folders, their sha256 checked; raises ``AdapterRefused``."""
        from teamrl.protocol.adapters import (
            AdapterPayloadError,
            adapter_dirs,
            adapters_sha256,
            copy_adapter_dirs,
            payload_sha256,
            unpack_adapter_payload,
        )
        from teamrl.rollout.engine import AdapterRefused

        if msg.location.kind == "inline":  # the digest is of the tar: checked before unpacking
            payload = b"".join(msg.location.chunks)
            if payload_sha256(payload) != msg.sha256:
                raise AdapterRefused(
                    "checksum", f"v{msg.version}: payload sha256 differs from the announcement"
                )
            dest = self.adapter_root / f"v{msg.version}-{uuid.uuid4().hex[:6]}"
            try:
                return unpack_adapter_payload(payload, dest)
            except AdapterPayloadError as e:
                raise AdapterRefused("corrupt", f"v{msg.version}: {e}") from e
        # A shared folder is the learner's, and it prunes old versions while a lagging rollout may
        # still load one (vLLM reloads an adapter its LoRA cache evicted, from the path it was given):
        # the files are copied here first, and the copy is what is checked and loaded.
        dest = self.adapter_root / f"v{msg.version}-{uuid.uuid4().hex[:6]}"
        try:
            folders = copy_adapter_dirs(adapter_dirs(msg.location.uri), dest)
            digest = adapters_sha256(folders)
        except (AdapterPayloadError, OSError) as e:  # absent, unsafe, or pruned meanwhile
            shutil.rmtree(dest, ignore_errors=True)
            raise AdapterRefused("missing", f"v{msg.version}: {e}") from e
        if digest != msg.sha256:
            shutil.rmtree(dest, ignore_errors=True)
            raise AdapterRefused(
                "checksum", f"v{msg.version}: the adapter files' sha256 differs from the announcement"
            )
        return folders

    def prune_folders(self) -> int:
        """Remove the version folders under ``adapter_root`` that no loaded version uses (unpacked or
        copied here by ``_checked_folders``); returns how many. Other files there are left alone."""
        in_use = {Path(p).parent for p in self.engine.paths_in_use()}
        gone = 0
        for p in self.adapter_root.iterdir() if self.adapter_root.is_dir() else ():
            if p.is_dir() and _VERSION_FOLDER.fullmatch(p.name) and p not in in_use:
                shutil.rmtree(p, ignore_errors=True)
                gone += 1
        return gone

    def gauge_versions(self) -> None:
        for name, v in self.engine.adapter_versions().items():
            M.POLICY_VERSION.labels(name).set(v)
        M.VERSION_LAG.labels(self.model_id).set(max(0, self.announced_version - self.engine.version))

    def apply_profiles(self, msg: Any) -> bool:
        """Adopt a LangMARL profile version (checked sha256, newer, known agents); False (counted) if refused."""
        from teamrl.rewards.profiles import UPDATES_REFUSED, ProfilesRefused, apply_profiles
        from teamrl.rewards.tokenizer import TokenizerError
        from teamrl.rollout.spec import WorkflowError

        self.profiles_seen = max(self.profiles_seen, msg.version)  # a refused version is not retried
        try:
            profiles = apply_profiles(self.runner.workflow.profiles(), msg, self.runner.profile_version)
            self.runner.set_profiles(msg.version, profiles)
        except ProfilesRefused as e:  # counted by apply_profiles
            log.warning("profiles v%d refused (%s): %s", msg.version, e.reason, e)
            return False
        except (WorkflowError, TokenizerError) as e:
            reason = "untokenizable" if isinstance(e, TokenizerError) else "unknown_agent"
            UPDATES_REFUSED.labels(reason=reason).inc()
            log.warning("profiles v%d refused (%s): %s", msg.version, reason, e)
            return False
        log.info("profiles v%d live for %s", msg.version, ", ".join(sorted(msg.profiles)))
        return True
