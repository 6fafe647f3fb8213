"""Typed Hydra configs (structured-config schemas) of our strategies for ``lightning-zero-train``.

The YAML files of the ``strategy`` group (``lightning_zero/conf/strategy/*_scratch.yaml``) extend the schemas stored
here in Hydra's ConfigStore (``defaults: [/zero_scratch_schema@_here_, _self_]``; also ``/ddp_scratch_schema``,
``/robust_ddp_scratch_schema``, ``/pipeline_scratch_schema`` and ``/tensor_parallel_scratch_schema``), so a misspelt key
or a value of the wrong type fails while the config is composed. The schemas sit at the root of the ConfigStore, in no
config group: they are no ``strategy=`` option and ``--help`` does not list them. Each schema's ``__post_init__``
checks its values (``strategy.stage=4``); :func:`lightning_zero.tools.config.validate_config` builds it after
composition, with the checks that need the trainer's settings too.
"""

from __future__ import annotations

import pydoc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional, cast

from omegaconf import MISSING

from lightning_zero.byzantine.exchange import check_settings as check_byzantine_settings
from lightning_zero.comm.hierarchy import check_algorithm
from lightning_zero.comm.link_model import resolve_link_model
from lightning_zero.comm.powersgd_config import compression_config
from lightning_zero.comm.watchdog import DEFAULT_TIMEOUT as DEFAULT_COLLECTIVE_TIMEOUT
from lightning_zero.comm.watchdog import check_timeout
from lightning_zero.robust.aggregation import RobustAggregator
from lightning_zero.robust.engine import check_sharding, check_workers
from lightning_zero.strategies.robust_zero import check_settings as check_robust_zero
from lightning_zero.training.distributed import START_METHODS
from lightning_zero.training.module_classes import module_classes, optimizer_classes
from lightning_zero.training.precision import parse_dtype
from lightning_zero.zero.hybrid import check_shard_size
from lightning_zero.zero.optimizer_checks import GRAD_SYNC_MODES, check_grad_reduction
from lightning_zero.zero.settings import QUANT_BLOCK_SIZE, STAGES, STATE_DICT_TYPES, check_quantization
from lightning_zero.zero.stage3.materialize import MODEL_INIT_MODES

# Hydra's structured configs need ``Optional[...]`` (not ``X | None``) on Python 3.10.
# ruff: noqa: UP045

# The CLI accepts the backends it can run (the strategies also take "mpi" and "ucc").
BACKENDS = ("gloo", "nccl")


class ConfigError(ValueError):
    """A composed configuration that cannot run; the message names the key, the value and what is allowed."""


@contextmanager
def as_config_error() -> Iterator[None]:
    """The library's own checks (``ValueError``, already naming the setting) raised as :class:`ConfigError`."""
    try:
        yield
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_common(
    backend: Optional[str], timeout: float, start_method: str, collective_timeout: Optional[float] = None
) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ConfigError(f"process_group_backend={backend!r} is invalid: expected one of {BACKENDS} or null")
    if isinstance(timeout, bool) or timeout <= 0:
        raise ConfigError(f"timeout={timeout!r} is invalid: expected a number of seconds > 0")
    with as_config_error():
        check_timeout(collective_timeout)
    if start_method not in START_METHODS:
        raise ConfigError(f"start_method={start_method!r} is invalid: expected one of {START_METHODS}")


def _check_precision_settings(schema: Any) -> None:
    with as_config_error():
        parse_dtype("param_dtype", schema.param_dtype)
        parse_dtype("reduce_dtype", schema.reduce_dtype)


def _check_module_classes(schema: Any) -> None:
    """The import paths of ``activation_checkpointing_policy`` (and ``auto_wrap_policy``) import to module classes."""
    for setting in ("activation_checkpointing_policy", "auto_wrap_policy"):
        with as_config_error():
            module_classes(setting, getattr(schema, setting, None))


def _check_bucket(bucket_size_mb: float) -> None:
    if bucket_size_mb <= 0:
        raise ConfigError(f"bucket_size_mb={bucket_size_mb!r} is invalid: expected a number of MiB > 0")


def _check_state_dict_type(value: Any) -> None:
    if value not in STATE_DICT_TYPES:
        raise ConfigError(f"state_dict_type={value!r} is invalid: expected one of {STATE_DICT_TYPES}")


@dataclass
class _LaunchConf:
    """The process-group settings every strategy takes (``_target_`` first: it opens the composed config)."""

    _target_: str = MISSING
    process_group_backend: Optional[str] = None
    timeout: float = 1800.0
    collective_timeout: Optional[float] = DEFAULT_COLLECTIVE_TIMEOUT
    start_method: str = "popen"

    def __post_init__(self) -> None:
        _check_common(self.process_group_backend, self.timeout, self.start_method, self.collective_timeout)


