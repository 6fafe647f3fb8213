"""A pipeline's gradients across ranks: the average over the data-parallel replicas of a stage
(:func:`average_gradients`) and norm clipping by the norm over every stage (:func:`clip_grad_by_global_norm`).

Each stage holds the gradients of its own layers only, so both need communication: the replicas of a stage hold
the same parameters and average their gradients as ``ddp``'s ranks do, and ``clip_grad_norm_`` of the whole model
needs the squared norms of every stage's gradients summed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.comm import collectives as comm


def average_gradients(grads: Sequence[Tensor], group: Any) -> None:
    """Average ``grads`` in place over ``group`` (the ranks holding this stage) with one all-reduce of them
    flattened."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, "avg", group=group, tag="grads")
    for grad, averaged in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(averaged.view_as(grad))


def clip_grad_by_global_norm(optimizer: Optimizer, clip_val: float, group: Any, device: torch.device) -> None:
    """``clip_grad_norm_`` over the gradients of every stage of ``group`` (one pipeline): this stage's squared norms
    plus one all-reduce."""
    grads = [p.grad for param_group in optimizer.param_groups for p in param_group["params"] if p.grad is not None]
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    squares = torch.stack(norms).pow(2).sum() if norms else torch.zeros((), device=device)
    comm.all_reduce(squares, "sum", group=group, tag="pipeline/grad_norm")
    coef = torch.clamp(clip_val / (squares.sqrt() + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
