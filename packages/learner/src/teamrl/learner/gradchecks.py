"""A fused overflow check and grad norm for the learner's ZeRO-1/2 optimisers (docs/architecture.md §7).

:func:`fuse_grad_checks` patches one DeepSpeed optimiser in place; :mod:`teamrl.learner.model` calls it
on every adapter engine's optimiser. The saving was measured with the learner benchmark
(``tests/bench/learner.py``): a LoRA step has hundreds of small gradient tensors, and DeepSpeed checks
them one kernel launch at a time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["fuse_grad_checks"]


def fuse_grad_checks(opt: Any) -> None:
    """Give a ZeRO-1/2 optimiser one fused pass for its overflow check and one for its grad norm.

    DeepSpeed's ``DeepSpeedZeroOptimizer`` checks every gradient tensor for inf/NaN one at a time
    (``amax``, ``amin``, two ``isfinite``, ...: about six kernels per LoRA tensor, ~1,150 launches
    per step for r 8 on q/k/v/o of a 24-layer model) and takes the grad norm the same way (a float64
    copy and a norm per tensor). Both become one ``torch._foreach_norm`` over all gradients here:
    a float64 norm is non-finite exactly when some gradient element is, and the global norm, its
    all-reduce and the NaN masking are DeepSpeed's own. Optimisers of any other shape (CPU offload,
    ZeRO-3, model or pipeline parallel parameters, a DeepSpeed without these methods) are left as
    they are; so is an optimiser whose fused call fails (the original method runs instead).
    """
    needed = (
        "averaged_gradients",
        "bit16_groups",
        "get_grad_norm_direct",
        "has_overflow_partitioned_grads_serial",
    )
    if not all(hasattr(opt, a) for a in needed) or getattr(opt, "cpu_offload", True):
        return
    if getattr(opt, "model_parallel_rank", 0) != 0 or getattr(opt, "has_moe_layers", False):
        return
    params = [p for group in getattr(opt, "params_in_partition", []) for p in group]
    if any(hasattr(p, "ds_pipe_replicated") or getattr(p, "model_parallel", False) for p in params):
        return
    from deepspeed import comm as ds_dist
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

    norm_direct, overflow_serial = opt.get_grad_norm_direct, opt.has_overflow_partitioned_grads_serial

    def norms(grads: list[Tensor]) -> Tensor:
        return torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64))

    def fused_norm(gradients: list[Tensor], params: list[Any], norm_type: float = 2) -> Tensor:
        grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        if float(norm_type) != 2.0 or not grads:
            return norm_direct(gradients, params, norm_type)
        try:
            total = norms(grads).pow(2).sum().float()
        except (RuntimeError, TypeError):
            return norm_direct(gradients, params, norm_type)
        ds_dist.all_reduce(total, op=ds_dist.ReduceOp.SUM, group=opt.dp_process_group)
        opt._model_parallel_all_reduce(tensor=total, op=ds_dist.ReduceOp.SUM)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=opt.device)
        return total

    def fused_overflow() -> Tensor:
        grads = [g for i in range(len(opt.bit16_groups)) for g in opt.averaged_gradients[i] if g is not None]
        if not grads:
            return overflow_serial()
        try:
            return norms(grads).sum().isfinite().logical_not().reshape(1)
        except (RuntimeError, TypeError):
            return overflow_serial()

    opt.get_grad_norm_direct = fused_norm
    opt.has_overflow_partitioned_grads_serial = fused_overflow
