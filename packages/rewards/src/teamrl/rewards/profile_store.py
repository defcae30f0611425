"""The profile versions of one run on disk (LangMARL; ``teamrl.rewards.profiles``).

**Versions.** The store writes one JSON file per version (``v00000003.json``), atomically
(temporary file, fsync, hard link that refuses to overwrite, directory fsync), and never deletes
one: the history is the audit trail of every prompt a policy ran with and why it changed
(``notes`` holds each agent's status, reason and the judge's summary). The sha256 of a version is
of the canonical JSON ``{"profiles": ..., "version": ...}`` (sorted keys, no spaces, non-ASCII as
UTF-8 rather than ``\\u`` escapes), so a rollout can check what it received before using it.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from teamrl.rewards.profiles import (
    PROFILE_VERSION,
    STORE_FORMAT,
    ProfileNotFound,
    ProfileStoreError,
    ProfileVersion,
    check_profiles,
    profiles_sha256,
)


class ProfileStore:
    """Profile versions of one run, one JSON file each under ``root``; versions count up from 0.

    ``init(profiles)`` (v0 if empty) -> ``publish(profiles, notes, parent)`` -> ``latest()``,
    ``get(version)``, ``versions()``. One writer per folder is expected; a second writer racing
    for the same version number gets a :class:`ProfileStoreError`, never a silent overwrite.
    """

    _NAME = re.compile(r"^v(\d{8})\.json$")

    def __init__(self, root: str | os.PathLike[str], fsync: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._lock = threading.Lock()

    def path(self, version: int) -> Path:
        return self.root / f"v{version:08d}.json"

    def versions(self) -> list[int]:
        """Stored version numbers, ascending (temporary files of an interrupted write are ignored)."""
        found = []
        for p in self.root.iterdir():
            m = self._NAME.match(p.name)
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    def get(self, version: int) -> ProfileVersion:
        """Read and verify one version; :class:`ProfileNotFound` or :class:`ProfileStoreError`."""
        path = self.path(version)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ProfileNotFound(
                f"profile version {version} not in {self.root} (have {self.versions()})"
            ) from None
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ProfileStoreError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != STORE_FORMAT:
            raise ProfileStoreError(f"{path}: expected a JSON object with format {STORE_FORMAT!r}")
        if doc.get("version") != version:
            raise ProfileStoreError(f"{path}: holds version {doc.get('version')!r}, expected {version}")
        try:
            profiles = check_profiles(doc.get("profiles"))
        except ProfileStoreError as exc:
            raise ProfileStoreError(f"{path}: {exc}") from None
        sha = profiles_sha256(version, profiles)
        if doc.get("sha256") != sha:
            raise ProfileStoreError(
                f"{path}: sha256 of the profiles is {sha}, the file says {doc.get('sha256')!r}"
            )
        parent, created, notes = doc.get("parent", -1), doc.get("created", 0.0), doc.get("notes", {})
        if type(parent) is not int or not isinstance(created, int | float) or not isinstance(notes, dict):
            raise ProfileStoreError(
                f"{path}: 'parent' must be an integer, 'created' a number, 'notes' an object"
            )
        return ProfileVersion(version, profiles, sha, parent=parent, created=float(created), notes=notes)

    def latest(self) -> ProfileVersion | None:
        """The newest version, or None when nothing is stored. A corrupt newest file raises."""
        versions = self.versions()
        return self.get(versions[-1]) if versions else None

    def init(self, profiles: Mapping[str, str]) -> ProfileVersion:
        """Store ``profiles`` as version 0 if the store is empty; otherwise return the latest unchanged."""
        with self._lock:
            latest = self.latest()
            if latest is not None:
                return latest
            return self._write(0, check_profiles(profiles), parent=-1, notes={"initial": True})

    def publish(
        self, profiles: Mapping[str, str], notes: Mapping[str, Any] | None = None, parent: int | None = None
    ) -> ProfileVersion:
        """Store ``profiles`` as the next version (latest + 1) and return it."""
        checked = check_profiles(profiles)
        with self._lock:
            versions = self.versions()
            version = versions[-1] + 1 if versions else 0
            if parent is None:
                parent = versions[-1] if versions else -1
            return self._write(version, checked, parent=parent, notes=dict(notes or {}))

    def _write(
        self, version: int, profiles: dict[str, str], parent: int, notes: dict[str, Any]
    ) -> ProfileVersion:
        pv = ProfileVersion(
            version=version,
            profiles=profiles,
            sha256=profiles_sha256(version, profiles),
            parent=parent,
            created=time.time(),
            notes=notes,
        )
        doc = {
            "format": STORE_FORMAT,
            "version": pv.version,
            "parent": pv.parent,
            "created": pv.created,
            "sha256": pv.sha256,
            "profiles": pv.profiles,
            "notes": pv.notes,
        }
        data = json.dumps(doc, sort_keys=True, indent=1, ensure_ascii=False).encode("utf-8")
        final = self.path(version)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            try:
                os.link(tmp, final)  # atomic and refuses to overwrite: no version is ever replaced
            except FileExistsError:
                raise ProfileStoreError(
                    f"{final} already exists: another writer stored version {version}"
                ) from None
        finally:
            os.unlink(tmp)
        if self.fsync:
            dfd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        PROFILE_VERSION.set(version)
        return pv
