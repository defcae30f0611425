"""The publish probe computed in float32 from the exported adapter files, for a bfloat16 learner.

A rollout uses an adapter version only if vLLM reproduces the learner's probe log-probs (docs/architecture.md
§8). A bfloat16 learner's own log-probs carry its rounding: on this CPU, SmolLM2-135M's probe moves by 0.09-0.35
(max over the probe's tokens) between float32 and bfloat16 with no adapter at all, as much as a few steps of
training move it (docs/real-model.md, "A bfloat16 learner"). A float32 rollout checking them would have to accept
an adapter that is not applied. :class:`Float32Probe` computes the expected log-probs instead from what the rollout
loads: the float32 base with each adapter *as exported* (PEFT), checked at float32's tolerance. The probe then
verifies the transfer (files, load, LoRA applied in vLLM) as strictly as in a float32 run; the learner's own
bfloat16 drift from float32 is reported each step as ``logprob_gap`` (recomputed against behaviour log-probs).

Cost: a float32 copy of the base in the learner (540 MB for SmolLM2-135M) and one forward pass of the probe per
adapter per version (well under a second on CPU for this model).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Float32Probe:
    """Probe log-probs of exported adapters on a float32 copy of ``base_model`` (loaded on first use)."""

    def __init__(self, base_model: str | Path) -> None:
        self.base_model = str(base_model)
        self._base: Any = None

    def logprobs(self, folder: str | Path, prompt: Sequence[int], completion: Sequence[int]) -> list[float]:
        """log p(completion[i] | prompt, completion[:i]) at temperature 1 with the PEFT adapter in
        ``folder`` applied; the base is restored afterwards."""
        import torch
        from peft import PeftModel

        model = PeftModel.from_pretrained(self._load(), str(folder), is_trainable=False)
        try:
            ids = torch.tensor([[*prompt, *completion]])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            want = torch.tensor(list(completion))[:, None]
            return logits.log_softmax(-1).gather(-1, want)[:, 0].tolist()
        finally:
            self._base = model.unload()

    def _load(self) -> Any:
        if self._base is None:
            import torch
            from transformers import AutoModelForCausalLM

            self._base = AutoModelForCausalLM.from_pretrained(self.base_model, dtype=torch.float32).eval()
        return self._base
