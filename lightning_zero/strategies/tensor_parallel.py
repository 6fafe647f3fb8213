"""``tensor_parallel_scratch``: Megatron-LM tensor parallelism x data parallelism as a Lightning strategy.

Runbook::

    import lightning_zero  # registers the names below
    from lightning_zero.demo.model import CharGPTModule
    from lightning_zero.tensor_parallel import GPT_PLAN

    module = CharGPTModule(vocab_size=64, n_head=4, n_embd=96)
    strategy = lightning_zero.TensorParallelStrategy(tensor_parallel_size=2, plan=GPT_PLAN, plan_root="net")
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy)  # 2 data replicas x 2 tensor-parallel ranks
    trainer.fit(module, datamodule)

Registered names: ``tensor_parallel_scratch`` (popen launcher) and ``tensor_parallel_scratch_spawn``: one
tensor-parallel group over every rank, and the module's own plan (below).

**The plan** (:mod:`lightning_zero.tensor_parallel.plan`: module-name patterns to styles) comes from, in order:

1. the ``plan`` setting: a mapping, or the import path of one (``"lightning_zero.tensor_parallel.GPT_PLAN"``, for a
   Hydra config), its keys relative to the submodule ``plan_root`` names (``plan_root="net"``: the key ``"wte"`` is
   the LightningModule's ``net.wte``; default ``""``: the LightningModule itself);
2. else the LightningModule's ``tensor_parallel_plan``, a mapping or a method returning one, its keys relative to the
   LightningModule (``{"net.head": ColwiseParallel(gather_output=True), ...}``);
3. else ``setup`` refuses the run naming both.

**What the strategy does.** ``setup`` (after ``configure_model``, before ``configure_optimizers``) gives every rank
rank 0's weights (as ``ddp`` does), so the slices come from one model, then :func:`parallelize` the module over its
tensor-parallel group, and sets ``module.tensor_parallel_group`` to that group (never ``None``: the world's group
object when the group is every rank). A step needs that attribute when its head stays vocabulary-sharded (the plan's
``ColwiseParallel()`` head, as in ``GPT_PLAN``): the logits are then this rank's slice of the vocabulary, and the loss
is ``vocab_parallel_cross_entropy(logits, targets, self.tensor_parallel_group)``; ``CharGPTModule`` does that by
itself. With ``ColwiseParallel(gather_output=True)`` on the head the logits are whole and an unchanged module's
``F.cross_entropy`` is right. The optimizers are built over the sliced parameters.

[Note: tensor parallel x data parallel] The world is a :class:`~lightning_zero.training.mesh.Mesh` of
``world / tensor_parallel_size`` replicas of ``tensor_parallel_size`` consecutive ranks (rank = replica *
tensor_parallel_size + index). The ranks of a replica (its tensor-parallel group) read the same batches: the sampler's
replicas are the model replicas (``num_replicas`` = the data size, ``rank`` = the replica). Rank ``(r, i)`` holds slice
``i`` of every sharded parameter, and averages its gradients with the ranks holding the same slice, ``(*, i)`` (its
data-parallel group), through :class:`~lightning_zero.dp.reducer.GradientReducer`: buckets all-reduced while the
backward runs, nothing at all on the non-boundary micro-batches of gradient accumulation. The replicated parameters
(LayerNorms, the position embedding, a row-parallel layer's bias) get equal gradients on every rank of a replica (all
they see is replicated), so the same average keeps every copy equal. With one replica nothing is averaged.

[Note: global norm] Norm clipping uses the norm of the whole unsharded model's gradient, as ``clip_grad_norm_`` on
the one-process model: the squares of the sharded gradients are summed over the tensor-parallel group (one
all-reduce of one value, ledger tag ``"tp/grad_norm"``) and the replicated ones, equal on every rank of the group,
are added once.

**Checkpoints** are Lightning's plain files of the whole model in the unparallelized layout (rank 0 writes them): the
weights are gathered with :func:`full_state_dict` and each optimizer state tensor of a parameter's local shape
(AdamW's ``exp_avg``/``exp_avg_sq``, SGD's momentum) is gathered along the parameter's dimension, so the file loads
into the plain model and its optimizer. Lightning restores the weights before ``setup``, into the whole model (then
sliced like fresh ones); the optimizer state after it, sliced here. A resume is bit-identical to an uninterrupted run.

**After fit, validate, test or predict** the module is the whole model again (``teardown`` gathers every slice back
with :func:`unparallelize`, new ``nn.Parameter`` objects, and removes ``tensor_parallel_group``), as under ``ddp``:
use it, save it or hand it to another Trainer as it was. A run that failed leaves it parallelized (gathering could
wait forever on a dead peer).

Not supported (refused with an error): ``16-mixed`` (its loss scaler's inf check would have to span the groups),
``sync_batchnorm`` and the data-parallel settings (``find_unused_parameters``, ``param_dtype``, ...), buffers with
several data replicas (they are not synchronised across replicas). Dropout draws its masks per rank, so it differs
from the one-process model's ([Note: parallelize plan] in ``lightning_zero/tensor_parallel/plan.py``).
"""

