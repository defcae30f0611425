"""``teamrl model build``: make the embedded default model offline and deterministically.

No pretrained LM weights can be had on these machines (nothing reaches a model hub), so teamrl builds
its own: a Qwen2-architecture causal LM (hidden 128, 2 layers, 2 heads, 1 KV head: head_dim 64, the
smallest vLLM CPU accepts) with a character-level tokenizer over the default task's alphabet
(``teamrl.rewards.addition``). A tiny vocabulary keeps the output layer cheap. A short seeded supervised
warm-start (a fixed number of steps, so the build is repeatable) teaches it the formats and some
addition, leaving headroom for RL to show learning within minutes on 2 CPU cores. Repeatable means on
one machine: two builds here agree, but float reductions differ between CPUs and library builds and
600 steps at lr 3e-3 amplify that (held-out solver accuracy 0.42 on one machine, 0.695 on another;
docs/models.md, "The embedded default model").

The folder holds ``config.json``, ``model.safetensors``, ``tokenizer.json`` + ``tokenizer_config.json``,
``generation_config.json`` and ``teamrl_model.json`` (build parameters and the warm-start accuracy), and is
loaded by vLLM and transformers alike. Any real Hugging Face model folder works through the same config
key (``model.path``).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from teamrl.rewards.addition import EMBEDDED_BUILD_VERSION as BUILD_VERSION
from teamrl.rewards.addition import embedded_model_dir as default_model_dir

DEFAULT_STEPS = 600


def build_tokenizer(out: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from teamrl.rewards.addition import CHARS, EOS, SPECIAL_TOKENS

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": "<pad>",
                "bos_token": "<bos>",
                "model_max_length": 64,
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS, "pad_token": "<pad>", "bos_token": "<bos>"})
    )


ARCHS = ("qwen2", "llama")  # the embedded model's architecture families (llama: `--kind llama`)


def default_llama_model_dir() -> Path:
    """``$TEAMRL_CACHE/models/embedded-llama-v<N>``: the same task and tokenizer on the Llama family."""
    return default_model_dir().with_name(f"embedded-llama-v{BUILD_VERSION}")


def build_llama(
    out: Path | None = None, steps: int = DEFAULT_STEPS, seed: int = 0, force: bool = False
) -> Path:
    """The embedded model's recipe on a Llama-architecture network (docs/teams.md): a
    second base model of another family, to put next to the Qwen2 one in one team."""
    return build(out or default_llama_model_dir(), steps=steps, seed=seed, force=force, arch="llama")


def default_checker_model_dir() -> Path:
    """``$TEAMRL_CACHE/models/embedded-checker-v<N>``: the embedded shape trained for the worked check."""
    return default_model_dir().with_name(f"embedded-checker-v{BUILD_VERSION}")


# The checker's recipe (docs/verifier-learning.md): from scratch at lr 1e-3 (at the build's 3e-3
# this shape does not learn to compare digits at a distance), stopped short of a perfect check so
# that RL has something left to improve.
CHECKER_STEPS = 800
RECIPES = {"verdict": 3e-3, "check": 1e-3}  # recipe -> learning rate


def build_checker(
    out: Path | None = None, steps: int = CHECKER_STEPS, seed: int = 0, force: bool = False
) -> Path:
    """A verifier model of its own (``teamrl model build --kind checker``): the embedded shape and
    tokenizer, trained on solver examples and worked checks (``teamrl.rewards.addition.check_examples``);
    the built-in ``addition-*-checked`` workflows put their verifier on it."""
    return build(out or default_checker_model_dir(), steps=steps, seed=seed, force=force, recipe="check")


def build(
    out: Path | None = None,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    force: bool = False,
    arch: str = "qwen2",
    recipe: str = "verdict",
) -> Path:
    """Build the embedded model into ``out`` (default: the cache folder) and return the folder.

    ``arch``: ``qwen2`` (the default model) or ``llama`` (same sizes, Llama family). ``recipe``:
    ``verdict`` (the embedded model: solver and one-token verdicts) or ``check`` (the checker). Skips
    the work when a complete build with the same parameters is already there.
    """
    if arch not in ARCHS or recipe not in RECIPES:
        raise ValueError(
            f"arch must be one of {ARCHS} and recipe one of {tuple(RECIPES)}: {arch!r}, {recipe!r}"
        )
    out = Path(out) if out else default_model_dir()
    params: dict = {"build_version": BUILD_VERSION, "steps": steps, "seed": seed}
    if arch != "qwen2":  # the default build's params (and so its cache key) stay as they were
        params["arch"] = arch
    if recipe != "verdict":
        params["recipe"] = recipe
    if _built_with(out, params) and not force:
        return out
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    build_tokenizer(tmp)
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp))
    t0 = time.time()
    model = _warm_start(_fresh_model(arch, tok, seed), tok, steps, seed, recipe)
    acc = greedy_accuracy(model, tok, _held_out(), check=recipe == "check")
    model.save_pretrained(str(tmp), safe_serialization=True)
    meta = {
        "params": params,
        "parameters": sum(p.numel() for p in model.parameters()),
        "warmstart_seconds": round(time.time() - t0, 1),
        "held_out_greedy_accuracy": acc,
        "task": "teamrl.rewards.addition",
    }
    (tmp / "teamrl_model.json").write_text(json.dumps(meta, indent=1))
    _replace(out, tmp)
    print(
        f"[model build] wrote {out}: {meta['parameters']:,} parameters, held-out solver accuracy {acc['solver']:.3f}, "
        f"verifier accuracy {acc['verifier']:.3f}",
        flush=True,
    )
    return out


def _built_with(out: Path, params: dict) -> bool:
    """Whether ``out`` holds a complete build made with ``params``."""
    meta_path = out / "teamrl_model.json"
    return meta_path.exists() and json.loads(meta_path.read_text()).get("params") == params


def _held_out() -> list[dict]:
    from teamrl.rewards import addition

    return addition.split_tasks(seed=0)[1]


def _fresh_model(arch: str, tok, seed: int):
    """The embedded shape (hidden 128, 2 layers, 2 heads, 1 KV head), randomly initialised with ``seed``."""
    import torch

    vocab_size = 32  # >= len(vocab); a round size keeps kernels happy
    assert len(tok) <= vocab_size
    config_cls, model_cls = _architecture(arch)
    cfg = config_cls(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    return model_cls(cfg)


def _warm_start(model, tok, steps: int, seed: int, recipe: str = "verdict"):
    """``steps`` seeded supervised steps (AdamW at the recipe's lr, 50 warm-up steps, batches of 128
    from :func:`teamrl.rewards.addition.warmstart_examples`, or ``check_examples`` for the checker,
    over the training tasks); returns it in eval mode."""
    import torch

    from teamrl.rewards import addition

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    train = addition.split_tasks(seed=0)[0]
    rng = random.Random(seed)
    examples = addition.check_examples if recipe == "check" else addition.warmstart_examples
    opt = torch.optim.AdamW(model.parameters(), lr=RECIPES[recipe], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    t0 = time.time()
    model.train()
    for step in range(steps):
        ids, labels = _pack(tok, examples(rng, train, 128), bos=recipe == "check")
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(
                f"[model build] step {step + 1}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)",
                flush=True,
            )
    return model.eval()


def _replace(out: Path, tmp: Path) -> None:
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)


def _architecture(arch: str) -> tuple[type, type]:
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaConfig, LlamaForCausalLM
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2Config, Qwen2ForCausalLM


def _pack(tok, batch: list[tuple[str, str]], bos: bool = False):
    """Right-padded token ids and labels (-100 outside the response) for causal-LM training;
    ``bos``: each prompt starts with BOS, as rollouts encode it (``teamrl.rewards.tokenizer.CharTokenizer``)."""
    import torch

    first = [tok.bos_token_id] if bos else []
    seqs = [(first + tok.encode(p), tok.encode(r)) for p, r in batch]
    width = max(len(p) + len(r) for p, r in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (p, r) in enumerate(seqs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
    return ids, labels


def greedy_accuracy(model, tok, tasks: list[dict], n: int = 200, check: bool = False) -> dict[str, float]:
    """Greedy accuracy of both roles on ``tasks`` (transformers generate; used at build time only);
    the verifier's on candidates right half the time, else off by one; ``check``: in the checker's
    format (the verdict after the worked check)."""
    import torch

    from teamrl.rewards import addition

    tasks = tasks[:n]
    rng = random.Random(1)
    with torch.no_grad():
        solver = [addition.solver_prompt(t) for t in tasks]
        got = _greedy(model, tok, solver, 4, bos=check)
        s_acc = sum(addition.solver_reward(t, g) for t, g in zip(tasks, got, strict=True)) / len(tasks)
        cands = [t["answer"] if rng.random() < 0.5 else f"{(int(t['answer']) + 1) % 200:03d}" for t in tasks]
        prompt = addition.check_prompt if check else addition.verifier_prompt
        prompts = [prompt(t, c) for t, c in zip(tasks, cands, strict=True)]
        got_v = _greedy(model, tok, prompts, 9 if check else 2, bos=check)
        v_acc = sum(
            addition.verifier_reward(t, c, g) for t, c, g in zip(tasks, cands, got_v, strict=True)
        ) / len(tasks)
    return {"solver": round(s_acc, 4), "verifier": round(v_acc, 4)}


def _greedy(model, tok, prompts: list[str], max_new: int, bos: bool = False) -> list[str]:
    import torch

    # Prompts of one role all have the same length, so no padding is needed.
    first = [tok.bos_token_id] if bos else []
    ids = torch.tensor([first + tok.encode(p) for p in prompts])
    for _ in range(max_new):
        nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    width = len(first) + len(tok.encode(prompts[0]))
    return [tok.decode(row[width:].tolist()) for row in ids]