@dataclass
class _DataParallelConf(_LaunchConf):
    """The settings of :class:`~lightning_zero.strategies.base.ScratchParallelStrategy` that ``ddp_scratch``, the
    ZeRO strategies and the robust ones share (a subclass may change a default: the robust ones keep no masters)."""

    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    param_dtype: Optional[str] = "auto"
    reduce_dtype: Optional[str] = "auto"
    master_weights: bool = True
    cast_module: bool = False
    activation_checkpointing_policy: Optional[list[str]] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_precision_settings(self)
        _check_module_classes(self)


@dataclass
class ScratchDDPStrategyConf(_DataParallelConf):
    """Schema of ``strategy=ddp_scratch`` (:class:`lightning_zero.ScratchDDPStrategy`)."""

    _target_: str = "lightning_zero.ScratchDDPStrategy"
    bucket_size_mb: float = 25.0
    grad_compression: Optional[str] = None
    powersgd: dict[str, Any] = field(default_factory=dict)
    all_reduce_algorithm: str = "auto"
    link_model: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bucket(self.bucket_size_mb)
        with as_config_error():
            compression_config(self.grad_compression, self.powersgd, reduce_dtype=self.reduce_dtype)
            check_algorithm(self.all_reduce_algorithm)
            resolve_link_model(self.link_model)


@dataclass
class ZeroStrategyConf(_DataParallelConf):
    """Schema of ``strategy=zero{1,2,3}_scratch`` (:class:`lightning_zero.ZeroStrategy`)."""

    _target_: str = "lightning_zero.ZeroStrategy"
    stage: int = 2
    grad_sync: Optional[str] = None
    bucket_size_mb: float = 25.0
    state_dict_type: str = "sharded"
    auto_wrap_policy: Optional[list[str]] = None
    min_num_params: Optional[int] = None
    reshard_after_forward: bool = True
    model_init: str = "auto"
    grad_accum_dtype: Optional[str] = None
    quantized_weights: bool = False
    quantized_grads: bool = False
    quant_block_size: int = QUANT_BLOCK_SIZE
    shard_size: Optional[int] = None
    grad_reduction: str = "auto"
    elementwise_optimizers: Optional[list[str]] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stage not in STAGES:
            raise ConfigError(f"stage={self.stage!r} is invalid: expected 1, 2 or 3")
        if self.grad_sync is not None and self.grad_sync not in GRAD_SYNC_MODES:
            raise ConfigError(f"grad_sync={self.grad_sync!r} is invalid: expected one of {GRAD_SYNC_MODES} or null")
        _check_bucket(self.bucket_size_mb)
        _check_state_dict_type(self.state_dict_type)
        if self.min_num_params is not None and self.min_num_params < 1:
            raise ConfigError(f"min_num_params={self.min_num_params!r} is invalid: expected null or an integer >= 1")
        if self.model_init not in MODEL_INIT_MODES:
            raise ConfigError(f"model_init={self.model_init!r} is invalid: expected one of {MODEL_INIT_MODES}")
        if self.auto_wrap_policy is not None and self.min_num_params is not None:
            raise ConfigError("auto_wrap_policy and min_num_params are exclusive: set one of them (or neither)")
        stage3 = {
            "auto_wrap_policy": self.auto_wrap_policy is not None,
            "min_num_params": self.min_num_params is not None,
            "reshard_after_forward": not self.reshard_after_forward,
            "model_init": self.model_init != "auto",
            "quantized_weights": self.quantized_weights,
            "quantized_grads": self.quantized_grads,
            "quant_block_size": self.quant_block_size != QUANT_BLOCK_SIZE,
        }
        if self.stage != 3 and any(stage3.values()):
            settings = ", ".join(f"{k}={getattr(self, k)!r}" for k, v in stage3.items() if v)
            raise ConfigError(f"{settings} apply to stage=3 only: got stage={self.stage}")
        with as_config_error():
            optimizer_classes("elementwise_optimizers", self.elementwise_optimizers)
            parse_dtype("grad_accum_dtype", self.grad_accum_dtype)
        if self.stage == 3 and self.grad_accum_dtype not in (None, "auto"):
            raise ConfigError(f"grad_accum_dtype={self.grad_accum_dtype!r} applies to stages 1 and 2 only: got stage=3")
        with as_config_error():
            check_quantization(self.quant_block_size, self.quantized_grads, self.reduce_dtype)
            check_shard_size(self.shard_size)
            check_grad_reduction(self.grad_reduction, self.stage, self.grad_sync)


