"""LoRA adapter payloads: how adapter folders travel from the learner to rollouts.

A published version is a folder of PEFT adapter folders, one per adapter name
(``<name>/adapter_config.json``, ``<name>/adapter_model.safetensors``). ``WeightsPublished.sha256``
is the digest of the bytes as they travel. On shared storage (``UriWeights``, the normal case) that
is :func:`adapters_sha256` of the files, read straight from disk: the rollout copies the files
(:func:`copy_adapter_dirs`), checks the digest over its copy and loads the copy, with no archive
(the learner prunes its folder while a lagging rollout may still need a version). Inline over
ZeroMQ (``InlineWeights``, small adapters) the folders travel as an *uncompressed, deterministic*
tar (sorted members, zeroed mtimes/uids) and the digest is :func:`payload_sha256` of the tar,
checked before it is unpacked. Uncompressed on purpose: compression bombs are a known attack on
readers, and LoRA weights do not compress.

Both readers treat the input as hostile (docs/reliability.md): :func:`adapter_dirs` refuses links,
unsafe names, missing files and oversize folders; :func:`unpack_adapter_payload` checks member
names (no absolute paths, no ``..``, no links or devices), accepts only the two PEFT files and
bounds the total size. Anything else raises :class:`AdapterPayloadError` (a
:class:`ProtocolError` with reason ``bad_adapter``).

The probe of a ``WeightsPublished`` refers to the adapter of the first entry of its ``adapters`` map
(:func:`probe_adapter`).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
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
    return write_adapter_payload(adapter_dirs(folder))


def payload_sha256(data: bytes | memoryview) -> str:
    """Hex sha256 of a tar payload's bytes (what an inline ``WeightsPublished.sha256`` carries)."""
    return hashlib.sha256(data).hexdigest()


def adapter_dirs(folder: Path | str, max_bytes: int = MAX_PAYLOAD_BYTES) -> dict[str, Path]:
    """The adapter folders of a published version folder, checked: ``{name: folder}``.

    Every subfolder holding an ``adapter_config.json`` is an adapter; each must hold both PEFT
    files as regular files (no links: a shared folder is foreign input), under a plain name, and
    all of them together at most ``max_bytes``."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        raise AdapterPayloadError(f"adapter folder {folder} does not exist")
    dirs = {p.name: p for p in sorted(folder.iterdir()) if (p / ADAPTER_FILES[0]).exists()}
    if not dirs:
        raise AdapterPayloadError(f"{folder} holds no adapter folder")
    total = 0
    for name, d in dirs.items():
        _check_name(name)
        for fname in ADAPTER_FILES:
            path = d / fname
            if d.is_symlink() or path.is_symlink() or not path.is_file():
                raise AdapterPayloadError(f"adapter {name!r}: {path} is missing or not a regular file")
            total += path.stat().st_size
    if total > max_bytes:
        raise AdapterPayloadError(
            f"adapters in {folder} hold {total} bytes, more than the limit of {max_bytes}"
        )
    return dirs


def copy_adapter_dirs(dirs: Mapping[str, Path | str], dest: Path | str) -> dict[str, Path]:
    """Copy checked adapter folders (``adapter_dirs``) into ``dest``, the PEFT files only:
    ``{name: copy}``. A reader that checks and loads the copy is safe from the source changing
    or being removed meanwhile."""
    dest = Path(dest)
    out = {}
    for name, d in dirs.items():
        _check_name(name)
        (dest / name).mkdir(parents=True)
        for fname in ADAPTER_FILES:
            shutil.copyfile(Path(d) / fname, dest / name / fname)
        out[name] = dest / name
    return out


def adapters_sha256(dirs: Mapping[str, Path | str]) -> str:
    """Hex sha256 of adapter folders' files (what a shared-folder ``WeightsPublished.sha256`` carries): for each
    adapter name in order, each PEFT file's name, size and bytes, read once from disk."""
    h = hashlib.sha256()
    for name in sorted(dirs):
        for fname in ADAPTER_FILES:
            path = Path(dirs[name]) / fname
            with path.open("rb") as f:
                h.update(f"{name}/{fname}:{os.fstat(f.fileno()).st_size}\n".encode())
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()


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
