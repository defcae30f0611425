"""Log-probs of agents that choose among a few tokens (the workflow's ``agents.choices``): normalised
over the choices only, as vLLM's processed log-probs under ``allowed_token_ids`` are
(teamrl.learner.logprobs, "Agents that choose are scored among their choices")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from teamrl.learner.config import AgentOverrides
from teamrl.learner.errors import LearnerError
from teamrl.learner.logprobs import LogprobPasses
from teamrl.learner.settings import AdapterSettings

VOCAB, HIDDEN = 11, 6
CHOICES = (2, 5, 7)


class _Net:
    """The one part of an adapter model the log-prob head reads: its output embeddings."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.device = torch.device("cpu")
        self.model = SimpleNamespace(
            get_base_model=lambda: SimpleNamespace(get_output_embeddings=lambda: self.head)
        )


def _passes(temperature: float = 0.7) -> LogprobPasses:
    adapters = {
        "verifier": AdapterSettings(
            lr=1e-3, clip_low=0.2, clip_high=0.2, temperature=temperature, allowed_token_ids=CHOICES
        ),
        "solver": AdapterSettings(lr=1e-3, clip_low=0.2, clip_high=0.2, temperature=temperature),
    }
    return LogprobPasses(net=_Net(), adapters=adapters, temperature=1.0, micro_batch_rows=4)  # type: ignore[arg-type]


def _reference(
    passes: LogprobPasses, sel: torch.Tensor, resp: torch.Tensor, allowed, t: float
) -> torch.Tensor:
    logits = passes.net.head(sel).float() / t
    if allowed is not None:
        keep = torch.full((VOCAB,), float("-inf"))
        keep[list(allowed)] = 0.0
        logits = logits + keep
    return torch.log_softmax(logits, -1).gather(-1, resp[..., None]).squeeze(-1)


def test_an_adapter_that_chooses_is_scored_among_its_choices_and_others_over_the_vocabulary() -> None:
    passes = _passes()
    sel = torch.randn(2, 3, HIDDEN)
    resp = torch.tensor([[5, 2, 7], [5, 9, 1]])
    batch = SimpleNamespace(adapter_of_row=["verifier", "solver"])
    idx = torch.tensor([0, 1])
    own = passes._response_logp(sel[:1], resp[:1], batch, idx[:1], "verifier", grad=False)
    assert torch.allclose(own, _reference(passes, sel[:1], resp[:1], CHOICES, 0.7), atol=1e-6)
    # the base model's pass (KL reference) over rows of both adapters: each row by its own adapter
    both = passes._response_logp(sel, resp, batch, idx, None, grad=False)
    assert torch.allclose(both[0], _reference(passes, sel[0], resp[0], CHOICES, 0.7), atol=1e-6)
    assert torch.allclose(both[1], _reference(passes, sel[1], resp[1], None, 0.7), atol=1e-6)
    # the choices hold the whole probability: their probabilities sum to 1 at every position
    every = torch.stack([_reference(passes, sel[:1], torch.full((1, 3), c), CHOICES, 0.7) for c in CHOICES])
    assert torch.allclose(every.exp().sum(0), torch.ones(1, 3), atol=1e-6)


def test_a_token_outside_the_choices_is_finite_so_a_masked_padding_position_stays_zero() -> None:
    passes = _passes(temperature=1.0)
    sel = torch.randn(1, 2, HIDDEN, requires_grad=True)
    resp = torch.tensor([[7, 0]])  # position 1 is padding (token 0, not a choice)
    batch = SimpleNamespace(adapter_of_row=["verifier"])
    logp = passes._response_logp(sel, resp, batch, torch.tensor([0]), "verifier", grad=True)
    assert torch.isfinite(logp).all() and logp[0, 1] < -1e29
    masked = logp * torch.tensor([[1.0, 0.0]])
    masked.sum().backward()
    assert torch.isfinite(sel.grad).all() and sel.grad[0, 1].abs().sum() == 0


def test_choices_outside_the_vocabulary_or_fewer_than_two_are_refused() -> None:
    passes = _passes()
    passes.adapters["verifier"] = AdapterSettings(
        lr=1e-3, clip_low=0.2, clip_high=0.2, allowed_token_ids=(3, VOCAB)
    )
    batch = SimpleNamespace(adapter_of_row=["verifier"])
    with pytest.raises(LearnerError, match="outside the model's vocabulary"):
        passes._response_logp(
            torch.randn(1, 1, HIDDEN), torch.tensor([[3]]), batch, torch.tensor([0]), "verifier", False
        )
    with pytest.raises(ValueError, match="at least 2"):
        AgentOverrides(allowed_token_ids=[4])
