"""Adapter payloads: deterministic, round-trip, and refuse unsafe or incomplete input."""

from __future__ import annotations

import io
import tarfile

import pytest

from teamrl.protocol.adapters import (
    AdapterPayloadError,
    folder_payload,
    payload_sha256,
    probe_adapter,
    unpack_adapter_payload,
    write_adapter_payload,
)


def _adapter(folder, seed: int):
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(bytes(range(seed, seed + 64)))
    return folder


def test_round_trip_and_determinism(tmp_path):
    a = _adapter(tmp_path / "v1" / "solver-lora", 1)
    b = _adapter(tmp_path / "v1" / "verifier-lora", 2)
    data = write_adapter_payload({"solver-lora": a, "verifier-lora": b})
    assert data == folder_payload(tmp_path / "v1")
    assert payload_sha256(data) == payload_sha256(
        write_adapter_payload({"verifier-lora": b, "solver-lora": a})
    )
    out = unpack_adapter_payload(data, tmp_path / "out")
    assert sorted(out) == ["solver-lora", "verifier-lora"]
    assert (out["solver-lora"] / "adapter_model.safetensors").read_bytes() == bytes(range(1, 65))


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize(
    "members",
    [
        {"../evil/adapter_config.json": b"{}", "../evil/adapter_model.safetensors": b"x"},
        {"a/adapter_config.json": b"{}"},  # incomplete
        {"a/adapter_config.json": b"{}", "a/adapter_model.safetensors": b"x", "a/run.sh": b"rm -rf /"},
    ],
)
def test_unsafe_payloads_refused(tmp_path, members):
    with pytest.raises(AdapterPayloadError) as e:
        unpack_adapter_payload(_tar(members), tmp_path)
    assert e.value.reason == "bad_adapter"
    assert not (tmp_path.parent / "evil").exists()


def test_garbage_and_size_limit(tmp_path):
    with pytest.raises(AdapterPayloadError):
        unpack_adapter_payload(b"not a tar at all" * 100, tmp_path)
    with pytest.raises(AdapterPayloadError):
        unpack_adapter_payload(b"\0" * 2048, tmp_path, max_bytes=1024)
    with pytest.raises(AdapterPayloadError):
        write_adapter_payload({"x": tmp_path / "missing"})


def test_probe_adapter_is_first_entry():
    assert probe_adapter({"solver": "solver-lora", "verifier": "verifier-lora"}) == "solver-lora"


def test_a_shared_folder_is_hashed_in_place_and_checked_like_foreign_input(tmp_path):
    from teamrl.protocol.adapters import adapter_dirs, adapters_sha256

    for name in ("solver-lora", "verifier-lora"):
        d = tmp_path / "v1" / name
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text("{}")
        (d / "adapter_model.safetensors").write_bytes(name.encode() * 10)
    dirs = adapter_dirs(tmp_path / "v1")
    assert list(dirs) == ["solver-lora", "verifier-lora"]
    digest = adapters_sha256(dirs)
    assert digest == adapters_sha256(dict(reversed(dirs.items())))  # order-free, like the tar
    (dirs["solver-lora"] / "adapter_model.safetensors").write_bytes(b"tampered" * 10)
    assert adapters_sha256(dirs) != digest
    with pytest.raises(AdapterPayloadError, match="limit"):
        adapter_dirs(tmp_path / "v1", max_bytes=100)
    link = dirs["verifier-lora"] / "adapter_model.safetensors"
    link.unlink()
    link.symlink_to("/etc/hostname")  # a shared folder is foreign input: no links followed
    with pytest.raises(AdapterPayloadError, match="not a regular file"):
        adapter_dirs(tmp_path / "v1")
    with pytest.raises(AdapterPayloadError, match="does not exist"):
        adapter_dirs(tmp_path / "nowhere")
