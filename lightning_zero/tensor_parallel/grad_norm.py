"""Norm clipping of a tensor-parallel model by the norm of the whole unsharded model: :func:`clip_grad_by_global_norm`.

[Note: global norm] Norm clipping uses the norm of the whole unsharded model's gradient, as ``clip_grad_norm_`` on
the one-process model: the squares of the sharded gradients are summed over the tensor-parallel group (one
all-reduce of one value, ledger tag ``"tp/grad_norm"``) and the replicated ones, equal on every rank of the group,
are added once. Under ZeRO each parameter's norm is first summed from its pieces in every shard of the data-parallel
group (one all-reduce of one value per parameter, ledger tag ``"grad_norm"``; ``lightning_zero/zero/grad_norm.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm import collectives as comm


def clip_grad_by_global_norm(
    sharded: Sequence[Tensor],
    replicated: Sequence[Tensor],
    grads: Sequence[Tensor],
    clip_val: float,
    group: Any,
    device: torch.device,
) -> Tensor:
    """Scale ``grads`` in place so that the global norm is at most ``clip_val``; returns that norm.

    Args:
        sharded: the 2-norms of this rank's tensor-parallel slices' gradients.
        replicated: the 2-norms of the replicated parameters' gradients (the same on every rank of ``group``).
        grads: the gradient tensors to scale.
        clip_val: the largest global norm left unscaled.
        group: the tensor-parallel group the slices' squares are summed over; ``None``: a group of one rank, nothing
            to sum.
        device: where the norm is computed when this rank has no sliced gradient.
    """
    squares = torch.stack(list(sharded)).pow(2).sum() if sharded else torch.zeros((), device=device)
    if group is not None:
        comm.all_reduce(squares, "sum", group=group, tag="tp/grad_norm")
    if replicated:
        squares = squares + torch.stack(list(replicated)).pow(2).sum()
    coef = torch.clamp(clip_val / (squares.sqrt() + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(list(grads), coef.to(grads[0].device, grads[0].dtype))
    return squares.sqrt()
