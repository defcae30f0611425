"""embedded-text: deterministic build, an ordinary Hugging Face folder, other families, LoRA targets.

The builds here use a couple of warm-start steps and no accuracy measure (the full build's figures are
in its ``teamrl_model.json`` and docs/models.md); determinism is checked on the tokenizer file and every
weight tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from teamrl.models import text as mbt
from teamrl.rollout.team import lora_targets

STEPS = 2


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return mbt.build_text(out=tmp_path_factory.mktemp("text") / "m", steps=STEPS, seed=0, measure_n=0)


def test_build_is_deterministic_and_cached(built: Path, tmp_path: Path) -> None:
    again = mbt.build_text(out=tmp_path / "again", steps=STEPS, seed=0, measure_n=0)
    assert (built / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert mbt.weights_digest(built) == mbt.weights_digest(again)
    other = mbt.build_text(out=tmp_path / "other", steps=STEPS, seed=1, measure_n=0)
    assert mbt.weights_digest(other) != mbt.weights_digest(built)
    # an identical build is reused, not redone
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    assert mbt.build_text(out=tmp_path / "again", steps=STEPS, seed=0, measure_n=0) == tmp_path / "again"
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp
    meta = json.loads((built / "teamrl_model.json").read_text())
    assert meta["params"] == {
        "kind": "text",
        "build_version": mbt.BUILD_VERSION,
        "steps": STEPS,
        "seed": 0,
        "workflows": mbt.workflows_fingerprint(),
    }


def test_default_dir_follows_teamrl_cache(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TEAMRL_CACHE", str(tmp_path))
    assert mbt.default_text_model_dir() == tmp_path / "models" / f"embedded-text-v{mbt.BUILD_VERSION}"


def test_folder_loads_in_transformers_and_renders_the_chat_template(built: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from teamrl.rewards.tokenizer import HFTokenizer, tokenizer_for
    from teamrl.rollout.workflows import load, load_tasks

    for f in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (built / f).is_file(), f
    tok = AutoTokenizer.from_pretrained(str(built))
    assert tok.eos_token == mbt.EOS and tok.pad_token == mbt.PAD
    assert 1000 <= len(tok) <= mbt.VOCAB_SIZE
    wf = load("math-trio")
    task = load_tasks("math-word-held-out")[0]
    solver = wf.agent("solver")
    msgs = [
        {"role": "system", "content": solver.profile},
        {"role": "user", "content": f"Problem: {task['question']}"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"<|im_start|>system\n{solver.profile}<|im_end|>\n"
        f"<|im_start|>user\nProblem: {task['question']}<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level BPE: lossless
    assert tok.encode("123", add_special_tokens=False) == [tok.convert_tokens_to_ids(c) for c in "123"]
    # the rollout reads the folder with its HF tokenizer and the chat template
    rt = tokenizer_for(built)
    assert isinstance(rt, HFTokenizer) and rt.has_chat_template and rt.eos_token_id == tok.eos_token_id
    assert rt.chat(msgs) == ids
    model = AutoModelForCausalLM.from_pretrained(str(built))
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert cfg.hidden_size // cfg.num_attention_heads == 64 and cfg.vocab_size >= len(tok)
    assert cfg.eos_token_id == tok.eos_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)
    assert out.shape[1] <= len(ids) + 3
    assert lora_targets(built) == ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_build_random_other_family(built: Path, tmp_path: Path, family: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = mbt.build_random(tmp_path / family, family=family, tokenizer_from=built)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]]
    assert cfg["head_dim"] == 64
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    ids = tok.apply_chat_template([{"role": "user", "content": "Problem: 2 + 3"}], add_generation_prompt=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    with torch.no_grad():
        assert model(torch.tensor([list(ids)])).logits.shape[-1] == cfg["vocab_size"]
    assert lora_targets(out) == ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_lora_targets_of_an_unlisted_architecture_come_from_its_modules(built: Path, tmp_path: Path) -> None:
    out = mbt.build_random(tmp_path / "m", family="llama", tokenizer_from=built, hidden_size=64, num_layers=1)
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = ["SomeNewForCausalLM"]  # not in LORA_TARGETS: read the module tree instead
    (out / "config.json").write_text(json.dumps(cfg))
    assert lora_targets(out) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    with pytest.raises(ValueError, match="unknown family"):
        mbt.build_random(tmp_path / "x", family="gpt2")


def test_cli_model_path_and_kind(monkeypatch, tmp_path: Path, capsys) -> None:
    from teamrl.cli.main import main

    monkeypatch.setenv("TEAMRL_CACHE", str(tmp_path))
    assert main(["model", "path", "--kind", "text"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / f"embedded-text-v{mbt.BUILD_VERSION}")
    assert main(["model", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / "embedded-v1")
    assert main(["model", "build", "--kind", "text", "--steps", "0"]) == 2


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_the_text_model(built: Path) -> None:
    import asyncio

    from teamrl.rewards.tokenizer import tokenizer_for
    from teamrl.rollout.engine import EngineConfig, RolloutEngine, Sampling
    from teamrl.rollout.workflows import load, load_tasks

    tok = tokenizer_for(built)
    wf = load("math-duo")
    planner = wf.agent("planner")
    task = load_tasks("math-word-held-out")[0]
    prompt = tok.chat(
        [
            {"role": "system", "content": planner.profile},
            {"role": "user", "content": f"Problem: {task['question']}"},
        ]
    )

    async def main():
        eng = RolloutEngine(EngineConfig(model=str(built), dtype="float32", max_model_len=1024))
        await eng.start()
        try:
            return await eng.generate(prompt, Sampling(max_tokens=8, temperature=0.0))
        finally:
            await eng.close()

    gen = asyncio.run(main())
    assert 1 <= len(gen.token_ids) <= 8 and len(gen.logprobs) == len(gen.token_ids)
    assert gen.text == tok.decode(gen.token_ids)
