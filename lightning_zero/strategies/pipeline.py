"""``pipeline_scratch``: pipeline parallelism (GPipe and 1F1B) on our own point-to-point sends.

Runbook::

    import lightning_zero  # registers the names below

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.layers(x), y)
            self.log("train_loss", loss)
            return loss

    strategy = lightning_zero.PipelineStrategy(micro_batches=4, schedule="1f1b", balance=[3, 2])
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy)  # or strategy="pipeline_scratch"

Registered names: ``pipeline_scratch`` (popen launcher) and ``pipeline_scratch_spawn``. Rank ``s`` is stage ``s``.

**What the module declares.** One ``nn.Sequential`` holds every trainable parameter: the strategy's ``layers`` names it
(an attribute path, dotted for a nested one: ``"net.body"``), or the module says which with a ``pipeline_layers``
attribute or property (the demos do), else it is the module's ``layers``. Its children are cut into one slice per rank
(``balance``: how many children each stage gets; default an even split). The steps call it once per batch, on the
batch's input, and turn its output into the loss as usual. Each rank holds only its stage's layers ([Note: stage
placeholders] in ``lightning_zero/pipeline/placement.py``); with ``model_init="meta"`` the layers built in
``configure_model`` are never allocated whole on any rank ([Note: meta initialisation] in
``lightning_zero/zero/stage3/materialize.py``).

**What a step does** (``lightning_zero/pipeline/step.py``): the batch is cut into ``micro_batches`` pieces, this rank
runs its part of the schedule calling the module's step once per micro-batch, and the last stage's loss, logged values
and outputs, combined over the micro-batches, are logged and returned on every rank once per batch. The strategy runs
every backward inside the training step, so automatic optimization, gradient accumulation, LR schedulers and clipping
work as under ``ddp``; norm clipping uses the global norm over every stage.

**Validation, test, predict** run the forwards of the micro-batches through the stages the same way; ``predict_step``
outputs are concatenated (tensors) or listed per micro-batch, on every rank.

[Note: data parallel x pipeline] With ``stages`` smaller than the world size, the ranks form ``world / stages``
replicas of the pipeline (``lightning_zero/training/mesh.py``: replica ``r`` is ranks ``r * stages ...``). Each
replica reads its own batches (the sampler's replicas are the pipelines, as ``ddp``'s are its ranks) and runs the
schedule on its own; at the end of each accumulation window stage ``s`` of every replica averages its gradients with
one all-reduce over the ranks holding stage ``s``, so every replica steps the same weights, as ``ddp`` would with one
rank per replica. The logged values are each replica's (``sync_dist`` averages them over the replicas). Buffers
(BatchNorm statistics) follow ``ddp``'s rule: before a forward that follows a gradient-synchronising one, each stage
takes the first replica's (``broadcast_buffers=False`` turns it off).

**Checkpoints** are Lightning's plain files of the unsplit model (``state_dict_type="full"``, default) or a
directory of each stage's (``"sharded"``); either loads at any layout (``lightning_zero/strategies/pipeline_state.py``).
After a fit every rank gets the whole weights back (as under ``ddp``).

Not supported (refused with an error): BatchNorm layers with ``micro_batches > 1`` (each micro-batch would be
normalized by its own statistics), ``16-mixed`` (its loss scaler would have to scale the pipeline's backward),
manual optimization, the data-parallel settings (``sync_batchnorm``, ``find_unused_parameters``, ...), parameters
outside the pipelined ``nn.Sequential`` or tied across stages. Dropout draws its masks per stage, so they differ from
a one-process run's.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.comm import collectives as comm
from lightning_zero.pipeline import placement
from lightning_zero.pipeline.gradients import average_gradients, clip_grad_by_global_norm
from lightning_zero.pipeline.outputs import to_device
from lightning_zero.pipeline.runtime import PipelineStage
from lightning_zero.pipeline.schedule import SCHEDULES, check_pipeline
from lightning_zero.pipeline.stages import check_batch_statistics, check_parameters, find_layers, partition
from lightning_zero.pipeline.step import HeldGradients, run_step, share_results
from lightning_zero.strategies.model_parallel import ModelParallelStrategy, check_state_dict_type
from lightning_zero.strategies.pipeline_state import StageState
from lightning_zero.training.distributed import PIPELINE_NAMES
from lightning_zero.training.mesh import new_groups
from lightning_zero.zero.stage3.materialize import build_meta_modules, has_meta_tensors, rng_state

MODEL_INITS = ("full", "meta")


class PipelineStrategy(ModelParallelStrategy):
    """Pipeline parallelism over ``devices`` stages (see the module docstring).

    Args:
        micro_batches: pieces each batch is cut into (>= 1); the bubble is ``(stages - 1) / (micro_batches + stages
            - 1)`` of a step.
        schedule: ``"1f1b"`` (default; each stage keeps at most ``stages - stage`` micro-batches' activations) or
            ``"gpipe"`` (all forwards, then all backwards).
        layers: the attribute path of the module's pipelined ``nn.Sequential``; default the module's
            ``pipeline_layers`` (an attribute or property returning it) if it has one, else ``"layers"``.
        balance: children of ``layers`` per stage (one integer per rank, summing to ``len(layers)``); default an even
            split.
        model_init: ``"full"`` (default: every rank builds the whole model as a one-process run would, keeps its
            stage and frees the rest; exactly a normal build) or ``"meta"`` (``configure_model`` runs on the meta
            device and each rank builds only its stage, replaying each module's ``reset_parameters()``).
        stages: ranks per pipeline (a divisor of the world size; default all of them). The world size divided by
            ``stages`` is the number of data-parallel replicas ([Note: data parallel x pipeline]).
        state_dict_type: ``"full"`` (default: one plain file, every stage's state gathered on rank 0) or
            ``"sharded"`` (a directory, each rank writing its stage's; [Note: sharded model-parallel checkpoints]).
        measure_activations: count the bytes autograd saves for backward on each stage in each training step
            (``trainer.strategy.stage.meter.peak``; a Python call per saved tensor, so off by default).
        **kwargs: ``process_group_backend``, ``timeout``, ``start_method`` (see
            :class:`~lightning_zero.strategies.base.ScratchParallelStrategy`).
    """

    strategy_name = "pipeline_scratch"
    registered_names = PIPELINE_NAMES
    size_setting = "stages"

    def __init__(
        self,
        micro_batches: int = 4,
        schedule: str = "1f1b",
        layers: str | None = None,
        balance: Sequence[int] | None = None,
        model_init: str = "full",
        stages: int | None = None,
        state_dict_type: str = "full",
        measure_activations: bool = False,
        **kwargs: Any,
    ) -> None:
        check_pipeline(1, micro_batches)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is invalid: expected one of {SCHEDULES}")
        if layers is not None and (not isinstance(layers, str) or not layers):
            raise ValueError(f"layers={layers!r} is invalid: expected the attribute path of an nn.Sequential or None")
        if model_init not in MODEL_INITS:
            raise ValueError(f"model_init={model_init!r} is invalid: expected one of {MODEL_INITS}")
        if stages is not None:
            check_pipeline(stages, 1)
        self.state_dict_type = check_state_dict_type(state_dict_type)
        super().__init__(**kwargs)
        self.micro_batches, self.schedule, self.layers_name = micro_batches, schedule, layers
        self.balance = list(balance) if balance is not None else None
        self.model_init, self.stages = model_init, stages
        self.measure_activations = measure_activations
        self.stage: PipelineStage | None = None
        self._slices: list[range] = []
        self._init_rng_state: dict[str, Tensor] | None = None
        self._held = HeldGradients()

    @property
    @override
    def model_parallel_size(self) -> int | None:
        """Ranks per pipeline, ``stages`` ([Note: data parallel x pipeline])."""
        return self.stages

    @override
    def _check_before_launch(self) -> None:
        super()._check_before_launch()
        world = self.num_processes * self.num_nodes
        stages = self.stages or world
        if self.balance is not None and len(self.balance) != stages:
            raise ValueError(
                f"balance={self.balance} has {len(self.balance)} entries: expected one per stage, and this run has"
                f" {stages} stages ({world} processes)"
            )

    # ------------------------------------------------------------ building the stage
    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``model_init="meta"``: ``configure_model`` runs on the meta device; each rank builds its stage in setup."""
        if self.model_init != "meta":
            yield
            return
        with torch.device("meta"):
            yield
        self._init_rng_state = rng_state(self.root_device)

    @property
    def _layers_path(self) -> str:
        """``layers``, else the module's ``pipeline_layers`` when it has one, else ``"layers"``."""
        if self.layers_name is not None:
            return self.layers_name
        return "pipeline_layers" if hasattr(self.lightning_module, "pipeline_layers") else "layers"

    def _layers(self) -> nn.Sequential:
        return find_layers(self.lightning_module, self._layers_path)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and not module.automatic_optimization:
            raise ValueError("pipeline_scratch runs the backward itself: manual optimization is not supported")
        self.accelerator.setup(trainer)
        layers = self._layers()
        if self.groups is None:
            self.groups = new_groups(self.mesh, self.global_rank)
        index = self.groups.index
        self._slices = partition(len(layers), self.mesh.model_size, self.balance)
        check_parameters(module, self._layers_path, layers, self._slices)
        if fitting:
            check_batch_statistics(layers, self._layers_path, self.micro_batches)
        self.precision_plugin.convert_module(self.model)
        mine = self._slices[index]
        others = [layers[i] for s, indices in enumerate(self._slices) if s != index for i in indices]
        placement.move_real(self.model, self.root_device)
        for tensor in (*module.parameters(), *module.buffers()):
            if not tensor.is_meta:
                comm.broadcast(tensor.data, 0, tag="init")  # rank 0's weights, as ddp starts from
        if has_meta_tensors(module):  # model_init="meta": build this stage, replaying the others' random numbers
            own = {id(p) for i in mine for p in layers[i].parameters()}
            build_meta_modules(
                module,
                lambda p: None if id(p) in own else placement.relocate(p, "meta"),
                self.root_device,
                self._init_rng_state,
            )
        for layer in others:
            placement.to_meta(layer)
        self.stage = PipelineStage(
            layers, mine, index, self.groups.model_ranks, self.root_device, measure_activations=self.measure_activations
        )
        if fitting:
            self.setup_optimizers(trainer)
            _optimizers_to_device(self.optimizers, self.root_device)
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
        self.setup_precision_plugin()

    @override
    def teardown(self) -> None:
        """After a fit every rank gets the whole weights back (as under ``ddp``), then Lightning's teardown."""
        module = self.lightning_module
        if module is not None and self._slices and has_meta_tensors(module) and comm.is_initialized():
            assert self.groups is not None
            groups = self.groups
            placement.gather_layers(
                self._layers(), self._slices, groups.model_ranks, self.root_device, group=groups.model_group
            )
        self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)
        super().teardown()

    # ------------------------------------------------------------ steps
    def _step(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any], training: bool) -> Any:
        """Run ``hook`` through the pipeline (:func:`~lightning_zero.pipeline.step.run_step`), then on every rank
        log the last stage's combined values and return its combined output."""
        assert self.stage is not None and self.groups is not None, "setup() builds the stage"
        module = self.lightning_module
        context = self.precision_plugin.train_step_context() if training else _eval_context(self, hook)
        with self._buffer_sync():
            run = run_step(
                self.stage,
                module,
                hook,
                args,
                kwargs,
                micro_batches=self.micro_batches,
                schedule=self.schedule,
                context=context,
                held=self._held,
                training=training,
            )
        last = self.groups.model_ranks[-1]
        result, logs = share_results(run, training, last, self.groups.model_group, self.global_rank == last)
        for call in logs:
            value = call.pop("value")
            module.log(value=to_device(value, self.root_device), **call)
        return to_device(result, self.root_device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", args, kwargs, training=True)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", args, kwargs, training=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", args, kwargs, training=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", args, kwargs, training=False)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """The pipeline ran the backward inside the training step: its gradients are added here, between the hooks
        ([Note: gradients held for backward] in ``lightning_zero/pipeline/step.py``)."""
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._held.add()  # [Note: gradients held for backward]
        if not self._backward_sync_blocked:
            self._average_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def _average_gradients(self) -> None:
        """[Note: data parallel x pipeline] At the end of an accumulation window each stage averages its gradients
        with the same stage of the other replicas (one all-reduce of the flattened gradients)."""
        assert self.groups is not None
        if self.mesh.data_size == 1:
            return
        grads = [p.grad for p in self.lightning_module.parameters() if not p.is_meta and p.grad is not None]
        average_gradients(grads, self.groups.data_group)

    @override
    def _sync_buffers(self, module: nn.Module) -> None:
        """[Note: data parallel x pipeline] Each stage's buffers from the first replica's rank of that stage, as
        ``ddp`` broadcasts rank 0's ([Note: buffer broadcast] in ``lightning_zero/strategies/base.py``)."""
        assert self.groups is not None
        if self.mesh.data_size == 1:
            return
        for tensor in module.buffers():
            if not tensor.is_meta:
                comm.broadcast(tensor, self.groups.data_ranks[0], group=self.groups.data_group, tag="buffers")

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """``clip_grad_norm_`` over the gradients of every stage (:mod:`lightning_zero.pipeline.gradients`)."""
        assert self.groups is not None
        clip_grad_by_global_norm(optimizer, clip_val, self.groups.model_group, self.root_device)

    # ------------------------------------------------------------ checkpoints ([Note: stage placeholders])
    @property
    @override
    def layout(self) -> dict[str, Any]:
        """Stages, replicas, the layers per stage and the schedule (any layout loads the checkpoints)."""
        return {
            "strategy": self.strategy_name,
            "stages": self.mesh.model_size,
            "replicas": self.mesh.data_size,
            "balance": [len(indices) for indices in self._slices],
            "schedule": self.schedule,
            "micro_batches": self.micro_batches,
        }

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the built stages: each rank keeps its stage's part of a file
        (:meth:`load_model_state_dict`) and reads only its stage's tensors of a directory
        (:meth:`sharded_templates`)."""
        return True

    def _state(self) -> StageState:
        """The checkpoint state of this stage (:mod:`lightning_zero.strategies.pipeline_state`)."""
        return StageState(self.lightning_module, self.groups, sharded=self.state_dict_type == "sharded")

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This stage's weights (``"sharded"``), or every stage's gathered on rank 0 (``"full"``)."""
        return self._state().model_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state for this stage's parameters by name (``"sharded"``), or every stage's on rank 0."""
        return self._state().optimizer_state(optimizer)

    @override
    def sharded_templates(self, metadata: Metadata) -> dict[str, Any]:
        """This stage's entries the checkpoint holds and, in a fit, its optimizers' state of them, by name."""
        return self._state().templates(metadata, self.optimizers if self._fitting else [])

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """This stage's weights from a whole-model or a sharded checkpoint."""
        self._state().load_model(checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Each optimizer's state for this stage's parameters."""
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            self._state().load_optimizer(optimizer, state)

    @override
    def model_state_params(self) -> list[Tensor]:
        """This stage's parameters (the placeholders hold no memory)."""
        return [p for p in super().model_state_params() if not p.is_meta]


@contextmanager
def _eval_context(strategy: PipelineStrategy, hook: str) -> Generator[None, None, None]:
    context = {
        "validation_step": strategy.precision_plugin.val_step_context,
        "test_step": strategy.precision_plugin.test_step_context,
        "predict_step": strategy.precision_plugin.predict_step_context,
    }[hook]
    with context():
        yield
