"""``tensor_parallel_scratch``: Megatron-LM tensor parallelism x data parallelism as a Lightning strategy.

Runbook::

    import lightning_zero  # registers the names below
    from lightning_zero.demo.model import CharGPTModule
    from lightning_zero.tensor_parallel import GPT_PLAN

    module = CharGPTModule(vocab_size=64, n_head=4, n_embd=96)
    strategy = lightning_zero.TensorParallelStrategy(tensor_parallel_size=2, plan=GPT_PLAN, plan_root="net")
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy)  # 2 data replicas x 2 tensor-parallel ranks
    trainer.fit(module, datamodule)

    # ZeRO over the data-parallel dimension: each replica keeps half of its slice's optimizer state (and gradients;
    # zero_stage=3: and parameters)
    strategy = lightning_zero.TensorParallelStrategy(
        tensor_parallel_size=2, plan=GPT_PLAN, plan_root="net", zero_stage=2
    )

Registered names: ``tensor_parallel_scratch`` (popen launcher) and ``tensor_parallel_scratch_spawn``: one
tensor-parallel group over every rank, and the module's own plan (below).

**The plan** (:mod:`lightning_zero.tensor_parallel.plan`: module-name patterns to styles) is the ``plan`` setting
(a mapping or its import path, keys relative to ``plan_root``), else the LightningModule's ``tensor_parallel_plan``
(``lightning_zero/tensor_parallel/plan_source.py``).

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
data-parallel group), through :class:`~lightning_zero.dp.reducer.GradientReducer` (``zero_stage=0``): buckets
all-reduced while the backward runs, nothing at all on the non-boundary micro-batches of gradient accumulation. The
replicated parameters (LayerNorms, the position embedding, a row-parallel layer's bias) get equal gradients on every
rank of a replica (all they see is replicated), so the same average keeps every copy equal. With one replica nothing is
averaged.

Norm clipping uses the norm of the whole unsharded model's gradient ([Note: global norm] in
``lightning_zero/tensor_parallel/grad_norm.py``).

``zero_stage`` 1, 2 or 3 shards the optimizer state (and the gradients, and the parameters) over the data-parallel
group ([Note: ZeRO x tensor parallel] in ``lightning_zero/strategies/tensor_parallel_zero.py``).

**Checkpoints** (``trainer.save_checkpoint`` is collective, as ``ModelCheckpoint`` calls it) are by default
(``state_dict_type="full"``) Lightning's plain files of the whole model in the unparallelized layout (rank 0 writes
them): the weights are gathered with :func:`full_state_dict` and each optimizer state tensor of a parameter's local
shape (AdamW's ``exp_avg``/``exp_avg_sq``, SGD's momentum) is gathered along the parameter's dimension (under ZeRO
after its data-parallel shards were), so the file loads into the plain model and its optimizer. With
``state_dict_type="sharded"`` nothing crosses the tensor-parallel group: each slice and its optimizer state (gathered
over the data group under ZeRO) is a DTensor of the whole entry ([Note: tensor-parallel DTensors] in
``lightning_zero/tensor_parallel/checkpoint.py``), written into a directory with the optimizer state keyed by
parameter name ([Note: sharded model-parallel checkpoints] in ``lightning_zero/strategies/model_parallel.py``), so it
loads at any tensor-parallel size, number of replicas or ZeRO stage, each rank reading only its slices. Either kind
loads after ``setup``, whatever ``state_dict_type``: each rank keeps its slices of the weights and of the optimizer
state (and under ZeRO its shard of them). A resume is bit-identical to an uninterrupted run. [Note: tensor-parallel
checkpoint state] in ``lightning_zero/strategies/tensor_parallel_state.py`` has the details.

**After fit, validate, test or predict** the module is the whole model again (``teardown`` gathers every slice back
with :func:`unparallelize`, new ``nn.Parameter`` objects, and removes ``tensor_parallel_group``), as under ``ddp``:
use it, save it or hand it to another Trainer as it was. A run that failed leaves it parallelized (gathering could
wait forever on a dead peer).

Not supported (refused with an error): ``16-mixed`` (its loss scaler's inf check would have to span the groups),
``sync_batchnorm`` and the data-parallel settings (``find_unused_parameters``, ``param_dtype``, ...),
buffers with several data replicas (they are not synchronised across replicas). Dropout draws its masks per rank, so it
differs from the one-process model's ([Note: parallelize plan] in ``lightning_zero/tensor_parallel/plan.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.dp.reducer import GradientReducer
from lightning_zero.strategies.model_parallel import ModelParallelStrategy, check_state_dict_type
from lightning_zero.strategies.tensor_parallel_state import SliceState
from lightning_zero.strategies.tensor_parallel_zero import shard_norms, shard_optimizer, shard_params
from lightning_zero.tensor_parallel import (
    Style,
    parallelize,
    sharded_entries,
    unparallelize,
)
from lightning_zero.tensor_parallel.grad_norm import clip_grad_by_global_norm
from lightning_zero.tensor_parallel.layers import TensorParallelModule
from lightning_zero.tensor_parallel.plan_source import module_plan, resolve_plan
from lightning_zero.training.distributed import TENSOR_PARALLEL_NAMES, check_bucket_size
from lightning_zero.training.mesh import new_groups
from lightning_zero.zero.settings import ZeroSettings
from lightning_zero.zero.stage3 import state as sp_state
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage12 import ShardedOptimizer

GROUP_ATTRIBUTE = "tensor_parallel_group"
"""The LightningModule attribute the strategy sets to the tensor-parallel process group while the module is
parallelized."""

_Shards = dict[int, tuple[TensorParallelModule, int]]  # id(parameter) -> (its layer, the dimension it is split along)


class TensorParallelStrategy(ModelParallelStrategy):
    """Tensor parallelism within groups of ``tensor_parallel_size`` ranks, data parallelism across them (see the
    module docstring).

    Args:
        tensor_parallel_size: ranks per model replica, a divisor of the world size (default: all of them, one
            replica). The world size divided by it is the number of data-parallel replicas.
        plan: module-name patterns to styles (:func:`~lightning_zero.tensor_parallel.parallelize`), or the import
            path of such a mapping; ``None``: the LightningModule's ``tensor_parallel_plan``.
        plan_root: the submodule ``plan``'s keys are relative to (``"net"``); ``""``: the LightningModule.
        bucket_size_mb: cap of one data-parallel gradient bucket in MiB (> 0).
        zero_stage: how the data-parallel dimension keeps the model states: 0 (every replica holds its slice's
            whole optimizer state, gradients averaged as by ``ddp``), 1 (the state sharded over the data-parallel
            group), 2 (and the gradients) or 3 (and the parameters); see [Note: ZeRO x tensor parallel].
        state_dict_type: ``"full"`` (default: one plain file of the whole model) or ``"sharded"`` (a directory, each
            rank writing its slices; see **Checkpoints** above).
        **kwargs: ``process_group_backend``, ``timeout``, ``start_method`` (see
            :class:`~lightning_zero.strategies.base.ScratchParallelStrategy`).
    """

    strategy_name = "tensor_parallel_scratch"
    registered_names = TENSOR_PARALLEL_NAMES
    size_setting = "tensor_parallel_size"
    broadcasts_buffers = False  # buffers with several replicas are refused (_check_buffers)

    def __init__(
        self,
        tensor_parallel_size: int | None = None,
        plan: Mapping[str, Style] | str | None = None,
        plan_root: str = "",
        bucket_size_mb: float = 25,
        zero_stage: int = 0,
        state_dict_type: str = "full",
        **kwargs: Any,
    ) -> None:
        size = tensor_parallel_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(
                f"tensor_parallel_size={size!r} is invalid: expected an integer >= 1 dividing the world size, or None"
                " (every rank)"
            )
        if not isinstance(plan_root, str):
            raise ValueError(f"plan_root={plan_root!r} is invalid: expected a submodule name such as 'net', or ''")
        check_bucket_size(bucket_size_mb)
        if type(zero_stage) is not int or zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={zero_stage!r} is invalid: expected 0, 1, 2 or 3")
        self.state_dict_type = check_state_dict_type(state_dict_type)
        super().__init__(**kwargs)
        self.tensor_parallel_size, self.plan_root, self.bucket_size_mb = tensor_parallel_size, plan_root, bucket_size_mb
        self.plan = resolve_plan(plan) if plan is not None else None
        self.zero_stage = zero_stage
        self._zero = ZeroSettings.check(stage=zero_stage, bucket_size_mb=bucket_size_mb) if zero_stage else None
        self._applied: dict[str, Style] | None = None  # the plan parallelizing the module now
        self._shards: _Shards = {}  # of the parameters the optimizers were built over
        self._entries: dict[str, tuple[TensorParallelModule, int]] = {}  # sharded state-dict keys of the last setup
        self._names_of: dict[int, str] = {}  # id(parameter) -> its name, of the parameters the optimizers hold
        self._reducer: GradientReducer | None = None  # zero_stage=0
        self._engine: ShardedOptimizer | ShardedParams | None = None  # zero_stage 1-3; kept after the fit
        self._failed = False

    @property
    @override
    def model_parallel_size(self) -> int | None:
        """Ranks per tensor-parallel group ([Note: tensor parallel x data parallel])."""
        return self.tensor_parallel_size

    @property
    def tensor_parallel_group(self) -> Any:
        """This rank's tensor-parallel process group (a group object, the world's when it is every rank)."""
        assert self.groups is not None, "setup() creates the groups"
        return self.groups.model_group if self.groups.model_group is not None else dist.group.WORLD

    @property
    def reducer(self) -> GradientReducer | None:
        """The data-parallel gradient engine of ``zero_stage=0`` while fitting with several replicas, else ``None``."""
        return self._reducer

    @property
    def engine(self) -> ShardedOptimizer | ShardedParams | None:
        """The ZeRO engine over the data-parallel group (``zero_stage`` 1, 2 or 3, several replicas) of the current
        or last fit, else ``None``."""
        return self._engine

    @property
    @override
    def strategy_buffers(self) -> list[Tensor]:
        """The reducer's gradient buckets while fitting (the gradients are views into them), or the ZeRO engine's
        flat buffers, gradient storage and buckets."""
        if self._engine is not None:
            return self._engine.strategy_buffers
        return self._reducer.buffers if self._reducer is not None else []

    @override
    def model_state_params(self) -> list[Tensor]:
        """The module's parameters plus the ZeRO engine's shard parameters (which the optimizer steps)."""
        return super().model_state_params() + (list(self._engine.shard_params) if self._engine is not None else [])

    # ------------------------------------------------------------ setup and teardown
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        plan = module_plan(module, self.plan, self.plan_root)  # before any collective: a refusal stops every rank alike
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._failed = False
        self._check_buffers(module)
        self._setup_replicas(trainer)  # rank 0's weights on every rank: the slices come from one model
        if self.groups is None:
            self.groups = new_groups(self.mesh, self.global_rank)
        group = self.tensor_parallel_group
        parallelize(module, plan, group=group)
        self._applied, self._entries = plan, sharded_entries(module)
        setattr(module, GROUP_ATTRIBUTE, group)
        if fitting:
            replicated = self.mesh.data_size > 1
            if replicated and self._zero is None:
                self._reducer = GradientReducer.for_module(
                    module, bucket_cap_bytes=int(self.bucket_size_mb * 2**20), group=self.groups.data_group
                )
            self._record_trainable()
            zero3 = replicated and self._zero is not None and self._zero.stage == 3
            self._engine = (
                shard_params(self._zero, module, self.groups, self.root_device, self._timeout) if zero3 else None
            )
            self.setup_optimizers(trainer)
            _optimizers_to_device(self.optimizers, self.root_device)
            if replicated and self._zero is not None:
                self._engine = shard_optimizer(self._zero, module, self.optimizers, self._engine, self.groups)
            self._shards = {
                id(getattr(layer, key.rpartition(".")[2])): (layer, dim) for key, (layer, dim) in self._entries.items()
            }
            self._names_of = {id(p): name for name, p in module.named_parameters()}
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
        if isinstance(self._engine, ShardedParams) and not self._engine.released and not self._failed:
            sp_state.release(self._engine, self.root_device)  # the slices whole again on each rank (collective)
        elif self._engine is not None:
            self._engine.remove()  # its hooks; the shards stay: a save_checkpoint after the fit gathers them
        self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)
        module = self.lightning_module
        if module is not None and self._applied is not None and not self._failed:
            unparallelize(module, self._applied, group=self.tensor_parallel_group)
            module.__dict__.pop(GROUP_ATTRIBUTE, None)
            self._applied = None
        super().teardown()

    @override
    def _after_forward_only(self) -> None:
        if isinstance(self._engine, ShardedParams) and not self._engine.released:
            self._engine.reshard()  # ZeRO-3's root unit stays gathered after a forward that has no backward

    # ------------------------------------------------------------ gradients
    @override
    def _engine_no_sync(self) -> AbstractContextManager:
        """Non-boundary micro-batches: accumulate locally, communicate nothing over the data-parallel group (ZeRO:
        with ``grad_sync="boundary"``, stage 1's default; stage 2 reduces every micro-batch into its shard)."""
        if self._zero is not None:
            return self._zero.no_sync(self._engine)
        return self._reducer.no_sync() if self._reducer is not None else nullcontext()

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Under ZeRO, the engine readies the shard gradients after the window's last backward (before clipping) and
        all-gathers the updated shards into the parameters after the step."""
        engine = self._engine
        if engine is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def backward_then_ready() -> Any:  # the optimizer runs the closure first, Lightning clips right after it
            output = closure()
            engine.before_step()
            return output

        output = super().optimizer_step(optimizer, backward_then_ready, model, **kwargs)
        engine.after_step()
        return output

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> Tensor:
        """``clip_grad_norm_`` of the whole unsharded model ([Note: global norm] in
        ``lightning_zero/tensor_parallel/grad_norm.py``); returns that norm."""
        sharded, replicated, grads = self._grad_norms(optimizer)
        group = self.tensor_parallel_group if self.mesh.model_size > 1 else None
        return clip_grad_by_global_norm(sharded, replicated, grads, clip_val, group, self.root_device)

    def _grad_norms(self, optimizer: Optimizer) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """The norms of this rank's parameters' averaged gradients, the tensor-parallel slices' and the replicated
        ones', and the gradient tensors to scale: ``optimizer``'s, or under ZeRO the shard gradients."""
        if self._engine is not None:
            return shard_norms(self._engine, {self._names_of[i] for i in self._shards}, self.root_device)
        grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        sharded = [torch.linalg.vector_norm(g, 2.0) for p, g in grads if id(p) in self._shards]
        replicated = [torch.linalg.vector_norm(g, 2.0) for p, g in grads if id(p) not in self._shards]
        return sharded, replicated, [g for _, g in grads]

    # ------------------------------------------------------------ checkpoints
    @property
    @override
    def layout(self) -> dict[str, Any]:
        """Tensor-parallel size, replicas and ZeRO stage (any layout loads the checkpoints)."""
        return {
            "strategy": self.strategy_name,
            "tensor_parallel_size": self.mesh.model_size,
            "replicas": self.mesh.data_size,
            "zero_stage": self.zero_stage,
        }

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the parallelized module and its (sharded) optimizer: each rank keeps its slices."""
        return True

    def _state(self) -> SliceState:
        """The checkpoint state of the module's slices under this fit's engine ([Note: tensor-parallel checkpoint
        state] in ``lightning_zero/strategies/tensor_parallel_state.py``)."""
        module, parallelized = self.lightning_module, self._applied is not None
        return SliceState(module, self._engine, self._entries, self._shards, self._names_of, parallelized)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's weights (``"full"``), or each slice as a DTensor of the whole entry (``"sharded"``)."""
        return self._state().model_state(sharded=self.state_dict_type == "sharded")

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state of the whole model (``"full"``), or of this rank's slices as DTensors by name
        (``"sharded"``); under ZeRO the other replicas' ranks return no ``"state"`` (replica 0's ranks hold it)."""
        return self._state().optimizer_state(optimizer, sharded=self.state_dict_type == "sharded")

    @override
    def sharded_templates(self, metadata: Metadata) -> dict[str, Any]:
        """This rank's slices and the replicated entries and, in a fit, its slices' optimizer state by name."""
        return self._state().templates(metadata, self.optimizers[0] if self._fitting and self.optimizers else None)

    @override
    def _full_model_shapes(self) -> dict[str, tuple[int, ...]]:
        return self._state().full_shapes()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """A whole-model state dict or this rank's slices, into the module (ZeRO-3: into its shards)."""
        self._state().load_model(checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each optimizer's state of the whole model or of this rank's slices, sliced like the parameters."""
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            self._state().load_optimizer(optimizer, state)
        _optimizers_to_device(self.optimizers, self.root_device)