@dataclass
class RobustDDPStrategyConf(_DataParallelConf):
    """Schema of ``strategy=robust_ddp_scratch`` (:class:`lightning_zero.RobustDDPStrategy`). Names and parameters
    are checked here; the tolerance bound of the rule for n = devices x num_nodes x workers_per_rank in
    :func:`validate_config`."""

    _target_: str = "lightning_zero.RobustDDPStrategy"
    aggregator: str = "mean"
    f: int = 0
    aggregator_kwargs: dict[str, Any] = field(default_factory=dict)
    pre_aggregators: list[Any] = field(default_factory=list)
    workers_per_rank: int = 1
    worker_momentum: float = 0.0
    attack: Optional[str] = None
    attack_kwargs: dict[str, Any] = field(default_factory=dict)
    byzantine_workers: Optional[list[int]] = None
    seed: int = 0
    sharded_aggregation: bool = False
    aggregation_replicas: int = 1
    byzantine_ranks: int = 0
    byzantine_timeout: float = 10.0
    byzantine_rank_behaviour: Optional[str] = None
    byzantine_behaving_ranks: Optional[list[int]] = None
    master_weights: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        with as_config_error():
            check_workers(self.workers_per_rank, self.worker_momentum)
            check_sharding(self.sharded_aggregation, self.aggregation_replicas)
            self.check_byzantine()
        self.aggregator_pipeline()

    def check_byzantine(self, world_size: int | None = None) -> None:
        """The Byzantine ranks settings (``world_size``: when the processes are known)."""
        ranks = None if self.byzantine_behaving_ranks is None else list(self.byzantine_behaving_ranks)
        check_byzantine_settings(
            self.byzantine_ranks, self.byzantine_timeout, self.aggregator, self.aggregation_replicas,
            self.byzantine_rank_behaviour, ranks, world_size, self.workers_per_rank,
        )  # fmt: skip

    def aggregator_pipeline(self) -> RobustAggregator:
        """The aggregator these settings build (unknown names and parameters raise :class:`ConfigError`)."""
        with as_config_error():
            return RobustAggregator(
                self.aggregator,
                self.f,
                self.aggregator_kwargs,
                self.pre_aggregators,
                self.attack,
                self.attack_kwargs,
                self.byzantine_workers,
                self.seed,
            )


@dataclass
class RobustZeroStrategyConf(RobustDDPStrategyConf):
    """Schema of ``strategy=robust_zero{1,2}_scratch`` (:class:`lightning_zero.RobustZeroStrategy`): the robust
    settings, the ZeRO stage and the checkpoint kind."""

    _target_: str = "lightning_zero.RobustZeroStrategy"
    stage: int = 2
    state_dict_type: str = "sharded"
    sharded_aggregation: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        with as_config_error():
            check_robust_zero(self.stage, asdict(self))
        _check_state_dict_type(self.state_dict_type)


@dataclass
class _CheckedByItsStrategy(_LaunchConf):
    """The settings of a schema whose strategy's constructor checks its values itself (it builds nothing)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        settings = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        with as_config_error():
            cast(Any, pydoc.locate(self._target_))(**settings)


@dataclass
class PipelineStrategyConf(_CheckedByItsStrategy):
    """Schema of ``strategy=pipeline_scratch`` (:class:`lightning_zero.PipelineStrategy`)."""

    _target_: str = "lightning_zero.PipelineStrategy"
    micro_batches: int = 4
    schedule: str = "1f1b"
    layers: Optional[str] = None
    balance: Optional[list[int]] = None
    stages: Optional[int] = None
    model_init: str = "full"
    state_dict_type: str = "full"
    measure_activations: bool = False


@dataclass
class TensorParallelStrategyConf(_CheckedByItsStrategy):
    """Schema of ``strategy=tensor_parallel_scratch`` (:class:`lightning_zero.TensorParallelStrategy`); the plan's
    import path is checked too."""

    _target_: str = "lightning_zero.TensorParallelStrategy"
    tensor_parallel_size: Optional[int] = None
    plan: Optional[str] = None
    plan_root: str = ""
    bucket_size_mb: float = 25.0
    zero_stage: int = 0
    state_dict_type: str = "full"


SCHEMAS: dict[str, type] = {
    "ddp_scratch_schema": ScratchDDPStrategyConf,
    "zero_scratch_schema": ZeroStrategyConf,
    "robust_ddp_scratch_schema": RobustDDPStrategyConf,
    "robust_zero_scratch_schema": RobustZeroStrategyConf,
    "pipeline_scratch_schema": PipelineStrategyConf,
    "tensor_parallel_scratch_schema": TensorParallelStrategyConf,
}


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore; safe to call again.

    At the root, not in the ``strategy`` group: a config of a group is an option of it (``strategy=<name>``, listed
    by ``--help`` and by Hydra's errors), and a schema alone is no strategy. The YAMLs extend them from their group
    with an absolute path: ``- /zero_scratch_schema@_here_``.
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(name=name, node=node)
