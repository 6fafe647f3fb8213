"""The settings of a ZeRO strategy, checked once for both front ends, and the engines they build.

The Trainer's ``ZeroStrategy`` (``lightning_zero/strategies/zero.py``) and Fabric's (``lightning_zero/fabric/zero.py``)
take the same arguments; :meth:`ZeroSettings.check` raises one error naming the setting and the allowed values, and
:func:`build_stage12` / :func:`build_stage3` construct the engine from them and the run's precision policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from lightning_zero.training.distributed import check_bucket_size
from lightning_zero.training.module_classes import module_classes, optimizer_classes
from lightning_zero.training.precision import DEFAULT, PrecisionPolicy, parse_dtype
from lightning_zero.zero.hybrid import ShardingGroups, check_shard_size, new_groups
from lightning_zero.zero.optimizer_checks import GRAD_SYNC_MODES, check_grad_reduction
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage3.materialize import MODEL_INIT_MODES
from lightning_zero.zero.stage12 import ShardedOptimizer

STAGES = (1, 2, 3)
STATE_DICT_TYPES = ("sharded", "full")
QUANT_BLOCK_SIZE = 512
"""Default block of qwZ/qgZ ([Note: blockwise quantization] in ``lightning_zero/comm/quantize.py``): its fp32 scale
costs 4 / 512 = 0.8% over the int8 values (25.2% of fp32 in all), and the error of an element follows the largest
magnitude among 512 neighbours, not among a whole shard's. Larger blocks save at most that 0.8%."""


def check_quantization(quant_block_size: Any, quantized_grads: bool, reduce_dtype: Any) -> None:
    """The ZeRO++ settings that do not depend on the stage (shared with the Hydra schema in
    :mod:`lightning_zero.tools.config_schema`)."""
    if isinstance(quant_block_size, bool) or not isinstance(quant_block_size, int) or quant_block_size < 1:
        raise ValueError(f"quant_block_size={quant_block_size!r} is invalid: expected an integer >= 1")
    dtype = parse_dtype("reduce_dtype", reduce_dtype)
    if quantized_grads and dtype not in (DEFAULT, None, torch.float32):
        raise ValueError(
            f"reduce_dtype={reduce_dtype!r} conflicts with quantized_grads=True: qgZ sends int8 and reduces in fp32"
            " after dequantizing; leave reduce_dtype 'auto' (or fp32)"
        )


@dataclass(frozen=True)
class ZeroSettings:
    """What a ZeRO strategy was asked for (see ``ZeroStrategy``'s arguments); build with :meth:`check`."""

    stage: int
    grad_sync: str
    bucket_size_mb: float
    state_dict_type: str
    auto_wrap_policy: set[type] | None
    min_num_params: int | None
    reshard_after_forward: bool
    model_init: str
    grad_accum_dtype: torch.dtype | None
    quantized_weights: bool
    quantized_grads: bool
    quant_block_size: int
    shard_size: int | None
    grad_reduction: str
    elementwise_optimizers: frozenset[type]

    @classmethod
    def check(
        cls,
        stage: int = 2,
        grad_sync: str | None = None,
        bucket_size_mb: float = 25,
        state_dict_type: str = "sharded",
        auto_wrap_policy: Any = None,
        min_num_params: int | None = None,
        reshard_after_forward: bool = True,
        model_init: str = "auto",
        grad_accum_dtype: Any = None,
        quantized_weights: bool = False,
        quantized_grads: bool = False,
        quant_block_size: int = QUANT_BLOCK_SIZE,
        shard_size: int | None = None,
        grad_reduction: str = "auto",
        elementwise_optimizers: Any = None,
        reduce_dtype: Any = DEFAULT,
    ) -> ZeroSettings:
        """``reduce_dtype`` (the precision policy's setting, not stored here) is only checked against
        ``quantized_grads``; ``shard_size`` against the world size when the engine is built."""
        if stage not in STAGES:
            raise ValueError(f"stage={stage!r} is invalid: expected 1, 2 or 3")
        stage3_only = {"auto_wrap_policy": auto_wrap_policy, "min_num_params": min_num_params}
        stage3_only["reshard_after_forward"] = None if reshard_after_forward is True else reshard_after_forward
        stage3_only["model_init"] = None if model_init == "auto" else model_init
        stage3_only["quantized_weights"] = quantized_weights or None
        stage3_only["quantized_grads"] = quantized_grads or None
        stage3_only["quant_block_size"] = None if quant_block_size == QUANT_BLOCK_SIZE else quant_block_size
        accum_dtype = parse_dtype("grad_accum_dtype", grad_accum_dtype)
        accum_dtype = None if accum_dtype is DEFAULT else accum_dtype
        if stage == 3 and accum_dtype is not None:
            raise ValueError(
                f"grad_accum_dtype={grad_accum_dtype!r} applies to stages 1 and 2 only: stage=3 accumulates in its"
                " fp32 shard"
            )
        check_grad_reduction(grad_reduction, stage, grad_sync)
        if model_init not in MODEL_INIT_MODES:
            raise ValueError(f"model_init={model_init!r} is invalid: expected one of {MODEL_INIT_MODES}")
        misplaced = [k for k, v in stage3_only.items() if v is not None]
        if stage != 3 and misplaced:
            raise ValueError(f"{', '.join(misplaced)} apply to stage=3 only: got stage={stage}")
        check_quantization(quant_block_size, quantized_grads, reduce_dtype)
        check_shard_size(shard_size)
        if auto_wrap_policy is not None and min_num_params is not None:
            raise ValueError("auto_wrap_policy and min_num_params are exclusive: pass one of them (or neither)")
        if min_num_params is not None and (type(min_num_params) is not int or min_num_params < 1):
            raise ValueError(f"min_num_params={min_num_params!r} is invalid: expected an integer >= 1")
        if grad_sync is not None and grad_sync not in GRAD_SYNC_MODES:
            raise ValueError(f"grad_sync={grad_sync!r} is invalid: expected one of {GRAD_SYNC_MODES} or None")
        check_bucket_size(bucket_size_mb)
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={state_dict_type!r} is invalid: expected one of {STATE_DICT_TYPES}")
        return cls(
            stage=stage,
            grad_sync=grad_sync or ("boundary" if stage == 1 else "microbatch"),
            bucket_size_mb=bucket_size_mb,
            state_dict_type=state_dict_type,
            auto_wrap_policy=module_classes("auto_wrap_policy", auto_wrap_policy),
            min_num_params=min_num_params,
            reshard_after_forward=reshard_after_forward,
            model_init=model_init,
            grad_accum_dtype=accum_dtype,
            quantized_weights=bool(quantized_weights),
            quantized_grads=bool(quantized_grads),
            quant_block_size=quant_block_size,
            shard_size=shard_size,
            grad_reduction=grad_reduction,
            elementwise_optimizers=frozenset(optimizer_classes("elementwise_optimizers", elementwise_optimizers) or ()),
        )

    def no_sync(self, engine: ShardedOptimizer | ShardedParams | None) -> AbstractContextManager:
        """A non-boundary micro-batch: no communication with ``grad_sync="boundary"``; reduce anyway otherwise."""
        if engine is None or self.grad_sync == "microbatch":
            return nullcontext()
        if isinstance(engine, ShardedParams):
            return engine.no_sync()
        return engine.reducer.no_sync() if engine.reducer is not None else nullcontext()

    def apply_to(self, strategy: Any) -> None:
        """Set each setting as an attribute of ``strategy`` (``strategy.stage``, ``strategy.grad_sync``, ...)."""
        for name, value in asdict(self).items():
            setattr(strategy, name, value)


