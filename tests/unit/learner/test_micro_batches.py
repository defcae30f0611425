"""Micro-batches bounded by rows and by padded tokens (teamrl.learner.logprobs.LogprobPasses.chunks)."""

from __future__ import annotations

import torch

from teamrl.learner.logprobs import LogprobPasses


def _passes(rows: int, tokens: int) -> LogprobPasses:
    return LogprobPasses(
        net=None, adapters={}, temperature=1.0, micro_batch_rows=rows, micro_batch_tokens=tokens
    )  # type: ignore[arg-type]


def test_token_budget_cuts_consecutive_rows_by_their_longest() -> None:
    lengths = torch.tensor([100, 300, 100, 100, 900, 50, 50])
    idx = torch.tensor([0, 1, 2, 3, 4, 5, 6])
    cut = [c.tolist() for c in _passes(64, 1000).chunks(idx, None, lengths)]
    # [0, 1, 2]: 3 x 300 = 900; adding row 3 would pad 4 x 300; row 4 alone is 900; then 5, 6
    assert cut == [[0, 1, 2], [3], [4], [5, 6]]
    assert sum(cut, []) == idx.tolist()  # every row once, in order
    for c in cut:
        assert len(c) == 1 or len(c) * int(lengths[c].max()) <= 1000


def test_rows_bound_and_one_row_over_budget_and_budget_off() -> None:
    lengths = torch.tensor([10] * 5 + [5000])
    idx = torch.arange(6)
    assert [len(c) for c in _passes(2, 4096).chunks(idx, None, lengths)] == [2, 2, 1, 1]
    assert [len(c) for c in _passes(64, 0).chunks(idx, None, lengths)] == [6]  # 0: rows only
    assert [len(c) for c in _passes(4, 4096).chunks(idx)] == [4, 2]  # no lengths: rows only
    sub = torch.tensor([5, 1])  # a subset of the batch's rows, indexed into its lengths
    assert [c.tolist() for c in _passes(64, 4096).chunks(sub, None, lengths)] == [[5], [1]]
