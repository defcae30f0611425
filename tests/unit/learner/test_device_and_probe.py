"""``--device auto`` and the dtype-dependent probe tolerance of the learner service."""

from __future__ import annotations

import pytest
import torch

from teamrl.learner.service import BF16_EPS, build_parser, probe_atol, resolve_device


def test_device_defaults_to_auto_and_auto_follows_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_parser().parse_args([]).device == "auto"
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"


def test_probe_tolerance_follows_the_dtype() -> None:
    assert BF16_EPS == torch.finfo(torch.bfloat16).eps
    assert probe_atol("float32") == 1e-3
    assert probe_atol("bfloat16") == 8 * torch.finfo(torch.bfloat16).eps
