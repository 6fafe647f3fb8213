"""The checkpoint state of ``tensor_parallel_scratch``: a parallelized module's slices and their optimizer state, as a
whole-model file or a sharded directory, under each ZeRO stage's engine.

[Note: tensor-parallel checkpoint state] A rank holds slice ``i`` of every sharded entry (``sharded_entries``) and
every replicated one. The optimizer state of a slice's parameter has the slice's shape; under ZeRO it exists only as
the data group's shards, so it is first gathered to the data group's first rank (replica 0), in the unsharded
optimizer's format (numbered as the module's parameters it was built over: :meth:`SliceState.params`). Then:

- *full* (one file, rank 0): each state tensor of a sliced parameter is gathered over the tensor-parallel group
  (``unshard``) and the weights with :func:`full_state_dict`: the plain model's state dict and optimizer state.
- *sharded* (a DCP directory, [Note: sharded model-parallel checkpoints] in
  ``lightning_zero/strategies/model_parallel.py``): each such tensor, and each slice of the weights, becomes a DTensor
  of the whole entry ([Note: tensor-parallel DTensors] in ``lightning_zero/tensor_parallel/checkpoint.py``), the
  optimizer state keyed by parameter name; nothing crosses the tensor-parallel group.

Loading takes either: a full tensor is sliced (``shard``), a DTensor is this rank's slice already; the optimizer
state then goes to the engine, which keeps this rank's ZeRO shard of it. After a fit the module is whole again
(``unparallelize``) while the optimizer still holds the slices: a save then slices the whole weights as the fit's
layers did.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero.strategies.model_parallel import by_position, optimizer_state_template, rekey_optimizer_state
from lightning_zero.tensor_parallel import full_state_dict, shard_state_dict, unshard
from lightning_zero.tensor_parallel.checkpoint import checkpoint_shape, template, to_dtensor
from lightning_zero.tensor_parallel.layers import TensorParallelModule
from lightning_zero.tensor_parallel.plan import slice_of
from lightning_zero.training.checkpoint_checks import shapes_of
from lightning_zero.zero import stage12_state
from lightning_zero.zero.stage3 import state as sp_state
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage12 import ShardedOptimizer

Split = tuple[TensorParallelModule, int]
"""A sharded entry's layer and the dimension it is split along."""
MapValue = Callable[[Any, Tensor, TensorParallelModule, int], Any]


