"""Tokenizers for building agent prompts: text in, the exact token ids the engine is given out.

Here, below both services, because the rollout (prompts), the learner (its LangMARL judge) and the
embedded model builders all tokenize, and rollout and learner never import each other.

Design decisions:

* **One small protocol** (:class:`Tokenizer`): ``encode``, ``decode``, ``chat`` (``None`` when the
  tokenizer has no chat template), ``eos_token_id``. The episode executor calls nothing else, so a
  test or a new model family needs only these four.
* **Ids are built once and kept.** A prompt is encoded once; a tool result is encoded on its own
  (``add_special=False``) and appended to the ids the model already saw; nothing is re-tokenised
  between agents or tool rounds, so the ids recorded in a step are exactly what was sampled from.
* **Three implementations.** :class:`CharTokenizer` is the embedded model's character vocabulary
  (``CharTokenizer.encode``: BOS then one id per character; its ``tokenizer.json`` does *not* add
  the BOS, so the embedded folder is always read with this class). :class:`HFTokenizer` wraps a
  HuggingFace tokenizer folder through ``transformers.AutoTokenizer`` (imported on first use) and
  renders prompts with ``apply_chat_template`` when the folder has a template.
  :class:`ByteTokenizer` (UTF-8 bytes + BOS/EOS) is a real, dependency-free tokenizer for any text;
  the text workflows use it in tests where the embedded vocabulary cannot spell their prompts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

MAX_SHOWN_CHARS = 16  # an English text in a 17-symbol vocabulary would otherwise list ~60 characters


class TokenizerError(ValueError):
    """Text the tokenizer cannot encode, or a tokenizer folder that cannot be read."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the episode executor needs from a tokenizer.

    Call sequence::

        ids = tok.chat([{"role": "system", "content": p}, {"role": "user", "content": u}])
        if ids is None:                      # no chat template: plain text
            ids = tok.encode(p + u)
        more = tok.encode(tool_result, add_special=False)
        tok.decode(response_ids)
    """

    eos_token_id: int | None

    def encode(self, text: str, *, add_special: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int] | None: ...


class CharTokenizer:
    """The embedded model's vocabulary: ``<pad>``=0, ``<bos>``=1, then one id per character."""

    def __init__(self, chars: str = "0123456789+=;?SVR", bos: int = 1, eos_char: str = ";") -> None:
        self.chars = list(chars)
        self.bos = bos
        self._index = {c: i + 2 for i, c in enumerate(self.chars)}
        self.eos_token_id: int | None = self._index.get(eos_char)

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        bad = sorted({c for c in text if c not in self._index})
        if bad:
            more = f" and {len(bad) - MAX_SHOWN_CHARS} more" if len(bad) > MAX_SHOWN_CHARS else ""
            raise TokenizerError(
                f"{len(bad)} character(s) not in the char vocabulary {''.join(self.chars)!r}: "
                f"{''.join(bad[:MAX_SHOWN_CHARS])!r}{more} (text {text!r:.80})"
            )
        ids = [self._index[c] for c in text]
        return [self.bos, *ids] if add_special else ids

    def decode(self, ids: Sequence[int]) -> str:
        n = len(self.chars)
        return "".join(self.chars[i - 2] for i in ids if 2 <= i < 2 + n)

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int] | None:
        return None


class ByteTokenizer:
    """UTF-8 bytes: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, byte ``b`` = ``b + 3`` (vocabulary 259)."""

    vocab_size = 259

    def __init__(self) -> None:
        self.bos = 1
        self.eos_token_id: int | None = 2

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        ids = [b + 3 for b in text.encode("utf-8")]
        return [self.bos, *ids] if add_special else ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", "replace")

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int] | None:
        return None


class HFTokenizer:
    """A HuggingFace tokenizer folder (``tokenizer.json`` / ``tokenizer_config.json``).

    ``chat`` uses the folder's chat template with ``add_generation_prompt=True`` and returns
    ``None`` when there is none (``use_chat_template=False`` forces plain text).
    """

    def __init__(self, folder: str | Path, use_chat_template: bool = True) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # the rollout image always has it (vLLM depends on it)
            raise TokenizerError(f"HFTokenizer needs transformers: {e}") from e
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as e:
            raise TokenizerError(f"cannot read a tokenizer from {folder}: {e}") from e
        self.folder = str(folder)
        self.use_chat_template = use_chat_template
        self.eos_token_id: int | None = self._tok.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int] | None:
        if not (self.use_chat_template and self.has_chat_template):
            return None
        out = self._tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
        if hasattr(out, "keys") and "input_ids" in out:  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return [int(i) for i in out]


class FastTokenizer:
    """A HuggingFace folder read without transformers: ``tokenizers`` + the chat template in jinja2.

    Used where a second matters (``teamrl workflow check``, the launcher's checks and probe): it
    imports in ~0.1 s where transformers takes ~5 s. Its ids are the folder's tokenizer's; the chat
    rendering follows the template with ``add_generation_prompt=True``, like :class:`HFTokenizer`.
    """

    def __init__(self, folder: str | Path, use_chat_template: bool = True) -> None:
        from tokenizers import Tokenizer as _Tok

        folder = Path(folder)
        try:
            self._tok = _Tok.from_file(str(folder / "tokenizer.json"))
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
        except Exception as e:  # tokenizers raises its own Exception type; json/OSError too
            raise TokenizerError(f"cannot read a tokenizer from {folder}: {e}") from e
        template = cfg.get("chat_template") if use_chat_template else None
        if template is None and use_chat_template and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        self._template = template
        self._compiled: Any = None  # the template, compiled on first use (chat)
        self._specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token")}
        eos = self._specials["eos_token"]
        self.eos_token_id: int | None = self._tok.token_to_id(eos) if eos else None
        self.folder = str(folder)

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int] | None:
        if not self._template:
            return None
        if self._compiled is None:  # compiled once: compiling took ~4 ms a prompt, rendering ~0.1
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._compiled = env.from_string(self._template)
        text = self._compiled.render(
            messages=list(messages),
            add_generation_prompt=True,
            **{k: v or "" for k, v in self._specials.items()},
        )
        return self.encode(text, add_special=False)


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):  # {"content": "<|im_end|>", ...}
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def tokenizer_for(folder: str | Path, use_chat_template: bool = True, *, fast: bool = False) -> Tokenizer:
    """The tokenizer of a model folder: the char vocabulary for a teamrl embedded model, else HF
    (``fast=True``: :class:`FastTokenizer`, without transformers, when the folder has tokenizer.json)."""
    folder = Path(folder)
    marker = folder / "teamrl_model.json"
    if marker.is_file():
        meta = json.loads(marker.read_text())
        if str(meta.get("task", "")).endswith("addition"):
            return CharTokenizer()
    if fast and (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return FastTokenizer(folder, use_chat_template=use_chat_template)
    return HFTokenizer(folder, use_chat_template=use_chat_template)
