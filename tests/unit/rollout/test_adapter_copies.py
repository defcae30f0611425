"""A rollout loads its own copy of a shared-folder version, and removes copies no loaded version uses.

Found by the netns topology test in CI: the learner pruned ``run/adapters/v189`` while a lagging
rollout's vLLM re-loaded that version (its LoRA cache had evicted it) from the shared path, and the
engine died. The engine here is a stand-in: the test is about the applier's folders, not vLLM."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from teamrl.protocol.adapters import adapters_sha256
from teamrl.protocol.control import UriWeights
from teamrl.rollout.engine import AdapterRefused
from teamrl.rollout.weights import WeightsApplier


class _Engine:
    """Only what ``prune_folders`` asks of a ``RolloutEngine``: the folders of loaded versions."""

    def __init__(self) -> None:
        self.paths: set[str] = set()

    def paths_in_use(self) -> set[str]:
        return self.paths


class _Msg:
    def __init__(self, version: int, uri: Path, sha: str) -> None:
        self.version, self.location, self.sha256 = version, UriWeights(uri=str(uri)), sha


def _published(root: Path, version: int) -> Path:
    folder = root / f"v{version}"
    for name in ("solver-lora", "verifier-lora"):
        (folder / name).mkdir(parents=True)
        (folder / name / "adapter_config.json").write_text('{"r": 8}')
        (folder / name / "adapter_model.safetensors").write_bytes(bytes([version]) * 64)
    return folder


def test_a_shared_version_is_copied_checked_and_survives_the_learner_pruning_it(tmp_path: Path) -> None:
    engine, recv = _Engine(), tmp_path / "recv"
    recv.mkdir()
    applier = WeightsApplier(engine, None, recv)
    shared = _published(tmp_path / "run" / "adapters", 1)
    sha = adapters_sha256({p.name: p for p in shared.iterdir()})
    folders = applier._checked_folders(_Msg(1, shared, sha))
    assert all(recv in f.parents for f in folders.values()), folders
    shutil.rmtree(shared)  # the learner keeps its last 8 versions
    assert adapters_sha256(folders) == sha  # what vLLM loads (and may reload) is still there

    # a copy whose digest differs is refused and removed, not left behind
    shared2 = _published(tmp_path / "run" / "adapters", 2)
    with pytest.raises(AdapterRefused) as e:
        applier._checked_folders(_Msg(2, shared2, "0" * 64))
    assert e.value.reason == "checksum"
    with pytest.raises(AdapterRefused) as e:
        applier._checked_folders(_Msg(3, tmp_path / "nowhere", sha))
    assert e.value.reason == "missing"
    assert [p.name[:3] for p in recv.iterdir()] == ["v1-"]

    # pruning keeps the folders of loaded versions and whatever else the user keeps there
    engine.paths = {str(f) for f in folders.values()}
    v4 = applier._checked_folders(_Msg(4, shared2, adapters_sha256({p.name: p for p in shared2.iterdir()})))
    (recv / "notes.txt").write_text("mine")
    assert applier.prune_folders() == 1  # v4's copy: nothing loaded it
    assert not any(f.exists() for f in v4.values())
    assert all(f.exists() for f in folders.values()) and (recv / "notes.txt").exists()
    engine.paths = set()
    assert applier.prune_folders() == 1 and [p.name for p in recv.iterdir()] == ["notes.txt"]
