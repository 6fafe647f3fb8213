"""Gradient norms from gradient shards: the global norm for clipping, and each parameter's norm from its pieces in
every rank's shard (what ``lightning_zero.grad_norm`` reports under ZeRO)."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from lightning_zero.comm import collectives as comm
from lightning_zero.zero.unused import ParamPieces


def param_grad_norms(
    params: list[ParamPieces], *, order: list[str], unused: set[str], group: object, device: torch.device
) -> tuple[list[ParamPieces], Tensor]:
    """The parameters with a gradient under ``ddp`` in the optimizer's ``order`` (``unused``: those no rank used),
    and the 2-norm of each one's *whole* gradient, in the gradients' dtype, as torch computes it on a whole gradient
    ([Note: clipping as torch does]). One all-reduce of two values per parameter; ``([], empty)`` if there are none."""
    by_name = {p.name: p for p in params}
    ordered = [by_name[name] for name in order if name not in unused and by_name[name].shard.grad is not None]
    if not ordered:
        return [], torch.zeros(0, device=device)
    partial = torch.zeros(2, len(ordered), dtype=torch.float64, device=device)  # whole norms, squares of pieces
    grads = [g.detach() for g in (param.shard.grad for param in ordered) if g is not None]  # one per param
    for i, (param, grad) in enumerate(zip(ordered, grads)):
        if [length for _, length in param.pieces] == [param.numel]:  # whole here, so nowhere else
            partial[0, i] = get_total_norm([grad.narrow(0, *param.pieces[0])])  # torch's kernel for one gradient
            continue
        for offset, length in param.pieces:
            partial[1, i] += grad.narrow(0, offset, length).double().pow(2).sum()
    comm.all_reduce(partial, "sum", group=group, tag="clip_norm")
    return ordered, (partial[0] + partial[1].sqrt()).to(grads[0].dtype)  # one of the two is zero


def total_grad_norm(
    params: list[ParamPieces], *, order: list[str], unused: set[str], group: object, device: torch.device
) -> Tensor:
    """The 2-norm of the whole gradient across every rank's shard, as ``get_total_norm`` of the whole gradients under
    ``ddp`` (see :func:`param_grad_norms`)."""
    _, norms = param_grad_norms(params, order=order, unused=unused, group=group, device=device)
    return get_total_norm(list(norms)) if len(norms) else torch.zeros((), device=device)


def clip_grad_norm_(
    params: list[ParamPieces],
    max_norm: float,
    *,
    order: list[str],
    unused: set[str],
    group: object,
    device: torch.device,
) -> Tensor:
    """Scale this rank's gradient shards so the *global* norm is at most ``max_norm``; return that norm.

    [Note: clipping as torch does] ``torch.nn.utils.clip_grad_norm_`` under ``ddp`` takes the 2-norm of each
    parameter's gradient, in the optimizer's order (those with a ``.grad``), the 2-norm of those norms
    (``get_total_norm``), and multiplies every gradient by ``clamp(max_norm / (total + 1e-6), max=1)``
    (``clip_grads_with_norm_``), all in the gradients' dtype. This calls the same two functions, so the clipped
    gradients are bit-identical to ``ddp``'s: a parameter whole in one rank's shard has its norm taken there by the
    same kernel (the other ranks add zero), and only a parameter cut by a shard boundary has its norm from the sum of
    its pieces' squares (in fp64). ``order`` names the parameters as the optimizer holds them; ``unused`` those without
    a gradient under ``ddp`` (no rank used them).
    """
    ordered, norms = param_grad_norms(params, order=order, unused=unused, group=group, device=device)
    if not ordered:
        return torch.zeros((), device=device)
    total = get_total_norm(list(norms))
    clip_grads_with_norm_(list({id(p.shard): p.shard for p in ordered}.values()), max_norm, total)
    return total


def shard_grad_norms(
    params: list[ParamPieces], norm_type: float, *, group: object, device: torch.device
) -> list[Tensor]:
    """The norm of each parameter's *whole* gradient from its pieces in every rank's shard (one all-reduce).

    Each rank sums ``|g|^p`` (or takes ``max |g|``) over its pieces of each parameter; the partial results of all ranks
    add up (or max) to the parameter's. Parameters whose group has no gradient yet count as zero.
    """
    infinite = math.isinf(norm_type)
    partial = torch.zeros(len(params), dtype=torch.float64, device=device)
    for i, param in enumerate(params):
        grad = param.shard.grad
        if grad is None:
            continue
        for offset, length in param.pieces:
            piece = grad.detach().narrow(0, offset, length).double().abs()
            partial[i] = torch.maximum(partial[i], piece.max()) if infinite else partial[i] + piece.pow(norm_type).sum()
    comm.all_reduce(partial, "max" if infinite else "sum", group=group, tag="grad_norm")
    return list(partial if infinite else partial.pow(1.0 / norm_type))