def engine_dtypes(policy: PrecisionPolicy) -> dict[str, torch.dtype | None]:
    """The precision policy as both engines take it ([Note: precision policy] in
    ``lightning_zero/training/precision.py``)."""
    return {
        "cast_dtype": policy.cast_dtype,
        "gather_dtype": policy.param_dtype,
        "master_dtype": policy.master_dtype,
        "reduce_dtype": policy.reduce_dtype,
    }


def build_stage12(
    settings: ZeroSettings,
    policy: PrecisionPolicy,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    *,
    find_unused_parameters: bool,
    groups: ShardingGroups | None = None,
    reduce_gradients: bool = True,
) -> ShardedOptimizer:
    """The ZeRO-1/2 engine over ``module`` and ``optimizer`` (rebuilt in place over this rank's shards); collective.
    ``groups``: the ranks to shard over, created by the caller (``tensor_parallel_scratch``: the data-parallel group
    of a mesh); ``None``: those of ``settings.shard_size``, created here (hybrid sharding). ``reduce_gradients``: see
    :class:`~lightning_zero.zero.stage12.ShardedOptimizer`."""
    groups = new_groups(settings.shard_size) if groups is None else groups
    return ShardedOptimizer(
        module,
        optimizer,
        stage=settings.stage,
        grad_sync=settings.grad_sync,
        bucket_cap_bytes=int(settings.bucket_size_mb * 2**20),
        find_unused_parameters=find_unused_parameters,
        accum_dtype=settings.grad_accum_dtype,
        grad_reduction=settings.grad_reduction,
        group=groups.shard,
        replicate_group=groups.replicate,
        reduce_gradients=reduce_gradients,
        elementwise_optimizers=settings.elementwise_optimizers,
        **engine_dtypes(policy),
    )


def build_stage3(
    settings: ZeroSettings,
    policy: PrecisionPolicy,
    module: nn.Module,
    *,
    device: torch.device,
    timeout: timedelta | None,
    find_unused_parameters: bool,
    rng_state: dict[str, torch.Tensor] | None = None,
    groups: ShardingGroups | None = None,
) -> ShardedParams:
    """The ZeRO-3 engine: ``module``'s parameters sharded per unit (attach the optimizer afterwards); collective.
    ``groups``: as for :func:`build_stage12`."""
    groups = new_groups(settings.shard_size) if groups is None else groups
    return ShardedParams(
        module,
        auto_wrap_policy=settings.auto_wrap_policy,
        min_num_params=settings.min_num_params,
        reshard_after_forward=settings.reshard_after_forward,
        grad_sync=settings.grad_sync,
        device=device,
        rng_state=rng_state,
        timeout=timeout,
        find_unused_parameters=find_unused_parameters,
        weight_block_size=settings.quant_block_size if settings.quantized_weights else None,
        grad_block_size=settings.quant_block_size if settings.quantized_grads else None,
        group=groups.shard,
        replicate_group=groups.replicate,
        check_group=groups.check,
        elementwise_optimizers=settings.elementwise_optimizers,
        **engine_dtypes(policy),
    )
