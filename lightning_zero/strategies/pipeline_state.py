"""The checkpoint state of ``pipeline_scratch``: this stage's weights and optimizer state, as a whole-model file or
a sharded directory (:class:`StageState`).

**Checkpoints** (``trainer.save_checkpoint`` is collective, as ``ModelCheckpoint`` calls it) are Lightning's plain
files by default (``state_dict_type="full"``), in the unsplit model's layout: rank 0 gathers every stage's weights and
optimizer state. With ``state_dict_type="sharded"`` nothing is gathered: each rank writes its stage's weights and
optimizer state, keyed by parameter name, into a directory ([Note: sharded model-parallel checkpoints] in
``lightning_zero/strategies/model_parallel.py``). A resume loads either kind (whatever ``state_dict_type``) after the
stages are built, at any number of stages, balance or replicas: each rank keeps its stage's part of a file, and reads
only its stage's tensors of a directory. Every rank keeps the unsplit model's names and optimizer order, so both
kinds are read and written for the real tensors only ([Note: stage placeholders] in
``lightning_zero/pipeline/placement.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.optim import Optimizer

from lightning_zero.comm import collectives as comm
from lightning_zero.pipeline import placement
from lightning_zero.strategies.model_parallel import (
    by_position,
    optimizer_state_template,
    parameter_names,
    rekey_optimizer_state,
)
from lightning_zero.training.mesh import MeshGroups


@dataclass
class StageState:
    """The checkpoint state of this stage of ``module``; ``sharded``: ``state_dict_type="sharded"``. The methods of a
    ``"full"`` save are collective over the pipeline's ranks.

    Args:
        module: the LightningModule, this stage's layers real and the others' placeholders.
        groups: this rank's pipeline (``model_group``) and replica (``None`` before setup: nothing to gather).
        sharded: each rank's own state (``"sharded"``), else every stage's gathered on rank 0 (``"full"``).
    """

    module: nn.Module
    groups: MeshGroups | None
    sharded: bool

    def model_state(self) -> dict[str, Any]:
        """This stage's weights (``"sharded"``), or every stage's gathered on rank 0 (``"full"``; the other ranks
        return their own)."""
        keys = placement.real_keys(self.module)
        own = {k: v.detach().cpu() for k, v in self.module.state_dict().items() if k in keys}
        gathered = None if self.sharded else self._gather_on_rank_zero(own)
        if gathered is None:
            return own
        return {k: v for state in gathered for k, v in state.items()}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state for this stage's parameters keyed by name (``"sharded"``), or for every stage's
        gathered on rank 0 (``"full"``)."""
        own = placement.select_optimizer_state(optimizer.state_dict(), placement.owned_positions(optimizer))
        if self.sharded:
            names = parameter_names(optimizer, self.module)
            return rekey_optimizer_state(own, dict(enumerate(names)))
        gathered = self._gather_on_rank_zero(own)
        return placement.merge_optimizer_states(gathered) if gathered is not None else own

    def _gather_on_rank_zero(self, obj: Any) -> list[Any] | None:
        """Every stage's ``obj`` of the first replica on rank 0 (the replicas hold the same); ``None`` elsewhere."""
        assert self.groups is not None
        if self.groups.replica != 0:
            return None
        return comm.gather_object(obj, 0, group=self.groups.model_group, tag="pipeline/checkpoint")

    def templates(self, metadata: Metadata, optimizers: Sequence[Optimizer]) -> dict[str, Any]:
        """This stage's state-dict entries the checkpoint holds and each of ``optimizers``' state of this stage's
        parameters, by name."""
        keys, saved = placement.real_keys(self.module), metadata.state_dict_metadata
        model = {
            k: torch.empty_like(v) for k, v in self.module.state_dict().items() if k in keys and f"model.{k}" in saved
        }
        tensors: dict[str, Any] = {"model": model}
        for i, optimizer in enumerate(optimizers):
            names = parameter_names(optimizer, self.module)
            own = [names[position] for position in sorted(placement.owned_positions(optimizer))]
            tensors[f"optimizer_{i}"] = {"state": optimizer_state_template(own, metadata, f"optimizer_{i}")}
        return tensors

    def load_model(self, state: dict[str, Any], strict: bool) -> None:
        """This stage's weights (and everything outside the pipelined layers) from a whole-model state dict, or from
        a sharded one (which holds only those)."""
        keys = placement.real_keys(self.module)
        result = self.module.load_state_dict({k: v for k, v in state.items() if k in keys}, strict=False)
        unexpected = [k for k in state if k not in self.module.state_dict()]
        missing = [k for k in result.missing_keys if k in keys]
        if strict and (missing or unexpected):
            raise RuntimeError(f"pipeline_scratch: checkpoint keys missing {missing}, unexpected {unexpected}")

    def load_optimizer(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        """``optimizer``'s state for this stage's parameters, keyed by position (a file) or by name (a sharded
        checkpoint)."""
        state = by_position(state, parameter_names(optimizer, self.module))
        optimizer.load_state_dict(placement.select_optimizer_state(state, placement.owned_positions(optimizer)))