from __future__ import annotations

import pydoc
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.comm import collectives as comm
from lightning_zero.dp.reducer import GradientReducer
from lightning_zero.strategies.base import ScratchParallelStrategy
from lightning_zero.tensor_parallel import (
    Style,
    full_state_dict,
    parallelize,
    shard,
    shard_state_dict,
    sharded_entries,
    unparallelize,
    unshard,
)
from lightning_zero.tensor_parallel.layers import TensorParallelModule
from lightning_zero.training.distributed import TENSOR_PARALLEL_NAMES, check_bucket_size
from lightning_zero.training.mesh import Mesh, MeshGroups, new_groups

PLAN_ATTRIBUTE = "tensor_parallel_plan"
"""The LightningModule attribute (a plan, or a method returning one) used when the strategy has no ``plan``."""
GROUP_ATTRIBUTE = "tensor_parallel_group"
"""The LightningModule attribute the strategy sets to the tensor-parallel process group while the module is
parallelized."""
_DATA_PARALLEL_SETTINGS = (
    "find_unused_parameters",
    "broadcast_buffers",
    "param_dtype",
    "reduce_dtype",
    "master_weights",
    "cast_module",
    "activation_checkpointing_policy",
)

_Shards = dict[int, tuple[TensorParallelModule, int]]  # id(parameter) -> (its layer, the dimension it is split along)