@dataclass
class SliceState:
    """The checkpoint state of ``module`` (see [Note: tensor-parallel checkpoint state]); every method that gathers is
    collective over the groups it names.

    Args:
        module: the LightningModule, parallelized or (after a fit) whole again.
        engine: the ZeRO engine of the last fit (``None``: ``zero_stage=0`` or one replica).
        entries: the sharded state-dict keys of the last ``parallelize``.
        slices: ``id(parameter)`` of each sliced parameter the optimizers were built over, to its split.
        names: ``id(parameter)`` to its name, for the parameters the optimizers were built over.
        parallelized: whether ``module`` holds the slices now.
    """

    module: nn.Module
    engine: ShardedOptimizer | ShardedParams | None
    entries: dict[str, Split]
    slices: dict[int, Split]
    names: dict[int, str]
    parallelized: bool

    # ------------------------------------------------------------ saving
    def model_state(self, sharded: bool) -> dict[str, Any]:
        """The whole model's weights (full: a collective over each tensor-parallel group), or each slice as a DTensor
        (sharded); ZeRO-3 first gathers each slice over its data group."""
        engine = self.engine
        with engine.summon_full_params() if isinstance(engine, ShardedParams) else nullcontext():
            if not sharded:
                return {k: v.detach().cpu() for k, v in full_state_dict(self.module).items()}
            state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        for key, (layer, dim) in self.entries.items():
            state[key] = to_dtensor(state[key] if self.parallelized else slice_of(state[key], layer, dim), layer, dim)
        return state

    def optimizer_state(self, optimizer: Optimizer, sharded: bool) -> dict[str, Any]:
        """``optimizer``'s state of the unsharded model (full: gathered over each tensor-parallel group), or of this
        rank's slices as DTensors keyed by name (sharded). Under ZeRO only the ranks of replica 0 hold any state."""

        def gather(value: Any, p: Tensor, layer: TensorParallelModule, dim: int) -> Any:
            if isinstance(value, Tensor) and value.shape == p.shape:
                return unshard(value.to(p.device), dim, layer.group, layer.chunks)
            return value

        def as_dtensor(value: Any, p: Tensor, layer: TensorParallelModule, dim: int) -> Any:
            return to_dtensor(value, layer, dim) if isinstance(value, Tensor) and value.shape == p.shape else value

        engine, params = self.engine, self.params(optimizer)
        if isinstance(engine, ShardedParams):
            state = sp_state.optimizer_state_dict(engine, sharded=False)
        else:
            state = stage12_state.full_state_dict(engine.shards(0)) if engine is not None else optimizer.state_dict()
        if not sharded:
            return self._map(params, state, gather)
        return rekey_optimizer_state(self._map(params, state, as_dtensor), dict(enumerate(self._names(params))))

    # ------------------------------------------------------------ loading
    def templates(self, metadata: Metadata, optimizer: Optimizer | None) -> dict[str, Any]:
        """What this rank reads of a sharded checkpoint: DTensor templates of its slices and the replicated entries
        the checkpoint holds, and with ``optimizer`` (in a fit) its slices' optimizer state by name."""
        saved = metadata.state_dict_metadata
        model = {
            k: template(v, *self.entries[k])
            if k in self.entries
            else torch.empty(v.shape, dtype=v.dtype, device=v.device)
            for k, v in self._local_state().items()
            if f"model.{k}" in saved
        }
        tensors: dict[str, Any] = {"model": model}
        if optimizer is not None:
            params = self.params(optimizer)
            named = optimizer_state_template(self._names(params), metadata, "optimizer_0")
            for name, p in zip(self._names(params), params):
                if id(p) in self.slices and name in named:
                    layer, dim = self.slices[id(p)]
                    full = checkpoint_shape(p, layer, dim)
                    named[name] = {
                        key: template(p, layer, dim, v.dtype) if isinstance(v, Tensor) and v.shape == full else v
                        for key, v in named[name].items()
                    }
            tensors["optimizer_0"] = {"state": named}
        return tensors

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """The unparallelized model's shapes: each slice's split dimension times the tensor-parallel size."""
        shapes = shapes_of(self._local_state())
        for key, (layer, dim) in self.entries.items():
            shapes[key] = (*shapes[key][:dim], shapes[key][dim] * layer.tp_size, *shapes[key][dim + 1 :])
        return shapes

    def load_model(self, state: Mapping[str, Any], strict: bool) -> None:
        """A whole-model state dict (sliced here) or this rank's slices of a sharded checkpoint, into the module, or
        under ZeRO-3 into its shards."""
        engine = self.engine
        sliced = shard_state_dict(self.module, state)
        if isinstance(engine, ShardedParams) and not engine.released:
            sp_state.load_model_state_dict(engine, sliced, strict)
            return
        self.module.load_state_dict(sliced, strict=strict)
        if isinstance(engine, ShardedOptimizer):
            engine.sync_after_load()  # its shards from the loaded parameters

    def load_optimizer(self, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
        """An optimizer state of the whole model (numbered) or of this rank's slices (by name), each sliced
        parameter's state tensors sliced like the parameter, into ``optimizer`` or the engine's shards."""

        def slice_(value: Any, p: Tensor, layer: TensorParallelModule, dim: int) -> Any:
            full = list(p.shape)
            full[dim] *= layer.tp_size
            if isinstance(value, DTensor) or (isinstance(value, Tensor) and list(value.shape) == full):
                return slice_of(value, layer, dim)
            return value

        params = self.params(optimizer)
        sliced = self._map(params, by_position(state, self._names(params)), slice_)
        if isinstance(self.engine, ShardedParams):
            sp_state.load_optimizer_state_dict(self.engine, sliced, sliced["param_groups"])
        elif self.engine is not None:
            stage12_state.load_full_state_dict(self.engine.shards(0), sliced)  # each rank keeps its ZeRO shard of it
        else:
            optimizer.load_state_dict(sliced)

    # ------------------------------------------------------------ helpers
    def params(self, optimizer: Optimizer) -> list[Tensor]:
        """The parameters an unsharded state dict of ``optimizer`` numbers, in order: under ZeRO the module's slices
        it was built over (its param groups now hold the engine's shards)."""
        if isinstance(self.engine, ShardedParams):
            return [p for group in self.engine.original_groups for p in group]
        if self.engine is not None:
            return [p for g in self.engine.groups for p in g.original_params]
        return [p for group in optimizer.param_groups for p in group["params"]]

    def _names(self, params: list[Tensor]) -> list[str]:
        return [self.names[id(p)] for p in params]

    def _local_state(self) -> dict[str, Tensor]:
        """The module's state dict as it is on this rank, its slices' local shapes (ZeRO-3: the placeholders', for
        their keys and shapes only)."""
        engine = self.engine
        with engine.reading_placeholders() if isinstance(engine, ShardedParams) else nullcontext():
            return self.module.state_dict(keep_vars=True)

    def _map(self, params: list[Tensor], state: Mapping[str, Any], fn: MapValue) -> dict[str, Any]:
        """``state`` (an optimizer state dict numbering ``params``) with ``fn(value, p, layer, dim)`` applied to every
        state value of each sliced parameter ``p``, in parameter order (the same on every rank); ``state``'s own
        dicts are not changed (``optimizer.state_dict()`` shares them with the live state)."""
        per_param = dict(state["state"])
        for index, p in enumerate(params):
            if index in per_param and id(p) in self.slices:
                layer, dim = self.slices[id(p)]
                per_param[index] = {key: fn(value, p, layer, dim) for key, value in per_param[index].items()}
        return {**state, "state": per_param}
