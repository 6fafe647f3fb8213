"""Megatron-LM tensor parallelism, from scratch on the collectives shim.

- :mod:`~lightning_zero.tensor_parallel.ops`: the conjugate communication operators f and g (and the all-gather /
  slice pair along the last dimension) as autograd functions;
- :mod:`~lightning_zero.tensor_parallel.layers`: column-parallel and row-parallel linear layers and the
  vocabulary-parallel embedding, each built from this rank's slice of a full module;
- :mod:`~lightning_zero.tensor_parallel.cross_entropy`: the loss from vocabulary-sharded logits, never gathered;
- :mod:`~lightning_zero.tensor_parallel.plan`: :func:`parallelize` a model by module names with a plan of styles,
  :data:`GPT_PLAN` for the demo GPT, :func:`full_state_dict` to gather the weights back (:func:`shard_state_dict`
  slices them again) and :func:`unparallelize` to rebuild the full model;
- :mod:`~lightning_zero.tensor_parallel.sharding`: the slicing arithmetic and its inverse all-gather.

Every function and layer takes ``group`` (``None``: the world), the tensor-parallel group of a 2-D mesh.
"""

from __future__ import annotations

from lightning_zero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lightning_zero.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelModule,
    VocabParallelEmbedding,
)
from lightning_zero.tensor_parallel.ops import (
    copy_to_parallel_region,
    gather_from_parallel_region,
    reduce_from_parallel_region,
    scatter_to_parallel_region,
)
from lightning_zero.tensor_parallel.plan import (
    GPT_PLAN,
    ColwiseParallel,
    HeadParallel,
    RowwiseParallel,
    Style,
    VocabParallel,
    full_state_dict,
    parallelize,
    shard_state_dict,
    sharded_entries,
    unparallelize,
)
from lightning_zero.tensor_parallel.sharding import shard, unshard

__all__ = [
    "GPT_PLAN",
    "ColumnParallelLinear",
    "ColwiseParallel",
    "HeadParallel",
    "RowParallelLinear",
    "RowwiseParallel",
    "Style",
    "TensorParallelModule",
    "VocabParallel",
    "VocabParallelEmbedding",
    "copy_to_parallel_region",
    "full_state_dict",
    "gather_from_parallel_region",
    "parallelize",
    "reduce_from_parallel_region",
    "scatter_to_parallel_region",
    "shard",
    "shard_state_dict",
    "sharded_entries",
    "unparallelize",
    "unshard",
    "vocab_parallel_cross_entropy",
]
