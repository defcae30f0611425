"""Random-initialised model folders of other architecture families (Llama, Qwen3, Qwen2).

:func:`build_random` writes a folder vLLM and transformers load, with noise for weights, for
end-to-end tests on an architecture family other than the embedded models'; the tokenizer is copied
from another folder or trained here (``teamrl.models.bpe``). :func:`save_model` writes a model
folder's weights and generation config (the embedded-text build uses it too).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from teamrl.models.bpe import BOS, EOS, MAX_POSITIONS, PAD, SPECIAL_TOKENS, save_tokenizer, train_tokenizer
from teamrl.models.demonstrations import tokenizer_corpus

FAMILIES = ("llama", "qwen3", "qwen2")


def build_random(
    out: Path | str,
    family: str = "llama",
    seed: int = 0,
    tokenizer_from: Path | str | None = None,
    hidden_size: int = 128,
    num_layers: int = 2,
) -> Path:
    """A random-initialised model folder of ``family`` (Llama, Qwen3 or Qwen2 config; head_dim 64).

    The tokenizer is copied from ``tokenizer_from`` (a folder with ``tokenizer.json``, e.g. the
    embedded-text model) or, when not given, a small byte-level BPE trained here on the text
    workflows' prompts. For end-to-end tests on an architecture vLLM CPU supports; the weights are
    noise, so the model writes noise.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {list(FAMILIES)})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab, ids = _random_tokenizer(out, seed, tokenizer_from)
    heads = hidden_size // 64
    common = {
        "vocab_size": (vocab + 63) // 64 * 64,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": True,
        "bos_token_id": ids.get(BOS),
        "eos_token_id": ids.get(EOS),
        "pad_token_id": ids.get(PAD),
        "rope_theta": 10000.0,
    }
    model = _family_model(family, seed, common)
    save_model(model, out, {"eos_token_id": ids.get(EOS), "pad_token_id": ids.get(PAD)})
    return out


def save_model(model: Any, folder: Path, generation_config: dict[str, Any]) -> None:
    """The model in eval mode, its weights (safetensors) and ``generation_config.json`` in ``folder``."""
    model.eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps(generation_config, indent=1))


def _random_tokenizer(
    out: Path, seed: int, tokenizer_from: Path | str | None
) -> tuple[int, dict[str, int | None]]:
    """The tokenizer files in ``out`` (copied from ``tokenizer_from``, else a small BPE trained
    here): its vocabulary size and the ids of the special tokens."""
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if Path(tokenizer_from, f).is_file():
                shutil.copy(Path(tokenizer_from, f), out / f)
    else:
        save_tokenizer(train_tokenizer(tokenizer_corpus(seed), vocab_size=1024), out)
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(out / "tokenizer.json"))
    return tk.get_vocab_size(), {t: tk.token_to_id(t) for t in SPECIAL_TOKENS}


def _family_model(family: str, seed: int, common: dict[str, Any]) -> Any:
    """A seeded random model of ``family`` with the ``common`` config (head_dim 64)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(head_dim=64, **common))
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(head_dim=64, **common))
