"""Synchronised batch normalisation on our collectives: ``Trainer(sync_batchnorm=True)`` for every strategy.

Lightning answers ``sync_batchnorm=True`` with ``TorchSyncBatchNorm``, which converts BatchNorm layers to
``torch.nn.SyncBatchNorm``; that module refuses CPU tensors ("SyncBatchNorm layers only work with GPU modules") and
communicates behind our ledger's back. Our strategies convert to :class:`SyncBatchNorm` instead (the
:class:`ScratchSyncBatchNorm` layer-sync plugin), which computes what ``torch.nn.SyncBatchNorm`` computes:

- forward (training): each rank's per-channel count, mean and biased variance are all-gathered and merged (the
  parallel-variance formula, as ``batch_norm_gather_stats_with_counts`` does); the batch is normalised with the global
  mean and variance; running statistics take the global mean and the *unbiased* global variance;
- backward: the per-channel sums of ``dy`` and ``dy * (x - mean)`` are all-reduced, so the input gradient includes
  every rank's contribution through the shared statistics; the weight and bias gradients stay local (the strategy's
  gradient averaging combines them, as DDP does);
- evaluation, or a world of one process: plain ``F.batch_norm``.

So N ranks with equal local batches train exactly like one process normalising the concatenated global batch.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_zero.comm import collectives as comm

TAG = "sync_batchnorm"


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        momentum: float,
        eps: float,
    ) -> Tensor:
        dims = [d for d in range(x.ndim) if d != 1]
        stats_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        xs = x.to(stats_dtype)
        count = torch.tensor([x.numel() // x.shape[1]], dtype=stats_dtype, device=x.device)
        local = torch.cat([count, xs.mean(dims), xs.var(dims, unbiased=False)])
        gathered = comm.all_gather_stack(local, tag=TAG)  # (world, 1 + 2C)
        channels = x.shape[1]
        counts, means, variances = gathered[:, :1], gathered[:, 1 : 1 + channels], gathered[:, 1 + channels :]
        total = counts.sum()
        mean = (counts * means).sum(0) / total
        var = (counts * (variances + (means - mean) ** 2)).sum(0) / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            unbiased = var * (total / (total - 1)) if total > 1 else var
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.ndim - 2)
        xmu = xs - mean.view(shape)
        out = xmu * invstd.view(shape)
        if weight is not None:
            out = out * weight.to(stats_dtype).view(shape)
        if bias is not None:
            out = out + bias.to(stats_dtype).view(shape)
        ctx.save_for_backward(xmu, invstd, weight)
        ctx.total, ctx.dims, ctx.shape = total, dims, shape
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        xmu, invstd, weight = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        dy = grad_out.to(xmu.dtype)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None else None
        channels = sum_dy.numel()
        both = torch.cat([sum_dy, sum_dy_xmu])
        comm.all_reduce(both, "sum", tag=TAG)
        mean_dy, mean_dy_xmu = (both / ctx.total).split(channels)
        scale = invstd if weight is None else invstd * weight.to(xmu.dtype)
        grad_in = (dy - mean_dy.view(shape) - xmu * (invstd**2 * mean_dy_xmu).view(shape)) * scale.view(shape)
        grad_bias_out = grad_bias if ctx.needs_input_grad[2] else None
        grad_weight_out = grad_weight if ctx.needs_input_grad[1] else None
        return grad_in.to(grad_out.dtype), grad_weight_out, grad_bias_out, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation over every rank's batch (see the module docstring); any input of 2 or more dimensions,
    channels in dimension 1, like ``torch.nn.SyncBatchNorm``."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if not (bn_training and self.training and comm.world_size() > 1):
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, bn_training, momentum, self.eps
            )
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, momentum, self.eps
        )


def _replace(module: nn.Module, convert: Any) -> nn.Module:
    replaced = convert(module)
    for name, child in module.named_children():
        replaced.add_module(name, _replace(child, convert))
    return replaced


def _rebuild(old: _BatchNorm, cls: type) -> _BatchNorm:
    """A ``cls`` layer holding ``old``'s parameter and buffer objects (the optimizer keeps pointing at them)."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for key in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
        setattr(new, key, getattr(old, key))
    new._parameters.update(old._parameters)
    new._buffers.update(old._buffers)
    new._non_persistent_buffers_set = set(old._non_persistent_buffers_set)
    new.training = old.training
    new.__dict__.update({k: v for k, v in old.__dict__.items() if k.startswith("_lz_")})
    return new


class ScratchSyncBatchNorm(LayerSync):
    """The layer-sync plugin our strategies use for ``sync_batchnorm=True``: BatchNorm layers become
    :class:`SyncBatchNorm` for the fit and get their own class back afterwards."""

    def apply(self, model: nn.Module) -> nn.Module:
        def convert(m: nn.Module) -> nn.Module:
            if not isinstance(m, _BatchNorm) or isinstance(m, SyncBatchNorm):
                return m
            new = _rebuild(m, SyncBatchNorm)
            new._lz_original_class = type(m)
            return new

        return _replace(model, convert)

    def revert(self, model: nn.Module) -> nn.Module:
        def convert(m: nn.Module) -> nn.Module:
            if not isinstance(m, SyncBatchNorm):
                return m
            original = m.__dict__.pop("_lz_original_class", nn.BatchNorm1d)
            return _rebuild(m, original)

        return _replace(model, convert)
