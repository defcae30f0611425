"""``teamrl model build --kind text``: a small text model that can read the text workflows, built offline.

The embedded character model (``teamrl.learner.modelbuild``) spells only the addition task. This
module builds ``embedded-text``, a second model whose tokenizer reads any text, so that math-duo,
math-trio, code-reflect and search-qa can run on a machine without a model hub. It is a *small*
model for running those workflows offline and for tests; real use is ``--model`` with a Hugging Face
model folder (docs/workflows.md: ``--model``, held-out split, LoRA targets).

What the build does (deterministic for a given ``seed`` and ``steps`` on one machine):

1. **Tokenizer** (``teamrl.models.bpe``). A byte-level BPE (``tokenizers``) trained on text
   generated here: the built-in text workflows' prompts and demonstrations (below), the bundled
   search corpus and HumanEval sample, and arithmetic lines. Digits are split one per token. Special
   tokens ``<|endoftext|>`` (padding), ``<|im_start|>``, ``<|im_end|>`` (end of a turn: the EOS) and
   a ChatML chat template, so the rollout renders ``[system: profile] + [user: text]`` through
   ``apply_chat_template``.
2. **Demonstrations, rendered by the rollout itself** (``teamrl.models.demonstrations``). Each
   built-in text workflow is run by ``teamrl.rollout.executor.run_episode`` against a scripted
   backend that writes the reference responses (planner: a numbered plan; solver: one ``a op b = c``
   line per step and ``Answer: N``; verifier: the recomputation and ``VERDICT: correct`` /
   ``VERDICT: wrong``, with wrong solver attempts made on purpose; coder/reviewer on the bundled
   HumanEval sample; searcher: a real BM25 call and the sentence that answers; answerer: the short
   answer). The prompt token ids are the ones the rollout builds (chat template, profiles as system
   prompts, templates, parents, tool results), so training sees exactly what sampling will see. The
   math problems are the training split of ``teamrl.rollout.workflows.wordproblems`` (task set
   ``math-word``).
3. **Warm start.** A Qwen2 causal LM (hidden 256, 2 layers, 4 heads of 64, 2 KV heads: vLLM CPU needs
   head_dim 64; bfloat16 autocast) trained from a seeded initialisation for a fixed number of steps on those
   demonstrations plus arithmetic drill lines (``a op b = c``, loss on the results only), with the
   loss on response tokens only. The step count is chosen to leave the model partly right, so that
   RL has room to improve it.
4. **Measure** (``teamrl.models.measure``). Greedy episodes of math-trio and math-duo on the
   held-out split (``math-word-held-out``) with transformers: team accuracy, the first solver's
   accuracy, the verifier's verdict accuracy and its accuracy on balanced right/wrong cases;
   search-qa F1 and code-reflect pass rate on their (small, seen) task sets. Written to
   ``teamrl_model.json``.

The folder is an ordinary Hugging Face folder (``config.json``, ``generation_config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``)
that vLLM and transformers load; ``teamrl.rewards.tokenizer.tokenizer_for`` reads it with
``HFTokenizer``.

Step 3 and the build itself (:func:`build_text`) are here.
:func:`teamrl.models.families.build_random` (a random-initialised Llama-, Qwen3- or Qwen2-style
folder with a BPE tokenizer, for end-to-end tests on another architecture family) is re-exported
here, with the tokenizer's names, for the callers of this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from teamrl.models.bpe import BOS, EOS, MAX_POSITIONS, PAD, VOCAB_SIZE, save_tokenizer, train_tokenizer
from teamrl.models.demonstrations import (
    Example,
    demonstrations,
    drill_lines,
    tokenizer_corpus,
    workflows_fingerprint,
)
from teamrl.models.families import build_random, save_model
from teamrl.models.measure import measure

__all__ = [
    "BUILD_VERSION",
    "DEFAULT_STEPS",
    "EOS",
    "PAD",
    "VOCAB_SIZE",
    "build_random",
    "build_text",
    "default_text_model_dir",
    "weights_digest",
    "workflows_fingerprint",
]

BUILD_VERSION = 2  # 2: float32 warm start
DEFAULT_STEPS = 120
ARCH = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TOKENS_PER_BATCH = 6144
DRILL_SHARE = 0.3  # of each batch's tokens: arithmetic drill lines


def default_text_model_dir() -> Path:
    """``$TEAMRL_CACHE/models/embedded-text-v<BUILD_VERSION>`` (``~/.cache/teamrl`` when ``TEAMRL_CACHE`` is unset)."""
    root = Path(os.environ.get("TEAMRL_CACHE", Path.home() / ".cache" / "teamrl"))
    return root / "models" / f"embedded-text-v{BUILD_VERSION}"


# ============================================================================ training


def _drill_example(tok: Any, rng: random.Random, n_lines: int = 12) -> Example:
    """Drill lines as one example: the loss is on each result (after ``=``) and the newline."""
    prompt: list[int] = [tok.eos_token_id]
    labels: list[int] = []
    ids: list[int] = []
    for line in drill_lines(rng, n_lines):
        lhs, rhs = line.split(" =")
        a = tok.encode(lhs + " =", add_special=False)
        b = tok.encode(rhs + "\n", add_special=False)
        ids += a + b
        labels += [-100] * len(a) + b
    return Example(prompt + ids, labels, "drill")


def _batches(
    examples: list[Example], tok: Any, rng: random.Random, budget: int = TOKENS_PER_BATCH
) -> Callable[[], tuple[Any, Any]]:
    """A batch maker: token-budgeted batches of demonstrations (similar lengths together) + drills."""
    import torch

    pad = tok.encode(PAD, add_special=False)[0]
    order: list[int] = []

    def refill() -> None:
        idx = list(range(len(examples)))
        rng.shuffle(idx)
        # sort chunks of 256 by length so one batch wastes little on padding
        for c in range(0, len(idx), 256):
            chunk = sorted(
                idx[c : c + 256], key=lambda i: len(examples[i].prompt) + len(examples[i].response)
            )
            order.extend(chunk)

    def make() -> tuple[Any, Any]:
        seqs: list[tuple[list[int], list[int]]] = []
        used = 0
        demo_budget = int(budget * (1 - DRILL_SHARE))
        while used < demo_budget:
            if not order:
                refill()
            e = examples[order.pop(0)]
            seqs.append((e.prompt + e.response, [-100] * len(e.prompt) + e.response))
            used = len(seqs) * max(len(s) for s, _ in seqs)
        while used < budget:
            d = _drill_example(tok, rng)
            seqs.append((d.prompt, [-100] + d.response))
            used += len(d.prompt)
        width = max(len(s) for s, _ in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        for i, (s, lab) in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, : len(lab)] = torch.tensor(lab)
        return ids, labels

    return make


def _loss(model: Any, ids: Any, labels: Any) -> Any:
    """Causal-LM loss with the output layer applied only where there is a label (most are prompt)."""
    import torch.nn.functional as F

    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    keep = target != -100
    logits = model.lm_head(hidden[keep])
    return F.cross_entropy(logits.float(), target[keep])


# ============================================================================ build


def _set_threads() -> int:
    import torch

    n = max(1, min(2, os.cpu_count() or 1))
    torch.set_num_threads(n)
    return n


def build_text(
    out: Path | str | None = None,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    force: bool = False,
    measure_n: int = 100,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Build ``embedded-text`` into ``out`` (default :func:`default_text_model_dir`) and return the folder.

    Reuses a complete build with the same parameters (build version, steps, seed, workflows) unless
    ``force``. ``measure_n`` held-out math problems are used for the accuracy check (0 skips it).
    """
    from teamrl.rewards.tokenizer import HFTokenizer

    say = log or (lambda s: print(f"[model build text] {s}", flush=True))
    out = Path(out) if out else default_text_model_dir()
    params = {
        "kind": "text",
        "build_version": BUILD_VERSION,
        "steps": steps,
        "seed": seed,
        "workflows": workflows_fingerprint(),
    }
    if not force and _built_with(out, params):
        return out
    threads = _set_threads()
    t_start = time.time()
    tmp = _empty_dir(out.with_name(out.name + ".tmp"))
    save_tokenizer(train_tokenizer(tokenizer_corpus(seed)), tmp)
    tok = HFTokenizer(tmp)
    vocab = len(tok._tok)
    say(f"tokenizer: {vocab} tokens ({time.time() - t_start:.0f}s)")
    examples = demonstrations(tok, min(4000, max(40, steps * 8)), seed)
    say(f"{len(examples)} demonstration steps ({time.time() - t_start:.0f}s)")
    model, pad_id = _text_model(tok, vocab, seed)
    train_s = _warm_start(
        model, _batches(examples, tok, random.Random(f"teamrl-text-batches-{seed}")), steps, say
    )
    save_model(model, tmp, {"eos_token_id": tok.eos_token_id, "pad_token_id": pad_id, "do_sample": True})
    t_measure = time.time()
    acc = measure(tmp, n_math=measure_n, model=model) if measure_n else {}
    meta = {
        "params": params,
        "task": "text-workflows",
        "architecture": "Qwen2ForCausalLM",
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": vocab,
        "demonstration_steps": len(examples),
        "threads": threads,
        "warmstart_seconds": round(train_s, 1),
        "build_seconds": round(t_measure - t_start, 1),
        "measure_seconds": round(time.time() - t_measure, 1),
        "held_out_greedy": acc,
        "held_out_tasks": "math-word-held-out",
    }
    (tmp / "teamrl_model.json").write_text(json.dumps(meta, indent=1))
    _replace_dir(out, tmp)
    say(f"wrote {out}: {meta['parameters']:,} parameters, warm start {train_s:.0f}s, held-out {acc}")
    return out


