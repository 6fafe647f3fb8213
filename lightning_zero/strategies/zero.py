"""``zero1_scratch`` / ``zero2_scratch`` / ``zero3_scratch``: ZeRO on our own collectives.

Runbook::

    import lightning_zero  # registers the names below
    trainer = Trainer(accelerator="cpu", devices=2, strategy="zero2_scratch", gradient_clip_val=1.0)
    trainer = Trainer(devices=2, strategy=lightning_zero.ZeroStrategy(stage=1, grad_sync="microbatch"))
    trainer = Trainer(devices=2, strategy=lightning_zero.ZeroStrategy(stage=3, auto_wrap_policy={Block}))

Registered names: ``zero1_scratch``, ``zero2_scratch``, ``zero3_scratch`` (popen launcher) and their ``_spawn``
variants. Stages 1 and 2 (:mod:`lightning_zero.zero.stage12`) leave the model whole; stage 3
(:mod:`lightning_zero.zero.stage3.engine`) shards it per unit. Under stage 3 ``configure_model`` runs on the meta device
first, then for real when the model fits in memory (exactly a normal build) or piece by piece so that no rank ever
holds all of it (``model_init``), and a fit ends with the full weights back in the module when they fit. The
optimizer returned by
``configure_optimizers`` is rebuilt in place over this rank's shards after Lightning sets it up, so schedulers keep
driving it. Norm clipping (``gradient_clip_val`` with the default ``gradient_clip_algorithm="norm"``) uses the global
norm across shards.

Checkpoints: :mod:`lightning_zero.strategies.zero_checkpoints`; what the strategy refuses or warns about:
:mod:`lightning_zero.strategies.zero_guards`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.comm.powersgd_config import refuse_on_zero
from lightning_zero.optim.sharding import ShardAware
from lightning_zero.strategies.launcher import SpawnLauncher
from lightning_zero.strategies.zero_guards import CLOSURE_TWICE, ZeroGuards
from lightning_zero.training.distributed import ZERO_NAMES
from lightning_zero.training.precision import DEFAULT
from lightning_zero.zero.grad_norm import shard_grad_norms
from lightning_zero.zero.settings import QUANT_BLOCK_SIZE, ZeroSettings, build_stage3, build_stage12
from lightning_zero.zero.stage3 import state as sp_state
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage3.materialize import (
    ModuleSnapshot,
    fits_in_memory,
    meta_nbytes,
    rng_state,
    unreplayed_init,
)
from lightning_zero.zero.stage12 import ShardedOptimizer


class _FullWeightsLauncher(SpawnLauncher):
    """Spawn launcher for stage 3: rank 0's weights go back to the main process gathered, not as placeholders."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        with engine.summon_full_params() if isinstance(engine, ShardedParams) else nullcontext():
            return super()._collect_rank_zero_results(trainer, results)


