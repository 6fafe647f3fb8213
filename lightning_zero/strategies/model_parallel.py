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
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_zero.strategies.base import ScratchParallelStrategy
from lightning_zero.training.mesh import Mesh, MeshGroups

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


class ModelParallelStrategy(ScratchParallelStrategy):
    """Replicas x model-parallel ranks (see the module docstring).

    Subclasses set :attr:`size_setting` (the name of their size setting, for messages) and
    :attr:`broadcasts_buffers`, and implement :attr:`model_parallel_size`.

    Args:
        **kwargs: ``process_group_backend``, ``timeout``, ``start_method`` (see
            :class:`~lightning_zero.strategies.base.ScratchParallelStrategy`).
    """

    size_setting = "size"
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
