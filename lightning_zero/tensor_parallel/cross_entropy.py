"""Cross entropy over vocabulary-sharded logits, without gathering them: :func:`vocab_parallel_cross_entropy`.

[Note: vocab-parallel cross entropy] A column-parallel output head leaves rank ``r`` of ``N`` with the logits of
vocabulary ids ``[r*V/N, (r+1)*V/N)``: *local logits*, ``(tokens, V/N)``. Gathering them would move ``tokens * V``
values per rank; the loss needs only three numbers per token, each an all-reduce of ``tokens`` values (Megatron-LM,
``vocab_parallel_cross_entropy``):

1. *max* (all-reduce max): the largest logit of the token over the whole vocabulary. Every logit is shifted by it
   before ``exp`` (numerical stability: the largest shifted logit is 0, so ``exp`` cannot overflow);
2. *target logit* (all-reduce sum): the shifted logit of the target id, from the one rank that holds it (the others
   contribute 0);
3. *sum of exp* (all-reduce sum): the softmax's normaliser over the whole vocabulary.

The token's loss is ``log(sum of exp) - target logit``; the result is the mean over the tokens whose target is not
``ignore_index``, as ``F.cross_entropy`` gives it. The backward needs no communication: the gradient of a token's
loss with respect to its logits is ``softmax - one_hot(target)``, and each rank holds its slice of the softmax
(saved from the forward) and knows whether it holds the target; it is scaled by ``1 / (counted tokens)`` and zero
for ignored tokens (with every token ignored: a nan loss and a zero gradient, as ``F.cross_entropy`` gives). The
computation runs in fp32 whatever the logits' dtype; the gradient comes back in theirs.

Target ids must lie in ``[0, V)`` (or equal ``ignore_index``): unlike ``F.cross_entropy`` an out-of-range id is not
detected (that would cost a synchronisation), and its token counts with a target logit of 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm import collectives as comm
from lightning_zero.tensor_parallel.ops import all_reduce_


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The mean loss forward (three all-reduces), ``softmax - one_hot`` backward ([Note: vocab-parallel cross
    entropy])."""

    @staticmethod
    def forward(ctx: Any, local_logits: Tensor, targets: Tensor, group: Any, ignore_index: int) -> Tensor:
        logits = local_logits.float()
        local_vocab = logits.shape[-1]
        start = comm.rank(group) * local_vocab
        logit_max = logits.max(dim=-1).values
        all_reduce_(logit_max, "max", group)
        shifted = logits - logit_max.unsqueeze(-1)

        local_targets = targets - start
        elsewhere = (local_targets < 0) | (local_targets >= local_vocab)  # another rank's id, or ignore_index
        local_targets = local_targets.masked_fill(elsewhere, 0)  # any valid column: its value is zeroed below
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)
        all_reduce_(target_logit, "sum", group)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        all_reduce_(sum_exp, "sum", group)

        counted = targets != ignore_index
        count = counted.sum()
        # As F.cross_entropy when every target is ignored: a nan loss (0 / 0) but a zero gradient.
        loss = (sum_exp.log() - target_logit).masked_fill(~counted, 0.0).sum() / count
        weight = counted.float() / count.clamp(min=1)

        ctx.dtype = local_logits.dtype
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_targets, elsewhere, weight)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor, None, None, None]:
        softmax, local_targets, elsewhere, weight = ctx.saved_tensors
        one_hot = (~elsewhere).float().unsqueeze(-1)
        grad = softmax.scatter_add(-1, local_targets.unsqueeze(-1), -one_hot)
        grad.mul_((weight * grad_loss).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    local_logits: Tensor, targets: Tensor, group: Any = None, ignore_index: int = -100
) -> Tensor:
    """``F.cross_entropy(full_logits, targets, ignore_index=ignore_index)`` (mean reduction) from this rank's slice
    of the vocabulary, without gathering the logits ([Note: vocab-parallel cross entropy]).

    Args:
        local_logits: ``(tokens, V/N)``, this rank's slice of the logits (rank ``r``: ids ``[r*V/N, (r+1)*V/N)``),
            e.g. a :class:`~lightning_zero.tensor_parallel.layers.ColumnParallelLinear` head's output flattened to
            ``(batch*seq, V/N)``.
        targets: ``(tokens,)`` target ids in ``[0, V)`` or ``ignore_index``, equal on every rank of ``group``.
        group: the tensor-parallel process group; ``None`` is the world.
        ignore_index: targets of this value count neither in the loss nor in the mean.

    Returns:
        The mean loss (a scalar, fp32), equal on every rank of ``group``.
    """
    if local_logits.ndim != 2 or targets.shape != local_logits.shape[:1]:
        raise ValueError(
            f"local_logits of shape {tuple(local_logits.shape)} and targets of shape {tuple(targets.shape)}: "
            "expected (tokens, V/N) and (tokens,)"
        )
    return _VocabParallelCrossEntropy.apply(local_logits, targets, group, ignore_index)
