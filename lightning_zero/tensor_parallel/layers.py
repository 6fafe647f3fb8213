"""Tensor-parallel layers: each holds one rank's slice of a full ``nn.Linear`` or ``nn.Embedding``.

[Note: tensor-parallel slices] Rank ``r`` of a tensor-parallel group of ``N`` ranks holds these slices (``W`` is an
``nn.Linear`` weight of shape ``(out, in)``; ``E`` an embedding table of shape ``(V, d)``):

- :class:`ColumnParallelLinear`: rows ``[r*out/N, (r+1)*out/N)`` of ``W`` and of the bias, so it computes that slice
  of the output features from the full (replicated) input. With ``chunks=c`` the output is ``c`` blocks laid end to
  end (a fused q/k/v projection: ``c=3``), and each block is split separately: rank ``r`` holds rows
  ``[j*out/c + r*out/(c*N), j*out/c + (r+1)*out/(c*N))`` of every block ``j``, i.e. its heads' q, k and v rows.
  ``gather_output=True`` all-gathers the full output (in the full layer's order) instead of leaving it sharded.
- :class:`RowParallelLinear`: columns ``[r*in/N, (r+1)*in/N)`` of ``W``: it multiplies its slice of the input
  features, the partial outputs are summed over the group (Megatron's g), and the full bias, replicated, is added
  once after the sum.
- :class:`VocabParallelEmbedding`: rows ``[r*V/N, (r+1)*V/N)`` of ``E``. Ids outside that range look up zeros, and
  the sum over the group gives every rank the full embedding.

Every layer is built from the full module (``from_module``) by copying this rank's slice, so a parallelized model
starts from exactly the weights of the single-process one; :func:`~lightning_zero.tensor_parallel.sharding.unshard`
(or :func:`~lightning_zero.tensor_parallel.plan.full_state_dict`) gathers them back, and ``unsharded()`` rebuilds the
full module. A size that does not split into
``N`` (times ``chunks``) equal slices is refused with the numbers.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_zero.comm import collectives as comm
from lightning_zero.tensor_parallel.ops import (
    copy_to_parallel_region,
    gather_from_parallel_region,
    reduce_from_parallel_region,
    scatter_to_parallel_region,
)
from lightning_zero.tensor_parallel.sharding import divide, shard, unshard


class TensorParallelModule(nn.Module):
    """Base of the layers holding a slice of a full module's parameters.

    Attributes:
        shard_dims: the sharded parameters and the dimension each is split along; the other parameters are
            replicated.
        group: the tensor-parallel process group (``None``: the world).
        chunks: the number of blocks the sharded dimension holds, each split separately.
        tp_size: the group's size ``N``.
        tp_rank: this rank's index ``r`` in the group.
    """

    shard_dims: ClassVar[dict[str, int]]

    def __init__(self, group: Any, chunks: int = 1) -> None:
        super().__init__()
        self.group, self.chunks = group, chunks
        self.tp_size, self.tp_rank = comm.world_size(group), comm.rank(group)

    def _empty_full(self) -> nn.Module:
        """A full module of this layer's configuration (built on the meta device by :meth:`unsharded`)."""
        raise NotImplementedError

    def unsharded(self) -> nn.Module:
        """The full module this layer holds a slice of, on its device and dtype, with every rank's slices gathered
        back: the inverse of ``from_module``. A collective (an all-gather per sharded parameter): every rank of
        ``group`` calls it."""
        with torch.device("meta"):
            full = self._empty_full()
        full = full.to_empty(device=self.weight.device)  # no initialisation: every parameter is copied below
        with torch.no_grad():
            for name, param in self.named_parameters(recurse=False):
                dim, target = self.shard_dims.get(name), getattr(full, name)
                target.copy_(param if dim is None else unshard(param, dim, self.group, self.chunks))
                target.requires_grad_(param.requires_grad)
        return full

    def _load_slices(self, full: nn.Module) -> None:
        """Copy this rank's slice of ``full``'s parameters (the ones of the same names) into this module's."""
        with torch.no_grad():
            for name, param in self.named_parameters(recurse=False):
                source, dim = getattr(full, name), self.shard_dims.get(name)
                param.copy_(source if dim is None else shard(source, dim, self.group, self.chunks))


def _factory(like: Tensor) -> dict[str, Any]:
    """``like``'s device and dtype, as keyword arguments of a layer's constructor."""
    return {"device": like.device, "dtype": like.dtype}


class _ParallelLinear(TensorParallelModule):
    """What the column- and row-parallel layers share: built from, and gathered back into, an ``nn.Linear``."""

    in_features: int
    out_features: int
    bias: nn.Parameter | None

    @classmethod
    def _from_linear(cls, full: nn.Linear, group: Any, **options: Any) -> Any:
        """This rank's slice of ``full`` (equal on every rank of ``group``), on its device and dtype; ``full`` is left
        untouched. ``options``: the layer's own constructor arguments."""
        layer = cls(
            full.in_features, full.out_features, full.bias is not None, group=group, **options, **_factory(full.weight)
        )
        layer._load_slices(full)
        return layer

    def _empty_full(self) -> nn.Module:
        return nn.Linear(self.in_features, self.out_features, self.bias is not None, dtype=self.weight.dtype)


