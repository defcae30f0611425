"""The model a learner trains: one frozen base, one PEFT LoRA per adapter, one DeepSpeed engine per
adapter, and the critic's value head with its own engine (docs/architecture.md §7).

:class:`AdapterModel` owns the tensors; the forward passes over them are :mod:`teamrl.learner.logprobs`,
the losses :mod:`teamrl.learner.objectives`, saving and loading :mod:`teamrl.learner.checkpoint`.

Design decisions:

* **One DeepSpeed engine per adapter, all over the same PEFT module.** Each engine's optimiser owns only
  its adapter's LoRA parameters (so per-adapter lr / clip come for free). The alternative, one engine with
  a param group per adapter, steps every group on every ``step()``: in a sequential (HAPPO) update the
  adapters not being trained have zero gradients, and AdamW still moves them by its decayed first moment.
  Separate engines make "only agent k moves now" structurally true; :meth:`AdapterModel.trainable`
  makes only the adapter being trained require gradients.
* **One base model per learner.** Heterogeneous base models are not mixed in one engine: a team with
  several bases runs one learner group per base (each its own ``teamrl learner`` processes, adapters
  list and publish endpoint).
* **The critic** (``objective="ppo-critic"``) is a value head on the frozen base's hidden states
  (:mod:`teamrl.learner.critic` explains the choice), in float32 whatever the model's dtype, with its
  own DeepSpeed engine and AdamW (``critic_lr``).
* **Seeded construction**: the torch RNG is seeded before the LoRA and value-head initialisation, so
  every rank and every fresh start builds the same weights.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from teamrl.learner.cpu import bfloat16_warning
from teamrl.learner.critic import ValueHead
from teamrl.learner.errors import LearnerError
from teamrl.learner.gradchecks import fuse_grad_checks
from teamrl.learner.settings import EngineSettings, ModelSettings, OptimSettings

log = logging.getLogger("teamrl.learner")

__all__ = ["AdapterModel"]


class AdapterModel:
    """The PEFT model (``model``), one DeepSpeed engine per adapter (``engines``) and the critic's
    (``critic``, None unless ``objective="ppo-critic"``), on ``device``."""

    def __init__(
        self, model_dir: str | Path, adapters: Sequence[str], settings: EngineSettings, device: str
    ) -> None:
        if device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from transformers import AutoModelForCausalLM

        self.adapters = list(adapters)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # this host's GPU index (0 in a one-GPU pod)
        self.device = torch.device("cpu") if device == "cpu" else torch.device("cuda", local_rank)
        dtype = settings.model.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype: str = dtype
        if dtype == "bfloat16" and self.device.type == "cpu" and (warning := bfloat16_warning()):
            log.warning("%s", warning)
        torch.manual_seed(settings.optim.seed)  # LoRA A init: the same on every rank and every fresh start
        torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype)
        base.to(self.device)
        self.model = _peft_model(base, self.adapters, settings.model)
        self.model.to(self.device)
        self.params = {name: self._adapter_params(name) for name in self.adapters}
        resolved = settings.resolved(self.adapters)
        self.engines: dict[str, Any] = {}
        for name in self.adapters:
            self.trainable(name)
            self.engines[name] = _adapter_engine(
                self.model, self.params[name], resolved[name].lr, settings.optim, dtype
            )
        self.trainable(None)
        self.critic: Any = None  # the value head's DeepSpeed engine (objective "ppo-critic" only)
        if settings.objective.objective == "ppo-critic":
            head = ValueHead(int(base.config.hidden_size), settings.critic.critic_hidden).to(self.device)
            self.critic = _engine(
                head, head.parameters(), settings.critic.critic_lr, settings.optim, bf16=False
            )

    def _adapter_params(self, name: str) -> list[torch.nn.Parameter]:
        tag = f".{name}."
        params = [p for n, p in self.model.named_parameters() if "lora_" in n and tag in n]
        if not params:
            raise LearnerError(f"adapter {name!r} has no LoRA parameters (target modules not found?)")
        return params

    def trainable(self, name: str | None) -> None:
        """Only adapter ``name``'s LoRA params require grad (None: nothing does)."""
        for n, ps in self.params.items():
            for p in ps:
                p.requires_grad_(n == name)

    def using(self, adapter: str | None) -> contextlib.AbstractContextManager[Any]:
        """Make ``adapter`` the active one; the returned context disables every adapter while it is
        open when ``adapter`` is None (the base model: the KL reference and the critic's features)."""
        if adapter is None:
            return self.model.disable_adapter()
        self.model.set_adapter(adapter)
        return contextlib.nullcontext()

    def adapter_state(self, name: str) -> dict[str, Tensor]:
        """Copies of one adapter's parameters (for tests and parity checks)."""
        tag = f".{name}."
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if "lora_" in n and tag in n}

    def export_adapters(self, folder: str | Path) -> dict[str, Path]:
        """Write every adapter in PEFT format (``folder/<name>/adapter_config.json`` + safetensors)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        out: dict[str, Path] = {}
        for name in self.adapters:
            # PEFT writes a non-"default" adapter into a subfolder named after it
            self.model.save_pretrained(str(folder), selected_adapters=[name], safe_serialization=True)
            out[name] = folder / name
            if not (out[name] / "adapter_model.safetensors").is_file():
                raise LearnerError(f"PEFT did not write {out[name]}/adapter_model.safetensors")
        return out


def _peft_model(base: Any, adapters: Sequence[str], settings: ModelSettings) -> Any:
    """``base`` wrapped by PEFT with one LoRA per adapter, each at its own rank."""
    from peft import LoraConfig, get_peft_model

    def lora(name: str) -> LoraConfig:
        return LoraConfig(
            r=settings.rank_of(name),
            lora_alpha=settings.lora_alpha,
            lora_dropout=settings.lora_dropout,
            target_modules=list(settings.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )

    model = get_peft_model(base, lora(adapters[0]), adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, lora(name))
    return model


def _adapter_engine(
    model: Any, params: list[torch.nn.Parameter], lr: float, optim: OptimSettings, dtype: str
) -> Any:
    """The DeepSpeed engine of one adapter: the whole PEFT module, an AdamW over this adapter's
    parameters only, and the fused gradient checks (:mod:`teamrl.learner.gradchecks`)."""
    eng = _engine(model, params, lr, optim, bf16=dtype == "bfloat16")
    fuse_grad_checks(eng.optimizer)
    return eng


def _engine(
    module: torch.nn.Module, params: Iterator[Any] | list[Any], lr: float, optim: OptimSettings, *, bf16: bool
) -> Any:
    """``module`` under DeepSpeed with AdamW(``params``): one micro-batch per ``backward`` (gradient
    accumulation is driven by the caller), ZeRO ``optim.zero_stage``, global grad-norm clip."""
    import deepspeed

    opt = torch.optim.AdamW(params, lr=lr, weight_decay=optim.weight_decay, betas=(0.9, 0.999))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": {"stage": optim.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    eng, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config, dist_init_required=False)
    return eng