class ZeroStrategy(ZeroGuards):
    """ZeRO data parallelism: optimizer state (stage 1), gradients (stage 2) and parameters (stage 3) sharded.

    Args:
        stage: 1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters).
        grad_sync: ``"boundary"`` (reduce once per optimizer step; full local gradients between micro-batches) or
            ``"microbatch"`` (reduce every micro-batch into the gradient shard). Default: ``"boundary"`` for stage 1,
            ``"microbatch"`` for stages 2 and 3.
        bucket_size_mb: cap of one gradient bucket in MiB (> 0; stages 1 and 2).
        state_dict_type: ``"sharded"`` (a DCP directory, each rank writing its shard) or ``"full"`` (one plain file
            written by rank 0).
        auto_wrap_policy: stage 3: module classes whose instances become units (e.g. ``{Block}``).
        min_num_params: stage 3: instead, every submodule with at least this many parameters of its own.
            Neither: the children of the outermost ``nn.ModuleList``/``nn.Sequential`` (see
            ``lightning_zero/zero/stage3/units.py``).
        reshard_after_forward: stage 3: free each unit after its forward (``True``, 3 x 4Ψ traffic per step) or keep
            it until its backward (``False``, 2 x 4Ψ, more memory).
        model_init: stage 3, a model built in ``configure_model``: ``"full"`` (run it for real and shard the result:
            exactly the weights of a normal build), ``"meta"`` (build module by module with ``reset_parameters()``;
            no rank ever holds the model) or ``"auto"`` (``"full"`` when it fits comfortably in memory). See
            [Note: model construction] in ``lightning_zero/zero/stage3/materialize.py``. The same rule decides whether
            the weights are gathered back into the module when a fit ends.
        grad_accum_dtype: stages 1 and 2: the dtype gradients are stored and accumulated in (DeepSpeed's setting of
            that name): ``None`` (default: the dtype the optimizer updates, fp32 under mixed precision) or
            ``"bf16"``/``"fp16"``/``"fp32"``/a torch dtype. ``"bf16"`` with ``cast_module=True`` is the ZeRO paper's
            accounting (2-byte parameters and gradients); accumulation across micro-batches then rounds to bf16.
        quantized_weights: stage 3: all-gather the parameters as blockwise int8 with an fp32 scale per block
            (ZeRO++'s qwZ: ~¼ of the fp32 bytes); every rank computes with the same dequantized weights, while the
            fp32 shards the optimizer updates (and checkpoints) stay exact. See [Note: tensor roles] in
            ``lightning_zero/zero/stage3/engine.py``.
        quantized_grads: stage 3: reduce-scatter the gradients as blockwise int8 (ZeRO++'s qgZ: ~¼ of the fp32
            bytes), summed in fp32 after dequantizing. ``reduce_dtype`` must then stay ``"auto"`` (or fp32).
        quant_block_size: stage 3: elements per quantization block (integer >= 1, default 512): each block's
            error is at most its largest magnitude / 254, and its scale costs 4 bytes.
        shard_size: hybrid sharding (FSDP's HSDP, ZeRO++'s hpZ for stage 3): shard over groups of this many
            consecutive ranks (a node's) and replicate across the groups; it must divide the world size. ``None``
            (default): shard over every rank. See [Note: hybrid sharding] in ``lightning_zero/zero/hybrid.py``.
        grad_reduction: stages 1 and 2: how gradient buckets are averaged: ``"all_reduce"`` (every rank receives
            the whole bucket), ``"reduce_scatter"`` (each piece reduced into the rank that owns it, about DDP's bytes
            per step; stage 2, or stage 1 with ``grad_sync="microbatch"``) or ``"auto"`` (default:
            ``"reduce_scatter"`` where it applies, else ``"all_reduce"``: half the latency and bytes on any link). See
            [Note: gradient reduction] in ``lightning_zero/zero/stage12_reduction.py``.
        elementwise_optimizers: optimizer classes (or their import paths) to shard although they are not ``torch.optim``
            optimizers ZeRO knows: declare only those whose update of each element depends on that element alone.
            Any other such optimizer is refused ([Note: elementwise optimizers] in ``lightning_zero/zero/partition.py``;
            a SAM-like optimizer: :class:`lightning_zero.optim.SAM`).
        **kwargs: see :class:`~lightning_zero.strategies.base.ScratchParallelStrategy` (``find_unused_parameters``,
            ``broadcast_buffers``, the precision settings ``param_dtype``, ``reduce_dtype``, ``cast_module`` and
            ``master_weights``, ``process_group_backend``, ``timeout``, ``start_method``). ``grad_compression`` is
            refused (``ddp_scratch`` only; ``None`` passes).
    """

    shards_parameters = True
    registered_names = ZERO_NAMES

    def __init__(
        self,
        stage: int = 2,
        grad_sync: str | None = None,
        bucket_size_mb: float = 25,
        state_dict_type: str = "sharded",
        auto_wrap_policy: set[type] | None = None,
        min_num_params: int | None = None,
        reshard_after_forward: bool = True,
        model_init: str = "auto",
        grad_accum_dtype: str | torch.dtype | None = None,
        quantized_weights: bool = False,
        quantized_grads: bool = False,
        quant_block_size: int = QUANT_BLOCK_SIZE,
        shard_size: int | None = None,
        grad_reduction: str = "auto",
        elementwise_optimizers: set[type] | None = None,
        **kwargs: Any,
    ) -> None:
        refuse_on_zero(f"zero{stage}_scratch", kwargs)
        settings = ZeroSettings.check(
            stage=stage,
            grad_sync=grad_sync,
            bucket_size_mb=bucket_size_mb,
            state_dict_type=state_dict_type,
            auto_wrap_policy=auto_wrap_policy,
            min_num_params=min_num_params,
            reshard_after_forward=reshard_after_forward,
            model_init=model_init,
            grad_accum_dtype=grad_accum_dtype,
            quantized_weights=quantized_weights,
            quantized_grads=quantized_grads,
            quant_block_size=quant_block_size,
            shard_size=shard_size,
            grad_reduction=grad_reduction,
            elementwise_optimizers=elementwise_optimizers,
            reduce_dtype=kwargs.get("reduce_dtype", DEFAULT),
        )
        super().__init__(**kwargs)
        self.settings = settings
        settings.apply_to(self)
        self._init_rng_state: dict[str, torch.Tensor] | None = None
        self.strategy_name = f"zero{stage}_scratch"  # the registered name of this stage (run reports use it)

    @property
    @override
    def strategy_buffers(self) -> list[Tensor]:
        """The engine's flat buffers, gradient accumulators and buckets (see its ``strategy_buffers``), else none."""
        engine = self.engine
        return engine.strategy_buffers if engine is not None else []

    @override
    def model_state_params(self) -> list[Tensor]:
        """The module's parameters plus the engine's shard parameters (which the optimizer steps)."""
        engine = self.engine
        return super().model_state_params() + (list(engine.shard_params) if engine is not None else [])

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self.stage == 3 and isinstance(self._launcher, SpawnLauncher):
            self._launcher = _FullWeightsLauncher(self, start_method=self._start_method)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: ``configure_model`` runs on the meta device, then for real or piece by piece in the engine
        ([Note: model construction] in ``lightning_zero/zero/stage3/materialize.py``)."""
        module = self.lightning_module
        if self.stage != 3 or module is None:
            yield
            return
        snapshot = ModuleSnapshot(module) if self.model_init != "meta" else None
        rng_before = rng_state(self.root_device)
        with torch.device("meta"):
            yield
        self._init_rng_state = rng_state(self.root_device)  # meta construction drew no random numbers
        nbytes = meta_nbytes(module)
        if not nbytes:
            return
        copies = self.num_processes if self.root_device.type == "cpu" else 1  # local processes share host memory
        if snapshot is not None and self._whole_model_fits(nbytes, self.root_device, copies):
            snapshot.restore()
            torch.set_rng_state(rng_before["cpu"])
            if "cuda" in rng_before:
                torch.cuda.set_rng_state(rng_before["cuda"], self.root_device)
            with self.precision_plugin.module_init_context():
                module.configure_model()
            return
        unreplayed = unreplayed_init(module)
        if unreplayed:
            rank_zero_warn(
                f"zero3_scratch builds this model on the meta device (model_init={self.model_init!r},"
                f" {nbytes / 2**30:.2f} GiB of parameters and buffers): each module's reset_parameters() is replayed,"
                " but not the init code"
                f" of {unreplayed}, so their weights may differ from a normal build. Give them a reset_parameters(),"
                " or pass model_init='full' if the model fits in memory."
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.stage == 3:
            return self._setup_stage3(trainer)
        self._setup_replicas(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_callbacks(trainer)
            self.setup_optimizers(trainer)
            _optimizers_to_device(self.optimizers, self.root_device)
            self._engine = self._build_stage12()
            self._record_trainable()
            # [Note: global-norm clipping] Lightning's Precision.clip_grad_by_norm takes the norm of the optimizer's
            # parameters' gradients, here this rank's shard only. Route it to the engine's global norm instead.
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
        self._setup_precision(trainer, cast_module=trainer.state.fn == TrainerFn.FITTING)
        self.setup_precision_plugin()

    def _build_stage12(self) -> ShardedOptimizer:
        """Stages 1 and 2, fitting: the engine over the model and the optimizer set up (subclasses: robust ZeRO)."""
        return build_stage12(
            self.settings,
            self.precision_policy,
            self.model,
            self.optimizers,
            find_unused_parameters=self.find_unused_parameters,
        )

    def _setup_stage3(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self._params = ShardedParams.of(self.model)  # a model too big to be gathered after an earlier fit
        self._apply_layer_sync(trainer)  # before sharding, so the engine hooks the converted modules
        self._apply_activation_checkpointing(trainer)
        shards = self.shard_size or self.world_size
        if self._params is not None and self._params.world_size != shards:
            raise ValueError(
                f"the model is sharded over {self._params.world_size} ranks by an earlier fit: this run shards over"
                f" {shards}; save a checkpoint and load it into a fresh model instead"
            )
        if self._params is None:
            self._params = build_stage3(
                self.settings,
                self.precision_policy,
                self.model,
                device=self.root_device,
                timeout=self._timeout,
                find_unused_parameters=self.find_unused_parameters,
                rng_state=self._init_rng_state,
            )
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_callbacks(trainer)
            self.setup_optimizers(trainer)
            self._params.attach_optimizers(self.optimizers)
            self._first_loss_unchecked = True
            self._record_trainable()
            _optimizers_to_device(self.optimizers, self.root_device)
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
        self._setup_precision(trainer, cast_module=True)  # the engine computes in param_dtype outside fits too
        self.setup_precision_plugin()

    def grad_norms(self, norm_type: float) -> dict[str, Tensor]:
        """The norm of each parameter's averaged gradient, by name, for the parameters that would have a ``p.grad``
        under ``ddp`` (see :func:`lightning_zero.grad_norm`). Collective."""
        engine = self.engine
        assert engine is not None
        unused = engine.unused_everywhere
        params = [p for p in engine.param_pieces if p.shard.grad is not None and p.name not in unused]
        device = self.root_device
        norms = shard_grad_norms(params, norm_type, group=engine.group, device=device)  # each shard once
        return {p.name: norm.to(p.shard.dtype) for p, norm in zip(params, norms)}

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        assert self.engine is not None
        if isinstance(optimizer, LightningOptimizer):  # self.clip_gradients(opt) in manual optimization
            optimizer = optimizer.optimizer
        self.engine.clip_grad_norm_(float(clip_val), optimizer)

    @override
    def _engine_no_sync(self) -> AbstractContextManager:
        """Non-boundary micro-batches: no communication with ``grad_sync="boundary"``; reduce anyway otherwise."""
        return self.settings.no_sync(self.engine)

    @override
    def _engine_backward(self) -> AbstractContextManager:
        """Stages 1 and 2: the module parameters of toggled-off optimizers off (stage 3 drops their fresh gradients
        in its hook)."""
        engine = self.engine
        return engine.toggled_off() if isinstance(engine, ShardedOptimizer) else nullcontext()

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        engine = self.engine
        if engine is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        calls = []

        def closure_then_hold() -> Any:  # the optimizer runs the closure (the window's last backward) first
            calls.append(None)
            if len(calls) > 1 and not isinstance(optimizer, ShardAware):
                raise RuntimeError(CLOSURE_TWICE.format(type(optimizer).__name__, self.strategy_name))
            output = closure()
            engine.before_step(optimizer)
            return output

        output = super().optimizer_step(optimizer, closure_then_hold, model, **kwargs)
        engine.after_step(optimizer)  # stages 1 and 2 all-gather the updated shards; stage 3 gathers on next forward
        return output

    @contextmanager
    @override
    def _around_step(self) -> Generator[None, None, None]:
        """Stage 3: a step that reads a sharded parameter outside its unit's forward gathers it
        ([Note: unit lifecycle] in ``lightning_zero/zero/stage3/backward.py``)."""
        with super()._around_step(), self._params.gathering_reads() if self._params is not None else nullcontext():
            yield

    @override
    def _before_step(self) -> None:
        if self._params is not None:
            self._params.gather_root()  # parameters the step may use outside any module's forward

    @override
    def _after_forward_only(self) -> None:
        if self._params is not None:
            self._params.reshard()  # the root unit stays gathered after a forward that has no backward

    @override
    def teardown(self) -> None:
        # The engine outlives the fit: the optimizer stays sharded, and a ``trainer.save_checkpoint`` after ``fit``
        # must still gather the full optimizer state.
        self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)
        self._versions = None
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        succeeded = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        if self.stage != 3:
            if self._engine is not None:
                if succeeded:
                    self._engine.restore_masters()  # collective: not after an error
                self._engine.remove()  # the model is whole again; only the reducer's hooks go
            self._teardown_precision()
            self._revert_layer_sync()
            return super().teardown()
        # Stage 3 ([Note: reading sharded parameters] in lightning_zero/zero/stage3/placeholder_reads.py): the full
        # weights go back into the module on the CPU, as Lightning's ddp leaves them, when they fit there. Not after
        # an error: the gather is collective, and the rank that failed may be the only one here.
        params, cpu = self._params, torch.device("cpu")
        release = params is not None and succeeded and not params.released
        if release and self._whole_model_fits(params.full_nbytes, cpu, self.num_processes):
            sp_state.release(params, cpu)
            self._teardown_precision()
            self._revert_layer_sync()
            return super().teardown()
        # Otherwise the model stays sharded where it is, hooks included, so ``trainer.test`` or a forward after fit
        # (on every rank) gathers as usual; Lightning's move of the model to the CPU would allocate every parameter.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def _whole_model_fits(self, nbytes: int, device: torch.device, copies: int) -> bool:
        """``model_init``'s rule, for building the model for real and for handing its weights back after a fit."""
        if self.model_init == "meta":
            return False
        return self.model_init == "full" or fits_in_memory(nbytes, device, copies)