class TensorParallelStrategy(ScratchParallelStrategy):
    """Tensor parallelism within groups of ``tensor_parallel_size`` ranks, data parallelism across them (see the
    module docstring).

    Args:
        tensor_parallel_size: ranks per model replica, a divisor of the world size (default: all of them, one
            replica). The world size divided by it is the number of data-parallel replicas.
        plan: module-name patterns to styles (:func:`~lightning_zero.tensor_parallel.parallelize`), or the import
            path of such a mapping; ``None``: the LightningModule's ``tensor_parallel_plan``.
        plan_root: the submodule ``plan``'s keys are relative to (``"net"``); ``""``: the LightningModule.
        bucket_size_mb: cap of one data-parallel gradient bucket in MiB (> 0).
        **kwargs: ``process_group_backend``, ``timeout``, ``start_method`` (see
            :class:`~lightning_zero.strategies.base.ScratchParallelStrategy`).
    """

    strategy_name = "tensor_parallel_scratch"
    registered_names = TENSOR_PARALLEL_NAMES

    def __init__(
        self,
        tensor_parallel_size: int | None = None,
        plan: Mapping[str, Style] | str | None = None,
        plan_root: str = "",
        bucket_size_mb: float = 25,
        **kwargs: Any,
    ) -> None:
        refused = sorted(set(kwargs) & set(_DATA_PARALLEL_SETTINGS))
        if refused:
            raise ValueError(f"tensor_parallel_scratch does not take {refused}: data-parallel settings it does not run")
        size = tensor_parallel_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(
                f"tensor_parallel_size={size!r} is invalid: expected an integer >= 1 dividing the world size, or None"
                " (every rank)"
            )
        if not isinstance(plan_root, str):
            raise ValueError(f"plan_root={plan_root!r} is invalid: expected a submodule name such as 'net', or ''")
        check_bucket_size(bucket_size_mb)
        super().__init__(broadcast_buffers=False, **kwargs)
        self.tensor_parallel_size, self.plan_root, self.bucket_size_mb = tensor_parallel_size, plan_root, bucket_size_mb
        self.plan = _resolve(plan) if plan is not None else None
        self.groups: MeshGroups | None = None
        self._applied: dict[str, Style] | None = None  # the plan parallelizing the module now
        self._shards: _Shards = {}  # of the parameters the optimizers were built over
        self._reducer: GradientReducer | None = None
        self._failed = False

    @property
    def mesh(self) -> Mesh:
        """Replicas x tensor-parallel ranks ([Note: tensor parallel x data parallel])."""
        return Mesh(self.world_size, self.tensor_parallel_size or self.world_size, name="tensor_parallel_size")

    @property
    def tensor_parallel_group(self) -> Any:
        """This rank's tensor-parallel process group (a group object, the world's when it is every rank)."""
        assert self.groups is not None, "setup() creates the groups"
        return self.groups.model_group if self.groups.model_group is not None else dist.group.WORLD

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The ranks of a replica read the same batches; the replicas read disjoint ones, as ``ddp``'s ranks."""
        replica, _ = self.mesh.coordinates(self.global_rank)
        return {"num_replicas": self.mesh.data_size, "rank": replica}

    @property
    def reducer(self) -> GradientReducer | None:
        """The data-parallel gradient engine while fitting with several replicas, else ``None``."""
        return self._reducer

    @property
    @override
    def strategy_buffers(self) -> list[Tensor]:
        """The reducer's gradient buckets while fitting (the gradients are views into them)."""
        return self._reducer.buffers if self._reducer is not None else []

    @override
    def _check_before_launch(self) -> None:
        super()._check_before_launch()
        if self._lightning_precision() in ("16-mixed", "16"):
            raise ValueError(
                "tensor_parallel_scratch does not run precision='16-mixed': its loss scaler's inf/NaN check would have"
                " to span the tensor-parallel slices; use 'bf16-mixed', 'bf16-true' or '32-true'"
            )
        if self._layer_sync is not None:
            raise ValueError("tensor_parallel_scratch does not take sync_batchnorm=True")
        world = self.num_processes * self.num_nodes
        if world:
            Mesh(world, self.tensor_parallel_size or world, name="tensor_parallel_size")  # a divisor of the world

    # ------------------------------------------------------------ setup and teardown
    def _module_plan(self, module: pl.LightningModule) -> dict[str, Style]:
        """The plan, its keys relative to the LightningModule (see the module docstring)."""
        if self.plan is not None:
            return {f"{self.plan_root}.{key}" if self.plan_root else key: s for key, s in self.plan.items()}
        own = getattr(module, PLAN_ATTRIBUTE, None)
        own = own() if callable(own) else own
        if own is None:
            raise ValueError(
                f"tensor_parallel_scratch needs a plan: pass TensorParallelStrategy(plan=..., plan_root=...) (e.g."
                f" plan='lightning_zero.tensor_parallel.GPT_PLAN', plan_root='net'), or give"
                f" {type(module).__name__} a `{PLAN_ATTRIBUTE}` (a mapping or a method returning one)"
            )
        if not isinstance(own, Mapping):
            raise TypeError(f"{type(module).__name__}.{PLAN_ATTRIBUTE} is {type(own).__name__}: expected a mapping")
        return dict(own)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        plan = self._module_plan(module)  # before any collective: a refusal stops every rank alike
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._failed = False
        self._check_buffers(module)
        self._setup_replicas(trainer)  # rank 0's weights on every rank: the slices come from one model
        if self.groups is None:
            self.groups = new_groups(self.mesh, self.global_rank)
        group = self.tensor_parallel_group
        parallelize(module, plan, group=group)
        self._applied = plan
        setattr(module, GROUP_ATTRIBUTE, group)
        if fitting:
            if self.mesh.data_size > 1:
                self._reducer = GradientReducer.for_module(
                    module, bucket_cap_bytes=int(self.bucket_size_mb * 2**20), group=self.groups.data_group
                )
            self._record_trainable()
            self.setup_optimizers(trainer)
            _optimizers_to_device(self.optimizers, self.root_device)
            self._shards = {
                id(getattr(layer, key.rpartition(".")[2])): (layer, dim)
                for key, (layer, dim) in sharded_entries(module).items()
            }
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
        self.setup_precision_plugin()

    def _check_buffers(self, module: nn.Module) -> None:
        buffers = [name for name, _ in module.named_buffers()]
        if self.mesh.data_size > 1 and buffers:
            raise ValueError(
                f"tensor_parallel_scratch with {self.mesh.data_size} data-parallel replicas does not synchronise"
                f" buffers across them ({buffers}): not supported yet; use tensor_parallel_size equal to the world"
                f" size ({self.world_size}), or a model without buffers"
            )

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A failed run keeps its slices: gathering them in ``teardown`` could wait on a dead peer."""
        self._failed = True
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """The whole model back on every rank (a collective over each tensor-parallel group), then Lightning's."""
        if self._reducer is not None:
            self._reducer.remove()
            self._reducer = None
        self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)
        module = self.lightning_module
        if module is not None and self._applied is not None and not self._failed:
            unparallelize(module, self._applied, group=self.tensor_parallel_group)
            module.__dict__.pop(GROUP_ATTRIBUTE, None)
            self._applied = None
        super().teardown()

    # ------------------------------------------------------------ gradients
    @override
    def _engine_no_sync(self) -> AbstractContextManager:
        """Non-boundary micro-batches: accumulate locally, communicate nothing over the data-parallel group."""
        return self._reducer.no_sync() if self._reducer is not None else nullcontext()

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """``clip_grad_norm_`` of the whole unsharded model ([Note: global norm])."""
        grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        zero = torch.zeros((), device=self.root_device)
        sharded = [torch.linalg.vector_norm(g, 2.0) for p, g in grads if id(p) in self._shards]
        replicated = [torch.linalg.vector_norm(g, 2.0) for p, g in grads if id(p) not in self._shards]
        squares = torch.stack(sharded).pow(2).sum() if sharded else zero
        if self.mesh.model_size > 1:
            comm.all_reduce(squares, "sum", group=self.tensor_parallel_group, tag="tp/grad_norm")
        if replicated:
            squares = squares + torch.stack(replicated).pow(2).sum()
        coef = torch.clamp(clip_val / (squares.sqrt() + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_([g for _, g in grads], coef.to(grads[0][1].device))

    # ------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's weights in the unparallelized layout (a collective over each tensor-parallel group)."""
        return {k: v.detach().cpu() for k, v in full_state_dict(self.lightning_module).items()}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state with each sharded parameter's state tensors gathered to the full shape (a
        collective over each tensor-parallel group)."""

        def gather(value: Any, p: Tensor, layer: TensorParallelModule, dim: int) -> Any:
            if isinstance(value, Tensor) and value.shape == p.shape:
                return unshard(value, dim, layer.group, layer.chunks)
            return value

        return self._map_state(optimizer, optimizer.state_dict(), gather)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """A whole-model state dict, sliced where the module is parallelized (Lightning loads before ``setup``,
        into the whole module: then nothing needs slicing)."""
        module = self.lightning_module
        module.load_state_dict(shard_state_dict(module, checkpoint["state_dict"]), strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each optimizer's whole-model state, each sharded parameter's state tensors sliced like the parameter."""

        def slice_(value: Any, p: Tensor, layer: TensorParallelModule, dim: int) -> Any:
            full = list(p.shape)
            full[dim] *= layer.tp_size
            if isinstance(value, Tensor) and list(value.shape) == full:
                return shard(value, dim, layer.group, layer.chunks)
            return value

        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(self._map_state(optimizer, state, slice_))
        _optimizers_to_device(self.optimizers, self.root_device)

    def _map_state(self, optimizer: Optimizer, state: Mapping[str, Any], fn: Any) -> dict[str, Any]:
        """``state`` (an optimizer state dict) with ``fn(value, p, layer, dim)`` applied to every state value of each
        sharded parameter ``p``, in parameter order (the same on every rank); ``state``'s own dicts are not changed
        (``optimizer.state_dict()`` shares them with the live state)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        per_param = dict(state["state"])
        for index, p in enumerate(params):
            if index in per_param and id(p) in self._shards:
                layer, dim = self._shards[id(p)]
                per_param[index] = {key: fn(value, p, layer, dim) for key, value in per_param[index].items()}
        return {**state, "state": per_param}


def _resolve(plan: Mapping[str, Style] | str) -> dict[str, Style]:
    """A plan, or the import path of one (``pydoc.locate``)."""
    resolved = pydoc.locate(plan) if isinstance(plan, str) else plan
    if not isinstance(resolved, Mapping):
        found = f" (it names {type(resolved).__name__})" if isinstance(plan, str) else ""
        raise ValueError(
            f"plan={plan!r} is invalid: expected a mapping of module names to styles, or the import path of one{found}"
        )
    return dict(resolved)  # a copy the strategy owns (and can pickle: GPT_PLAN is a read-only proxy)
