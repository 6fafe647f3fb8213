"""Checkpoints of a model and its ZeRO engine, in the one layout the Trainer and Fabric front ends share.

[Note: checkpoint layout] A checkpoint is a dict with Lightning's Trainer keys for the model and the optimizer, so
one written by ``trainer.save_checkpoint`` loads with ``fabric.load`` under the same strategy, and the other way:

- ``"state_dict"``: the model's ``state_dict()`` (the module set up by the strategy; under the Trainer, the
  LightningModule).
- ``"optimizer_states"``: a list with each optimizer's state in the format of the unsharded ``torch.optim``
  optimizer, in the order ``configure_optimizers`` returned them.
- ``"lr_schedulers"``: a list of the schedulers' ``state_dict()`` (Fabric: the ``LRScheduler`` objects of the saved
  state, in its order).
- anything else under its own key: the Trainer's loops, callbacks and hyper-parameters; Fabric's other state
  entries (``state_dict()`` of an object that has one, else the value).

A *full* checkpoint is that dict in one file written by rank 0 (``torch.load`` and
``LightningModule.load_from_checkpoint`` read it without lightning_zero). A *sharded* checkpoint is a directory
(:mod:`lightning_zero.zero.checkpoint`): the tensors of ``"state_dict"`` under ``model.`` and the optimizer's
per-element state under ``optimizer_0.`` go to DCP, each rank writing what it owns, and ``meta.pt`` holds the rest,
the optimizer's ``param_groups`` as ``"optimizer_param_groups"``. Either kind loads at any world size.

[Note: checkpoint info] Both kinds also carry ``"lightning_zero"`` (:meth:`ZeroCheckpointer.info`): the stage, the
world size and shard size it was written at, the parameter names of each optimizer param group in the user's order
(``param_groups``: the groups of every optimizer, one after the other; ``groups_per_optimizer``: how many each has),
and the trainable parameters in registration order (a stage-1/2 flat group lays its trainable parameters out in that
order). With these, ``lightning-zero-ckpt`` (:mod:`lightning_zero.tools.ckpt`) reads and converts a checkpoint
offline, without the model's code or any process: a sharded optimizer state is keyed by parameter name (stage 3) or
is one flat tensor per param group (stages 1 and 2), and the names say which elements are whose. Loading drops the
entry again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_zero.comm import collectives as comm
from lightning_zero.training.checkpoint_checks import (
    CheckpointError,
    check_format,
    check_shapes,
    reading,
    shapes_of,
)
from lightning_zero.zero import stage12_state as so_state
from lightning_zero.zero.checkpoint import (
    META_FILE,
    is_sharded_checkpoint,
    load_tensors,
    read_meta,
    read_metadata,
    save_sharded,
)
from lightning_zero.zero.optimizer_checks import index_of
from lightning_zero.zero.stage3 import state as sp_state
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage12 import ShardedOptimizer

MODEL, OPTIMIZERS, SCHEDULERS = "state_dict", "optimizer_states", "lr_schedulers"
PARAM_GROUPS = "optimizer_param_groups"  # sharded checkpoints: each optimizer's param_groups, in meta.pt
INFO, INFO_FORMAT = "lightning_zero", 1  # [Note: checkpoint info]


def save_split(path: str | Path, checkpoint: dict[str, Any]) -> None:
    """Write ``checkpoint`` (the layout above) as a sharded checkpoint: ``"state_dict"`` under ``model.`` and each
    optimizer's ``"state"`` under ``optimizer_<i>.`` to DCP, the rest to ``meta.pt`` with the optimizers'
    ``param_groups`` as ``"optimizer_param_groups"`` (collective)."""
    meta = dict(checkpoint)
    tensors: dict[str, Any] = {"model": meta.pop(MODEL)}
    optimizer_states = meta.pop(OPTIMIZERS, [])
    tensors.update({f"optimizer_{i}": {"state": state["state"]} for i, state in enumerate(optimizer_states)})
    meta[PARAM_GROUPS] = [state["param_groups"] for state in optimizer_states]
    save_sharded(path, tensors, meta=meta)


class ZeroCheckpointer:
    """Model and optimizer state of ``module`` under ``engine`` (``None``: stages 1 and 2 before or outside a fit,
    when the model is whole and no optimizer is sharded), full or sharded per ``sharded``.

    ``order``: the engine's optimizers in the order of the checkpoint's ``"optimizer_states"`` (default: the
    engine's own, which is the Trainer's; Fabric's is the order of its ``state`` dict). Every method is collective:
    each rank calls it, in the same order.
    """

    def __init__(
        self,
        module: nn.Module,
        engine: ShardedOptimizer | ShardedParams | None,
        sharded: bool,
        order: Sequence[torch.optim.Optimizer] | None = None,
    ) -> None:
        self.module, self.engine, self.sharded = module, engine, sharded
        self.params = engine if isinstance(engine, ShardedParams) else None
        sharded_optimizers = engine.optimizers if engine is not None else []
        self.order = list(range(len(sharded_optimizers))) if order is None else [self.index(o) for o in order]

    def index(self, optimizer: torch.optim.Optimizer) -> int:
        """``optimizer``'s position among the engine's optimizers."""
        return index_of(self.engine.optimizers if self.engine is not None else [], optimizer)

    def _stage12(self) -> ShardedOptimizer:
        """The stage-1/2 engine, where ``self.params`` is ``None`` and an optimizer is sharded."""
        assert isinstance(self.engine, ShardedOptimizer)
        return self.engine

    @property
    def has_optimizer(self) -> bool:
        return bool(self.order)

    # ------------------------------------------------------------ saving
    def info(self) -> dict[str, Any]:
        """[Note: checkpoint info]: ``format``, ``world_size``, ``sharded``, ``trainable`` (names in registration
        order) and, with an engine, ``stage``, ``shard_size`` (ranks a shard is split over) and ``param_groups``
        (names per group, in the user's order)."""
        named = list(self.module.named_parameters())
        names = {id(p): name for name, p in named}
        out: dict[str, Any] = {"format": INFO_FORMAT, "world_size": comm.world_size(), "sharded": self.sharded}
        out["trainable"] = [name for name, p in named if p.requires_grad]
        if self.params is not None:
            groups_of = self.params.original_groups_of
            out.update(stage=3, shard_size=self.params.world_size)
        elif isinstance(self.engine, ShardedOptimizer):
            shards = [self.engine.shards(k) for k in range(len(self.engine.optimizers))]
            groups_of = [[g.original_params for g in part.groups] for part in shards]
            out.update(stage=self.engine.stage, shard_size=self.engine.world_size)
        else:
            return out
        ordered = [groups_of[k] for k in self.order]
        out["param_groups"] = [[names[id(p)] for p in group] for groups in ordered for group in groups]
        out["groups_per_optimizer"] = [len(groups) for groups in ordered]
        return out

    def model_state(self) -> dict[str, Any]:
        """Stage 3: the weights gathered (full: rank 0) or as per-parameter DTensors; stages 1 and 2: the module's."""
        if self.params is None:
            return self.module.state_dict()
        return sp_state.model_state_dict(self.params, sharded=self.sharded)

    def optimizer_state(self, k: int = 0) -> dict[str, Any]:
        """This rank's share of optimizer ``k``'s state (full: rank 0 holds all of it, in the unsharded format)."""
        if self.params is not None:
            return sp_state.optimizer_state_dict(self.params, sharded=self.sharded, k=k)
        shards = self._stage12().shards(k)
        return so_state.sharded_state_dict(shards) if self.sharded else so_state.full_state_dict(shards)

    def save(self, checkpoint: dict[str, Any], path: str | Path, write_full: Callable[[dict[str, Any]], None]) -> None:
        """Write ``checkpoint`` (the layout above): a DCP directory, or through ``write_full`` (rank 0's file)."""
        checkpoint = {**checkpoint, INFO: self.info()}
        if not self.sharded:
            return write_full(checkpoint)
        save_split(path, checkpoint)

    # ------------------------------------------------------------ loading
    def load(self, path: str | Path, read_full: Callable[[str | Path], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
        """Load either kind, saved at any world size, into the engine's optimizer and, for sharded checkpoints, into
        the model (in place, strictly: DCP reads each tensor the model has). Returns the checkpoint and whether the
        model was loaded: if not (full files), the front end loads ``checkpoint["state_dict"]`` with
        :meth:`load_model`, with its own hooks and strictness. A sharded checkpoint comes back with this rank's pieces
        under ``"state_dict"`` and ``"optimizer_states"``."""
        if Path(path).is_dir() and not is_sharded_checkpoint(path):
            raise CheckpointError(f"sharded checkpoint {path} has no {META_FILE}: its save did not finish")
        if not is_sharded_checkpoint(path):
            with reading(path):
                checkpoint = read_full(path)
            check_format(path, checkpoint.pop(INFO, None) or {}, INFO_FORMAT)
            check_shapes(path, shapes_of(checkpoint.get(MODEL, {})), self._model_shapes())
            for k, optimizer_state in zip(self.order, checkpoint.get(OPTIMIZERS) or []):
                if optimizer_state:
                    self.load_optimizer(optimizer_state, k)
            return checkpoint, False  # the front end loads the model, with its strictness, through load_model
        metadata, checkpoint = read_metadata(path), read_meta(path)
        info = checkpoint.pop(INFO, {})
        check_format(path, info, INFO_FORMAT)
        if self.has_optimizer:
            self._check_optimizer_layout(path, metadata, info)
        # Stage 1/2: views of the parameters, loaded in place. Stage 3: per-parameter DTensors.
        model_state = sp_state.model_template(self.params) if self.params is not None else self.module.state_dict()
        saved = {k[len("model.") :]: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
        check_shapes(path, {k: v.size for k, v in saved.items() if hasattr(v, "size")}, self._model_shapes())
        tensors: dict[str, Any] = {"model": model_state}
        for i, k in enumerate(self.order):
            prefix = f"optimizer_{i}"
            if any(fqn.startswith(f"{prefix}.") for fqn in metadata.state_dict_metadata):
                tensors[prefix] = (
                    sp_state.optimizer_template(self.params, metadata, prefix)
                    if self.params is not None
                    else so_state.sharded_template(self._stage12().shards(k), metadata, prefix)
                )
        load_tensors(path, tensors)
        param_groups = checkpoint.pop(PARAM_GROUPS, [])
        if self.params is not None:
            sp_state.load_model_state_dict(self.params, model_state)
        checkpoint[MODEL] = model_state
        # A stateless optimizer (SGD without momentum) saves no tensor, but its hyper-parameters (the LR a scheduler
        # has moved) are in meta.pt and must come back all the same.
        checkpoint[OPTIMIZERS] = [
            {**tensors.get(f"optimizer_{i}", {"state": {}}), "param_groups": groups}
            for i, groups in enumerate(param_groups)
        ]
        for k, state in zip(self.order, checkpoint[OPTIMIZERS]):
            if self.params is not None:
                sp_state.load_optimizer_state_dict(self.params, state, state["param_groups"], k)
            else:
                so_state.load_sharded_state_dict(self._stage12().shards(k), state, state["param_groups"])
        if isinstance(self.engine, ShardedOptimizer):
            self.engine.sync_after_load()  # master shards and parameters agree again
        return checkpoint, True

    def _model_shapes(self) -> dict[str, tuple[int, ...]]:
        """The full shape of every tensor of the model's state dict (stage 3: of the unsharded parameters)."""
        if self.params is None:
            return shapes_of(self.module.state_dict())
        with self.params.reading_placeholders():
            return shapes_of(self.module.state_dict(keep_vars=True))

    def _check_optimizer_layout(self, path: str | Path, metadata: Any, info: dict[str, Any]) -> None:
        """Refuse a sharded optimizer state of the other layout: stages 1 and 2 keep one flat tensor per param group,
        stage 3 one tensor per parameter, and DCP would silently load none of the other's (it loads what the
        templates ask for). The stage comes from [Note: checkpoint info], or from the keys in older checkpoints."""
        keys = [fqn for fqn in metadata.state_dict_metadata if fqn.startswith("optimizer_0.state.")]
        if not keys:
            return
        if "stage" in info:
            flat, saved = info["stage"] in (1, 2), f"stage {info['stage']}"
        else:
            flat = all(k.startswith("optimizer_0.state.group") for k in keys)
            saved = "stage 1 or 2" if flat else "stage 3"
        mine = 3 if self.params is not None else self._stage12().stage
        if flat != (mine != 3):
            layout = "one flat tensor per param group" if flat else "one tensor per parameter"
            raise CheckpointError(
                f"{path} holds a {saved} sharded optimizer state ({layout}), which stage {mine} cannot read: convert"
                f" it first (lightning-zero-ckpt convert {path} NEW --stage {mine}), or resume from a full checkpoint"
                " (state_dict_type='full'), which any stage reads"
            )

    def load_optimizer(self, state: dict[str, Any], k: int = 0) -> None:
        """Optimizer ``k``'s state in the unsharded optimizer's format (any world size) into the shards."""
        if self.params is not None:
            sp_state.load_optimizer_state_dict(self.params, state, state["param_groups"], k)
        else:
            so_state.load_full_state_dict(self._stage12().shards(k), state)

    def load_model(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """A full model state into the model (stage 3: into the shards), as ``nn.Module.load_state_dict`` would."""
        if self.params is not None:
            return sp_state.load_model_state_dict(self.params, state_dict, strict)
        self.module.load_state_dict(state_dict, strict=strict)
        if isinstance(self.engine, ShardedOptimizer):
            self.engine.sync_after_load()  # master shards and parameters agree again