class ColumnParallelLinear(_ParallelLinear):
    """A linear layer holding this rank's slice of the output features ([Note: tensor-parallel slices]).

    Input: the full (replicated) activation, through Megatron's f (its gradient is summed over the group). Output:
    this rank's slice of the output features, or the full output with ``gather_output=True``. The constructor
    allocates uninitialised parameters of the local shapes (to load a state dict into); :meth:`from_module` fills
    them from a full layer.

    Args:
        in_features, out_features, bias: the full layer's (as ``nn.Linear``'s).
        group: the tensor-parallel process group; ``None`` is the world.
        gather_output: all-gather the output to the full width (default: leave it sharded).
        chunks: the output is this many blocks, each split separately (3: a fused q/k/v projection).
        device, dtype: of the parameters.
    """

    shard_dims: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Any = None,
        gather_output: bool = False,
        chunks: int = 1,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group, chunks)
        local = divide(out_features, self.tp_size, "out_features", chunks)
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_module(
        cls, full: nn.Linear, group: Any = None, *, gather_output: bool = False, chunks: int = 1
    ) -> ColumnParallelLinear:
        """This rank's slice of ``full`` (equal on every rank of ``group``), on its device and dtype; ``full`` is left
        untouched. The other arguments are the constructor's."""
        return cls._from_linear(full, group, gather_output=gather_output, chunks=chunks)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(copy_to_parallel_region(x, self.group), self.weight, self.bias)
        if not self.gather_output:
            return y
        # Gathered in rank order, each rank's piece holding its slice of every chunk: regroup by chunk.
        y = gather_from_parallel_region(y, self.group)
        return y.unflatten(-1, (self.tp_size, self.chunks, -1)).transpose(-3, -2).flatten(-3)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (local {self.weight.shape[0]}), "
            f"bias={self.bias is not None}, chunks={self.chunks}, gather_output={self.gather_output}"
        )


class RowParallelLinear(_ParallelLinear):
    """A linear layer holding this rank's slice of the input features ([Note: tensor-parallel slices]).

    Input: this rank's slice of the input features (``input_is_parallel=True``, the output of a
    :class:`ColumnParallelLinear`), or the full activation, of which it keeps its slice. Output: the full output,
    summed over the group by Megatron's g, plus the replicated bias. The constructor allocates uninitialised
    parameters of the local shapes; :meth:`from_module` fills them from a full layer.

    Args:
        in_features, out_features, bias: the full layer's (as ``nn.Linear``'s).
        group: the tensor-parallel process group; ``None`` is the world.
        input_is_parallel: the input is already this rank's slice (default); ``False``: the full input.
        device, dtype: of the parameters.
    """

    shard_dims: ClassVar[dict[str, int]] = {"weight": 1}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Any = None,
        input_is_parallel: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group)
        local = divide(in_features, self.tp_size, "in_features")
        self.in_features, self.out_features, self.input_is_parallel = in_features, out_features, input_is_parallel
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_module(cls, full: nn.Linear, group: Any = None, *, input_is_parallel: bool = True) -> RowParallelLinear:
        """This rank's slice of ``full`` (equal on every rank of ``group``), on its device and dtype; ``full`` is left
        untouched. The other arguments are the constructor's."""
        return cls._from_linear(full, group, input_is_parallel=input_is_parallel)

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel_region(x, self.group)
        y = reduce_from_parallel_region(F.linear(x, self.weight), self.group)
        # After the sum: added on every rank's partial sum, the bias would count N times.
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(TensorParallelModule):
    """An embedding holding this rank's rows of the vocabulary ([Note: tensor-parallel slices]).

    Input: token ids (every rank the same). Output: the full embeddings, summed over the group by Megatron's g
    (exactly one rank contributes each id's row, the others zeros). The constructor allocates an uninitialised
    table of the local shape; :meth:`from_module` fills it from a full embedding.

    Args:
        num_embeddings, embedding_dim: the full table's (as ``nn.Embedding``'s).
        group: the tensor-parallel process group; ``None`` is the world.
        device, dtype: of the table.
    """

    shard_dims: ClassVar[dict[str, int]] = {"weight": 0}

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: Any = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group)
        local = divide(num_embeddings, self.tp_size, "num_embeddings")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start = self.tp_rank * local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))

    @classmethod
    def from_module(cls, full: nn.Embedding, group: Any = None) -> VocabParallelEmbedding:
        """This rank's rows of ``full`` (equal on every rank of ``group``), on its device and dtype; ``full`` is left
        untouched.

        Raises:
            ValueError: ``full`` has a ``padding_idx``, ``max_norm``, ``scale_grad_by_freq`` or ``sparse``.
        """
        if full.padding_idx is not None or full.max_norm is not None or full.scale_grad_by_freq or full.sparse:
            raise ValueError(
                f"VocabParallelEmbedding takes a plain nn.Embedding: got padding_idx={full.padding_idx}, "
                f"max_norm={full.max_norm}, scale_grad_by_freq={full.scale_grad_by_freq}, sparse={full.sparse}"
            )
        layer = cls(full.num_embeddings, full.embedding_dim, group=group, **_factory(full.weight))
        layer._load_slices(full)
        return layer

    def _empty_full(self) -> nn.Module:
        return nn.Embedding(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype)

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])  # another rank's rows
        # Look up row 0 for those (any valid row), then zero them: their gradient into row 0 is zero too.
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return reduce_from_parallel_region(rows.masked_fill(elsewhere.unsqueeze(-1), 0.0), self.group)

    def extra_repr(self) -> str:
        start, stop = self.vocab_start, self.vocab_start + self.weight.shape[0]
        return f"{self.num_embeddings}, {self.embedding_dim}, rows=[{start}, {stop})"
