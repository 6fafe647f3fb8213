"""The base of the model-parallel strategies (``pipeline_scratch``, ``tensor_parallel_scratch``): a mesh of data
replicas x model-parallel ranks, and the settings such a split cannot run.

Both strategies put ``world / size`` replicas of ``size`` consecutive ranks on a
:class:`~lightning_zero.training.mesh.Mesh`, where ``size`` is the strategy's own setting (``stages``,
``tensor_parallel_size``; ``None``: every rank). The ranks of a replica read the same batches, the replicas disjoint
ones, as ``ddp``'s ranks. What neither runs is refused here, once, with the strategy's name:

- the data-parallel engine's settings (``find_unused_parameters``, ``param_dtype``, ...): the gradients cross the
  model-parallel ranks on the strategy's own paths, not through that engine;
- ``precision="16-mixed"``: its loss scaler's inf/NaN check would have to span the model-parallel ranks;
- ``sync_batchnorm=True``: the layer sync would run over every rank, the other model-parallel ranks included.

Checkpoints are Lightning's whole-model files by default (``state_dict_type="full"``: rank 0 writes what the
subclass gathers, with ``"parallel_layout"``); a subclass that takes ``state_dict_type="sharded"`` writes and reads
the directory below, implementing :meth:`ModelParallelStrategy.sharded_templates`.

[Note: sharded model-parallel checkpoints] ``trainer.save_checkpoint(PATH)`` (collective) writes a directory with
:func:`lightning_zero.zero.checkpoint.save_sharded`, each rank what it holds and nothing gathered::

    PATH/
      __R_0.distcp ...  DCP shards: "model.<key>" (the rank's state-dict entries) and "optimizer_<i>.state.<name>.<key>"
                        (optimizer i's state of each of the rank's parameters, keyed by the parameter's name); a tensor
                        several ranks hold (data-parallel replicas, entries outside the split) is written once
      .metadata         DCP's index: every tensor's shape and dtype, and the file that holds it
      meta.pt           the rest of Lightning's checkpoint (loops, callbacks, hyper-parameters, "lr_schedulers"),
                        "parallel_layout", and "optimizer_param_groups": each optimizer's param_groups, parameters
                        given by name

Names, not positions or ranks, say whose state is whose, so the directory loads at any layout: each rank builds
templates of the tensors it holds in that layout and reads only those (DCP). Every file the index names is checked
first, so a missing ``meta.pt`` or a missing or truncated shard is refused with a
:class:`~lightning_zero.training.checkpoint_checks.CheckpointError` naming it, before any weight changes. The
checkpoint then goes through Lightning's restore as a file's would: ``"state_dict"`` holds this rank's entries, and
``"optimizer_states"`` each optimizer's state keyed by name, as the subclass's ``optimizer_state`` wrote it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from typing_extensions import override

from lightning_zero.strategies.base import ScratchParallelStrategy
from lightning_zero.training.checkpoint_checks import CheckpointError, check_shapes, shapes_of
from lightning_zero.training.mesh import Mesh, MeshGroups
from lightning_zero.zero.checkpoint import (
    META_FILE,
    is_sharded_checkpoint,
    load_tensors,
    read_meta,
    read_metadata,
)
from lightning_zero.zero.checkpointing import MODEL, OPTIMIZERS, PARAM_GROUPS, save_split

DATA_PARALLEL_SETTINGS = (
    "find_unused_parameters",
    "broadcast_buffers",
    "param_dtype",
    "reduce_dtype",
    "master_weights",
    "cast_module",
    "activation_checkpointing_policy",
)
"""The keyword arguments of :class:`~lightning_zero.strategies.base.ScratchParallelStrategy` a model-parallel
strategy refuses."""

STATE_DICT_TYPES = ("full", "sharded")


def check_state_dict_type(state_dict_type: str) -> str:
    """``state_dict_type``, if it is one of :data:`STATE_DICT_TYPES`."""
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(f"state_dict_type={state_dict_type!r} is invalid: expected 'full' or 'sharded'")
    return state_dict_type


def parameter_names(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[str]:
    """The name in ``module`` of each of ``optimizer``'s parameters, in the order its ``state_dict`` numbers them."""
    names = {id(p): name for name, p in module.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def rekey_optimizer_state(state: dict[str, Any], keys: Mapping[Any, Any]) -> dict[str, Any]:
    """``state`` (an optimizer ``state_dict``) with each parameter's key ``k`` replaced by ``keys[k]``: positions to
    names (``dict(enumerate(names))``) or back; a key ``keys`` lacks is refused by name."""
    unknown = sorted({k for group in state["param_groups"] for k in group["params"]} - set(keys), key=str)
    if unknown:
        raise ValueError(f"optimizer state of the parameters {unknown}, which this model does not have")
    return {
        "state": {keys[k]: v for k, v in state["state"].items()},
        "param_groups": [{**group, "params": [keys[k] for k in group["params"]]} for group in state["param_groups"]],
    }


def by_position(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """An optimizer state read from a file (keyed by position) or a sharded checkpoint (keyed by name, as
    :func:`rekey_optimizer_state` wrote it), keyed by position; ``names``: the parameters' names in position order."""
    if any(isinstance(k, str) for group in state["param_groups"] for k in group["params"]):
        return rekey_optimizer_state(dict(state), {name: i for i, name in enumerate(names)})
    return dict(state)


def optimizer_state_template(names: Sequence[str], metadata: Metadata, prefix: str) -> dict[str, dict[str, Any]]:
    """What DCP loads the saved state of the parameters ``names`` into (``<prefix>.state.<name>.<key>`` in the index
    ``metadata`` of a sharded checkpoint): CPU tensors of the saved shape and dtype, ``None`` for other values."""
    heads = {f"{prefix}.state.{name}": name for name in names}
    state: dict[str, dict[str, Any]] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        head, _, key = fqn.rpartition(".")
        if head in heads:
            tensor = isinstance(item, TensorStorageMetadata)
            value = torch.empty(item.size, dtype=item.properties.dtype) if tensor else None
            state.setdefault(heads[head], {})[key] = value
    return state


class ModelParallelStrategy(ScratchParallelStrategy):
    """Replicas x model-parallel ranks (see the module docstring).

    Subclasses set :attr:`size_setting` (the name of their size setting, for messages) and
    :attr:`broadcasts_buffers`, and implement :attr:`model_parallel_size`; those that write sharded checkpoints take
    :attr:`state_dict_type` as a setting (:func:`check_state_dict_type`) and implement :meth:`sharded_templates`.

    Args:
        **kwargs: ``process_group_backend``, ``timeout``, ``start_method`` (see
            :class:`~lightning_zero.strategies.base.ScratchParallelStrategy`).
    """

    size_setting = "size"
    state_dict_type = "full"
    """``"full"`` (Lightning's file) or ``"sharded"`` (a directory; [Note: sharded model-parallel checkpoints])."""
    broadcasts_buffers = True
    """Whether rank 0's buffers are broadcast as ``ddp`` does ([Note: buffer broadcast] in
    ``lightning_zero/strategies/base.py``)."""

    def __init__(self, **kwargs: Any) -> None:
        refused = sorted(set(kwargs) & set(DATA_PARALLEL_SETTINGS))
        if refused:
            raise ValueError(f"{self.strategy_name} does not take {refused}: data-parallel settings it does not run")
        super().__init__(broadcast_buffers=self.broadcasts_buffers, **kwargs)
        self.groups: MeshGroups | None = None

    @property
    def model_parallel_size(self) -> int | None:
        """Ranks per model replica (``None``: every rank)."""
        raise NotImplementedError

    @property
    def mesh(self) -> Mesh:
        """Replicas x model-parallel ranks of this run."""
        return Mesh(self.world_size, self.model_parallel_size or self.world_size, name=self.size_setting)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The ranks of a replica read the same batches; the replicas read disjoint ones, as ``ddp``'s ranks."""
        replica, _ = self.mesh.coordinates(self.global_rank)
        return {"num_replicas": self.mesh.data_size, "rank": replica}

    @override
    def _check_before_launch(self) -> None:
        super()._check_before_launch()
        if self._lightning_precision() in ("16-mixed", "16"):
            raise ValueError(
                f"{self.strategy_name} does not run precision='16-mixed': its loss scaler's inf/NaN check would have"
                " to span the model-parallel ranks; use 'bf16-mixed', 'bf16-true' or '32-true'"
            )
        if self._layer_sync is not None:
            raise ValueError(
                f"{self.strategy_name} does not take sync_batchnorm=True: the layer sync would run over every rank,"
                " the other model-parallel ranks included"
            )
        world = self.num_processes * self.num_nodes
        if world:
            Mesh(world, self.model_parallel_size or world, name=self.size_setting)  # a divisor of the world size

    # ------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """``"full"``: Lightning's file from rank 0; ``"sharded"``: a directory, each rank writing the ``"state_dict"``
        and ``"optimizer_states"`` it holds ([Note: sharded model-parallel checkpoints]; collective)."""
        if self.state_dict_type == "full":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        save_split(filepath, {**checkpoint, "parallel_layout": self.layout})

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A file as :class:`~lightning_zero.strategies.base.ScratchParallelStrategy` reads it, whatever
        :attr:`state_dict_type`; a sharded directory into :meth:`sharded_templates`, this rank's tensors only, every
        file checked first ([Note: sharded model-parallel checkpoints])."""
        path = Path(checkpoint_path)
        if not path.is_dir():
            return super().load_checkpoint(checkpoint_path, weights_only)
        if not is_sharded_checkpoint(path):
            raise CheckpointError(f"sharded checkpoint {path} has no {META_FILE}: its save did not finish")
        checkpoint, metadata = read_meta(path), read_metadata(path)
        tensors = self.sharded_templates(metadata)
        saved = {
            fqn.removeprefix("model."): item.size
            for fqn, item in metadata.state_dict_metadata.items()
            if fqn.startswith("model.") and isinstance(item, TensorStorageMetadata)
        }
        check_shapes(path, saved, shapes_of(tensors["model"]))
        load_tensors(path, tensors)
        checkpoint[MODEL] = tensors["model"]
        checkpoint[OPTIMIZERS] = [
            {**tensors.get(f"optimizer_{i}", {"state": {}}), "param_groups": groups}
            for i, groups in enumerate(checkpoint.pop(PARAM_GROUPS, []))
        ]
        return checkpoint

    def sharded_templates(self, metadata: Metadata) -> dict[str, Any]:
        """What this rank reads of a sharded checkpoint whose DCP index is ``metadata``: ``"model"`` (state-dict
        entries) and ``"optimizer_<i>"`` (``{"state": {name: {key: tensor}}}``), tensors DCP fills in place."""
        raise NotImplementedError(f"{self.strategy_name} does not read sharded checkpoints")
