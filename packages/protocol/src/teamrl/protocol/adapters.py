"""LoRA adapter payloads: how adapter folders travel from the learner to rollouts.

Design: a payload is an *uncompressed, deterministic* tar of one or more PEFT adapter folders, each
stored under its adapter name (``<name>/adapter_config.json``, ``<name>/adapter_model.safetensors``).
Deterministic (sorted members, zeroed mtimes/uids) so that the same adapter bytes always give the
same sha256, whether the learner ships them inline over ZeroMQ or leaves them on shared storage:
``WeightsPublished.sha256`` is ``payload_sha256(folder_payload(folder))`` in both cases. Uncompressed
on purpose: compression bombs are a known attack on readers, and LoRA weights do not compress.

The unpacking side is hostile-input safe: member names are checked (no absolute paths, no ``..``, no
links or devices), only the two PEFT files are accepted, and the total size is bounded. Anything else
raises :class:`AdapterPayloadError` (a :class:`ProtocolError` with reason ``bad_adapter``).

The probe of a ``WeightsPublished`` refers to the adapter of the first entry of its ``adapters`` map
(:func:`probe_adapter`).
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Mapping
from pathlib import Path

from teamrl.protocol.errors import ProtocolError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
MAX_PAYLOAD_BYTES = 512 * 1024 * 1024


class AdapterPayloadError(ProtocolError):
    """An adapter payload or folder is malformed, incomplete or unsafe to unpack."""

    reason = "bad_adapter"


def _check_name(name: str) -> None:
    if not name or "/" in name or "\\" in name or name in {".", ".."} or name.startswith("."):
        raise AdapterPayloadError(f"adapter name {name!r} is not a plain folder name")


def write_adapter_payload(dirs: Mapping[str, Path | str]) -> bytes:
    """Deterministic tar of adapter folders, ``{adapter_name: folder}``; each folder needs both PEFT files."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(dirs):
            _check_name(name)
            folder = Path(dirs[name])
            for fname in ADAPTER_FILES:
                path = folder / fname
                if not path.is_file():
                    raise AdapterPayloadError(f"adapter {name!r}: {path} is missing")
                data = path.read_bytes()
                info = tarfile.TarInfo(f"{name}/{fname}")
                info.size = len(data)
                info.mtime = 0
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def folder_payload(folder: Path | str) -> bytes:
    """Payload of a published version folder: every subfolder that holds an adapter."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterPayloadError(f"adapter folder {folder} does not exist")
    dirs = {p.name: p for p in sorted(folder.iterdir()) if (p / ADAPTER_FILES[0]).is_file()}
    if not dirs:
        raise AdapterPayloadError(f"{folder} holds no adapter folder")
    return write_adapter_payload(dirs)


def payload_sha256(data: bytes | memoryview) -> str:
    """Hex sha256 of a payload (what ``WeightsPublished.sha256`` carries)."""
    return hashlib.sha256(data).hexdigest()


def unpack_adapter_payload(
    data: bytes, dest: Path | str, max_bytes: int = MAX_PAYLOAD_BYTES
) -> dict[str, Path]:
    """Unpack a payload into ``dest``; returns ``{adapter_name: folder}``. Refuses anything unsafe."""
    if len(data) > max_bytes:
        raise AdapterPayloadError(f"payload of {len(data)} bytes exceeds the limit of {max_bytes}")
    dest = Path(dest)
    found: dict[str, set[str]] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = tar.getmembers()
            total = 0
            for m in members:
                if not m.isfile():
                    raise AdapterPayloadError(f"payload member {m.name!r} is not a regular file")
                parts = m.name.split("/")
                if len(parts) != 2 or parts[1] not in ADAPTER_FILES:
                    raise AdapterPayloadError(f"unexpected payload member {m.name!r}")
                _check_name(parts[0])
                total += m.size
                if total > max_bytes:
                    raise AdapterPayloadError("payload members exceed the size limit")
                found.setdefault(parts[0], set()).add(parts[1])
            for name, files in found.items():
                if files != set(ADAPTER_FILES):
                    raise AdapterPayloadError(f"adapter {name!r} lacks {sorted(set(ADAPTER_FILES) - files)}")
            for m in members:
                src = tar.extractfile(m)
                assert src is not None  # regular files checked above
                out = dest / m.name
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(src.read())
    except tarfile.TarError as e:
        raise AdapterPayloadError(f"payload is not a valid tar: {e}") from e
    if not found:
        raise AdapterPayloadError("payload holds no adapter")
    return {name: dest / name for name in sorted(found)}


def probe_adapter(adapters: Mapping[str, str]) -> str:
    """The adapter name a ``WeightsPublished.probe`` was computed with: the first entry's adapter."""
    if not adapters:
        raise AdapterPayloadError("an announcement with no adapters has no probe adapter")
    return next(iter(adapters.values()))
