"""``teamrl eval``: the pass@k estimator by hand, and the command on the embedded model with adapters."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from teamrl.cli.evaluate import pass_at_k


def test_pass_at_k_matches_hand_computed_values() -> None:
    assert pass_at_k(8, 0, 1) == 0.0
    assert pass_at_k(8, 8, 8) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(5, 3, 3) == 1.0  # fewer failures than k
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def _random_adapters(model_dir: Path, names: list[str], out: Path) -> None:
    """PEFT adapters ``names`` on ``model_dir`` with random (nonzero) B, saved as ``out/<name>``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora, adapter_name=names[0])
    for name in names[1:]:
        peft.add_adapter(name, lora)
    gen = torch.Generator().manual_seed(0)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft.save_pretrained(out)  # -> out/<name> for each name (none is "default")


def test_eval_refuses_a_temperature_vllm_would_refuse_before_any_engine_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from teamrl.cli.evaluate import build_parser

    for bad in ("3", "-0.5", "hot"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["--workflow", "w", "--temperature", bad])
        assert e.value.code == 2 and "--temperature" in capsys.readouterr().err
    assert build_parser().parse_args(["--workflow", "w", "--temperature", "2"]).temperature == 2.0


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.usefixtures("embedded_model")
def test_eval_command_reports_avg_and_pass_at_k_with_adapters(tmp_path: Path) -> None:
    from teamrl.learner.modelbuild import build

    _random_adapters(build(), ["solver-lora", "verifier-lora"], tmp_path / "v1")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "teamrl.cli.main",
            "eval",
            "--workflow",
            "addition-duo",
            "--adapters",
            str(tmp_path / "v1"),
            "--num-tasks",
            "10",
            "--n",
            "4",
            "--k",
            "1,4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["tasks"] == 10 and out["n"] == 4
    assert 0.0 <= out["pass@1"] <= out["pass@4"] <= 1.0
    assert out["avg@4"] == pytest.approx(out["pass@1"])
    assert set(k for k in out if k.startswith("reward/")) == {"reward/solver", "reward/verifier"}
    assert 0.0 <= out["verifier_balanced_accuracy"] <= 1.0 and 0.0 <= out["verifier_accept_rate"] <= 1.0


def _eval(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "teamrl.cli.main", "eval", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.usefixtures("embedded_model", "embedded_llama_model")
def test_eval_asks_for_one_adapters_folder_per_base_of_a_team_of_several(tmp_path: Path) -> None:
    res = _eval("--workflow", "addition-duo-hetero", "--adapters", str(tmp_path))
    assert res.returncode != 0
    assert "give MODEL_ID=DIR for each" in res.stderr and "embedded-llama" in res.stderr
    res = _eval("--workflow", "addition-duo-hetero", "--adapters", f"nobody={tmp_path / 'x'}")
    assert res.returncode != 0 and "'nobody' is not a trained base model" in res.stderr


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.usefixtures("embedded_model", "embedded_llama_model")
def test_eval_serves_a_team_of_two_base_models_each_with_its_adapters(tmp_path: Path) -> None:
    from teamrl.learner.modelbuild import build, build_llama

    _random_adapters(build(), ["solver-lora"], tmp_path / "qwen")
    _random_adapters(build_llama(), ["verifier-lora"], tmp_path / "llama")
    res = _eval(
        "--workflow",
        "addition-duo-hetero",
        "--adapters",
        f"embedded-v1={tmp_path / 'qwen'}",
        "--adapters",
        f"embedded-llama={tmp_path / 'llama'}",
        *("--num-tasks", "6", "--n", "2", "--k", "1,2"),
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["workflow"] == "addition-duo-hetero" and out["tasks"] == 6 and out["n"] == 2
    assert 0.0 <= out["verifier_balanced_accuracy"] <= 1.0 and "reward/solver" in out


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.usefixtures("embedded_model", "embedded_checker_model")
def test_the_checked_trio_retries_on_a_verifier_that_checks() -> None:
    """addition-trio-checked on base weights (docs/verifier-learning.md): its checker tells right
    from wrong (a constant verdict scores 0.5), so sending rejected answers back pays."""
    res = _eval("--workflow", "addition-trio-checked", "--num-tasks", "30", "--n", "2", "--k", "1,2")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["verifier_balanced_accuracy"] >= 0.75
    assert out["avg@2"] > out["first_try_accuracy"]