def _built_with(out: Path, params: dict[str, Any]) -> bool:
    """Whether ``out`` holds a complete build made with ``params``."""
    meta_path = out / "teamrl_model.json"
    return meta_path.exists() and json.loads(meta_path.read_text()).get("params") == params


def _empty_dir(path: Path) -> Path:
    """``path`` as a new empty folder (what was there is removed)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _replace_dir(out: Path, new: Path) -> None:
    """``new`` renamed to ``out``, whatever was at ``out`` removed first."""
    if out.exists():
        shutil.rmtree(out)
    new.rename(out)


def _text_model(tok: Any, vocab: int, seed: int) -> tuple[Any, int]:
    """The seeded, untrained Qwen2 model of ``ARCH`` for ``tok``'s vocabulary, and its pad id."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    pad_id = tok.encode(PAD, add_special=False)[0]
    cfg = Qwen2Config(
        vocab_size=(vocab + 63) // 64 * 64,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tok.encode(BOS, add_special=False)[0],
        eos_token_id=tok.eos_token_id,
        pad_token_id=pad_id,
        rope_theta=10000.0,
        **ARCH,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg), pad_id


def _warm_start(
    model: Any, make: Callable[[], tuple[Any, Any]], steps: int, say: Callable[[str], None]
) -> float:
    """``steps`` AdamW steps on the batches ``make`` draws (linear warm-up, then cosine down to
    10 %); the seconds it took."""
    import math

    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, min(50, steps // 10))

    def lr_at(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    t_train = time.time()
    model.train()
    for step in range(steps):
        ids, labels = make()
        loss = _loss(model, ids, labels)  # float32: bf16 autocast was 1.7x slower per step on this CPU
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            say(f"step {step + 1}/{steps} loss {loss.item():.3f} ({time.time() - t_train:.0f}s)")
    return time.time() - t_train


def weights_digest(folder: str | Path) -> str:
    """sha256 of the tokenizer file and every tensor of ``model.safetensors`` (names and bytes)."""
    from safetensors.numpy import load_file

    h = hashlib.sha256(Path(folder, "tokenizer.json").read_bytes())
    tensors = load_file(str(Path(folder, "model.safetensors")))
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].tobytes())
    return h.hexdigest()
