"""Which layers each pipeline stage holds, and how a batch becomes micro-batches: pure functions, no processes.

The user's LightningModule names one ``nn.Sequential`` (the strategy's ``layers`` setting, ``"layers"`` by default):
its children, in order, are cut into ``stages`` contiguous slices, ``balance[s]`` children for stage ``s``
(:func:`partition`). Every trainable parameter must live in that ``nn.Sequential``, and none in two stages
(:func:`check_parameters`): a stage updates only what it holds.

A batch is cut along its first dimension into ``micro_batches`` pieces with ``torch.tensor_split`` (the first
``size % micro_batches`` pieces one sample larger; a batch of fewer samples, one piece per sample); each piece's loss
counts with weight ``size_m / size``
(:func:`split_batch`), so the step's loss and gradient are those of the whole batch for a loss that is a mean over
its samples (the usual ``reduction="mean"``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm


def partition(num_layers: int, stages: int, balance: Sequence[int] | None = None) -> list[range]:
    """The layer indices of each stage: ``balance[s]`` consecutive layers for stage ``s``, or an even split (the
    first ``num_layers % stages`` stages one layer more) when ``balance`` is ``None``."""
    if stages > num_layers:
        raise ValueError(f"the pipeline has {stages} stages but only {num_layers} layers: expected at least one each")
    if balance is None:
        base, extra = divmod(num_layers, stages)
        balance = [base + (s < extra) for s in range(stages)]
    balance = list(balance)
    if len(balance) != stages or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in balance):
        raise ValueError(f"balance={balance} is invalid: expected {stages} integers >= 1 (one per stage)")
    if sum(balance) != num_layers:
        raise ValueError(f"balance={balance} sums to {sum(balance)}: expected the {num_layers} layers of the pipeline")
    starts = [sum(balance[:s]) for s in range(stages)]
    return [range(start, start + n) for start, n in zip(starts, balance)]


def find_layers(module: nn.Module, path: str) -> nn.Sequential:
    """The pipelined ``nn.Sequential`` of ``module`` at the attribute path ``path`` (dotted for a nested one)."""
    try:
        layers = operator.attrgetter(path)(module)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.Sequential):
        raise TypeError(
            f"pipeline_scratch: {type(module).__name__}.{path} is {type(layers).__name__}: expected the nn.Sequential"
            " whose children the stages split (the strategy's `layers` setting names it, or the module's"
            " `pipeline_layers`)"
        )
    return layers


def check_parameters(module: nn.Module, layers_name: str, layers: nn.Sequential, slices: list[range]) -> None:
    """Refuse trainable parameters outside the pipelined layers, or shared by two stages, naming them."""
    inside = {id(p) for p in layers.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ValueError(
            f"pipeline_scratch: the trainable parameters {outside} are outside {layers_name!r}, the nn.Sequential the"
            " pipeline splits: move them into one of its layers (every stage updates only the layers it holds)"
        )
    owner: dict[int, int] = {}
    for s, indices in enumerate(slices):
        for i in indices:
            for name, p in layers[i].named_parameters():
                if owner.setdefault(id(p), s) != s:
                    raise ValueError(
                        f"pipeline_scratch: parameter {layers_name}.{i}.{name} is shared by stages {owner[id(p)]} and"
                        f" {s} (tied weights): a pipeline cannot tie parameters across stages"
                    )


def check_batch_statistics(layers: nn.Sequential, layers_name: str, micro_batches: int) -> None:
    """A BatchNorm normalizes each micro-batch by that micro-batch's statistics: refused when a batch is cut."""
    found = [f"{layers_name}.{n}" for n, m in layers.named_modules() if isinstance(m, _BatchNorm)]
    if found and micro_batches > 1:
        raise ValueError(
            f"pipeline_scratch: {found} normalize each micro-batch by its own statistics, so with"
            f" micro_batches={micro_batches} the training differs from a run on whole batches: use"
            " micro_batches=1 (data-parallel replicas of the pipeline still help) or a normalization without batch"
            " statistics (LayerNorm, GroupNorm)"
        )


def batch_size(batch: Any) -> int:
    """The first dimension of the batch's first tensor."""
    sizes: list[int] = []
    apply_to_collection(batch, Tensor, lambda t: sizes.append(t.shape[0]) if t.dim() else None)
    if not sizes:
        raise ValueError("pipeline_scratch: the batch holds no tensor with a batch dimension to cut into micro-batches")
    return sizes[0]


def split_batch(batch: Any, micro_batches: int) -> list[tuple[Any, float]]:
    """``micro_batches`` pieces of ``batch`` (every tensor cut along dimension 0) with their weights
    ``size_m / size``; one per sample for a batch of fewer samples (an epoch's short last batch)."""
    size = batch_size(batch)
    micro_batches = min(micro_batches, size)
    pieces = []
    for m in range(micro_batches):
        piece = apply_to_collection(batch, Tensor, lambda t, m=m: t.tensor_split(micro_batches)[m] if t.dim() else t)
        pieces.append((piece, batch_size(piece) / size))
    return pieces


# The activations crossing a stage boundary go with a small header: the receiver allocates from it.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)
HEADER_SLOTS = 11
"""Length of an activation header: the dtype code, whether it requires a gradient, the number of dimensions, then up
to 8 sizes."""


def encode_header(tensor: Tensor) -> Tensor:
    """``tensor``'s dtype and shape as an int64 header of :data:`HEADER_SLOTS` values."""
    if tensor.dtype not in _DTYPES or tensor.dim() > HEADER_SLOTS - 3:
        raise ValueError(
            f"pipeline_scratch: a stage output of dtype {tensor.dtype} and {tensor.dim()} dimensions cannot cross a"
            f" stage boundary: expected one of {[str(d) for d in _DTYPES]} and at most {HEADER_SLOTS - 3} dimensions"
        )
    values = [_DTYPES.index(tensor.dtype), int(tensor.requires_grad), tensor.dim(), *tensor.shape]
    return torch.tensor(values + [0] * (HEADER_SLOTS - len(values)), dtype=torch.int64)  # one op: it runs per send


def decode_header(header: Tensor) -> tuple[torch.dtype, bool, tuple[int, ...]]:
    """The dtype, ``requires_grad`` and shape of :func:`encode_header`."""
    code, requires_grad, ndim, *sizes = header.tolist()
    return _DTYPES[code], bool(requires_grad), tuple(sizes[:ndim])
