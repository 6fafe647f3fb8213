"""The communication operators of Megatron-LM tensor parallelism, as autograd functions.

[Note: conjugate operators] Megatron-LM (Shoeybi et al. 2019, section 3) needs exactly two operators per
parallel region, each the other's adjoint:

- **f** (:func:`copy_to_parallel_region`): identity forward, all-reduce (sum) of the gradient backward. It marks
  where a *replicated* activation enters a region whose ranks each compute with their own slice of the weights: each
  rank's backward produces only its slice's contribution to the input gradient, and the sum over ranks is the full
  gradient.
- **g** (:func:`reduce_from_parallel_region`): all-reduce (sum) forward, identity backward. It closes the region:
  the ranks' partial outputs are summed into the replicated activation, whose gradient every rank already holds in
  full.

A column-parallel then row-parallel pair (an MLP, or the attention heads then their output projection) is thus
``g(row(act(column(f(x)))))``: one all-reduce forward, one backward, each of the activation's size.

Two more conjugates move along the last dimension, for layers whose neighbours want the full width:
:func:`gather_from_parallel_region` (all-gather forward, keep this rank's slice backward) and
:func:`scatter_to_parallel_region` (keep this rank's slice forward, all-gather backward). Rank ``r`` of a group of
``N`` owns slice ``[r*k, (r+1)*k)`` of a last dimension of width ``N*k``.

Every collective goes through :mod:`lightning_zero.comm.collectives` with the ledger tag :data:`TAG`, and runs on
``group`` (``None``: the world), so the same code serves the tensor-parallel sub-group of a 2-D mesh. With a group of
one rank every operator is the identity and nothing is communicated (or recorded), so a model parallelized over one
rank runs without a process group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm import collectives as comm

TAG = "tp"
"""Ledger tag of every tensor-parallel collective of a training step (``comm.LEDGER.calls("all_reduce", TAG)``)."""

_Move = Callable[[Tensor, Any], Tensor]  # one direction of a conjugate pair: (tensor, group) -> tensor


def _identity(x: Tensor, group: Any) -> Tensor:
    return x


def all_reduce_(x: Tensor, op: str, group: Any) -> Tensor:
    """In-place all-reduce of ``x`` over ``group`` (ledger tag :data:`TAG`); nothing to do, and no process group
    needed, with one rank. Returns ``x``."""
    if comm.world_size(group) > 1:
        comm.all_reduce(x, op, group=group, tag=TAG)
    return x


def _all_reduce(x: Tensor, group: Any) -> Tensor:
    # A copy: an autograd function must not change its inputs (another backward may have saved them).
    return all_reduce_(x.clone(memory_format=torch.contiguous_format), "sum", group)


def split_last_dim(x: Tensor, group: Any) -> Tensor:
    """This rank's slice of ``x``'s last dimension (contiguous); refuses a width not divisible by the group."""
    n = comm.world_size(group)
    if x.shape[-1] % n:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {n}")
    return x.tensor_split(n, dim=-1)[comm.rank(group)].contiguous()


def gather_last_dim(x: Tensor, group: Any) -> Tensor:
    """Every rank's ``x`` concatenated along the last dimension, in rank order."""
    n = comm.world_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    flat = x.new_empty(n * x.numel())
    comm.all_gather(flat, x.view(-1), group=group, tag=TAG)  # gloo wants a flat input for a flat output
    # (N, ..., k) -> (..., N, k) -> (..., N*k): rank r's block lands at [r*k, (r+1)*k).
    return flat.view(n, *x.shape).movedim(0, -2).flatten(-2)


class _Conjugate(torch.autograd.Function):
    """``forward(x)`` in the forward pass, ``backward(grad)`` in the backward pass ([Note: conjugate operators])."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, forward: _Move, backward: _Move, group: Any) -> Tensor:
        ctx.backward_move, ctx.group = backward, group
        out = forward(x, group)
        return out.view_as(out) if out is x else out  # autograd needs a new tensor object for the identity

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        return ctx.backward_move(grad, ctx.group), None, None, None


def copy_to_parallel_region(x: Tensor, group: Any = None) -> Tensor:
    """Megatron's f: ``x`` unchanged forward; the gradient summed over ``group`` backward.

    Args:
        x: a replicated activation (equal on every rank of ``group``) entering a parallel region.
        group: the tensor-parallel process group; ``None`` is the world.

    Returns:
        ``x`` (a view).
    """
    return _Conjugate.apply(x, _identity, _all_reduce, group)


def reduce_from_parallel_region(x: Tensor, group: Any = None) -> Tensor:
    """Megatron's g: ``x`` summed over ``group`` forward; the gradient unchanged backward.

    Args:
        x: this rank's partial sum of the region's output.
        group: the tensor-parallel process group; ``None`` is the world.

    Returns:
        The sum over the ranks of ``group``, equal on every rank.
    """
    return _Conjugate.apply(x, _all_reduce, _identity, group)


def gather_from_parallel_region(x: Tensor, group: Any = None) -> Tensor:
    """All-gather along the last dimension forward; this rank's slice of the gradient backward.

    Args:
        x: this rank's slice ``(..., k)`` of an activation sharded along its last dimension.
        group: the tensor-parallel process group; ``None`` is the world.

    Returns:
        The full activation ``(..., N*k)``, equal on every rank.
    """
    return _Conjugate.apply(x, gather_last_dim, split_last_dim, group)


def scatter_to_parallel_region(x: Tensor, group: Any = None) -> Tensor:
    """This rank's slice of the last dimension forward; the gradient all-gathered backward.

    Args:
        x: a replicated activation ``(..., N*k)``.
        group: the tensor-parallel process group; ``None`` is the world.

    Returns:
        This rank's slice ``(..., k)``.
    """
    return _Conjugate.apply(x, split_last_dim, gather_last_dim, group)
