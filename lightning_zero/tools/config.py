"""Typed Hydra configs for our strategies, and the checks ``lightning-zero-train`` runs before any process starts.

The YAML files of the ``strategy`` group (``lightning_zero/conf/strategy/*_scratch.yaml``) extend the schemas stored
here in Hydra's ConfigStore (``defaults: [/zero_scratch_schema@_here_, _self_]``; also ``/ddp_scratch_schema``,
``/robust_ddp_scratch_schema``, ``/pipeline_scratch_schema`` and ``/tensor_parallel_scratch_schema``), so a misspelt key
or a value of the wrong type fails while the config is composed. The schemas sit at the root of the ConfigStore, in no
config group: they are no ``strategy=`` option and ``--help`` does not list them. Values out of range
(``strategy.stage=4``) and keys added with a ``+`` (``+strategy.bucket_size_m=10``) are caught by
:func:`validate_config`, which builds the dataclass (its ``__post_init__``) and checks the trainer's settings, right
after composition and before any ``Trainer`` or process exists.
"""

from __future__ import annotations

import difflib
import inspect
import os
import pydoc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_zero.comm.powersgd import compression_config
from lightning_zero.comm.watchdog import DEFAULT_TIMEOUT as DEFAULT_COLLECTIVE_TIMEOUT
from lightning_zero.comm.watchdog import check_timeout
from lightning_zero.robust.aggregation import RobustAggregator
from lightning_zero.robust.engine import check_precision_settings, check_sharding, check_workers
from lightning_zero.strategies.robust_zero import check_settings as check_robust_zero
from lightning_zero.training.distributed import START_METHODS
from lightning_zero.training.mesh import Mesh
from lightning_zero.training.module_classes import module_classes, optimizer_classes
from lightning_zero.training.precision import parse_dtype, resolve_policy, unified_precision
from lightning_zero.zero.hybrid import check_shard_size
from lightning_zero.zero.settings import QUANT_BLOCK_SIZE, STAGES, STATE_DICT_TYPES, check_quantization
from lightning_zero.zero.stage3.materialize import MODEL_INIT_MODES
from lightning_zero.zero.stage12 import GRAD_SYNC_MODES, check_grad_reduction

# Hydra's structured configs need ``Optional[...]`` (not ``X | None``) on Python 3.10.
# ruff: noqa: UP045

# The CLI accepts the backends it can run (the strategies also take "mpi" and "ucc").
BACKENDS = ("gloo", "nccl")
MODEL_PARALLEL_TARGET = "lightning.pytorch.strategies.ModelParallelStrategy"  # strategy=fsdp2
# Keys Hydra reads from a node it instantiates; never arguments of the ``_target_``.
HYDRA_KEYS = frozenset({"_target_", "_args_", "_recursive_", "_convert_", "_partial_"})
# Lightning strategies that pass their ``**kwargs`` on to the torch wrapper they build: a key of ``strategy=ddp`` or
# ``strategy=fsdp`` may be an argument of either. Left out: the wrapper's arguments the strategy sets itself.
FORWARDED_KWARGS = {
    "lightning.pytorch.strategies.DDPStrategy": ("torch.nn.parallel.DistributedDataParallel", ("module", "device_ids")),
    "lightning.pytorch.strategies.FSDPStrategy": (
        "torch.distributed.fsdp.FullyShardedDataParallel",
        ("module", "device_id"),
    ),
}


class ConfigError(ValueError):
    """A composed configuration that cannot run; the message names the key, the value and what is allowed."""


@contextmanager
def _as_config_error() -> Iterator[None]:
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
    with _as_config_error():
        check_timeout(collective_timeout)
    if start_method not in START_METHODS:
        raise ConfigError(f"start_method={start_method!r} is invalid: expected one of {START_METHODS}")


def _check_precision_settings(schema: Any) -> None:
    with _as_config_error():
        parse_dtype("param_dtype", schema.param_dtype)
        parse_dtype("reduce_dtype", schema.reduce_dtype)


def _check_module_classes(schema: Any) -> None:
    """The import paths of ``activation_checkpointing_policy`` (and ``auto_wrap_policy``) import to module classes."""
    for setting in ("activation_checkpointing_policy", "auto_wrap_policy"):
        with _as_config_error():
            module_classes(setting, getattr(schema, setting, None))


def _check_bucket(bucket_size_mb: float) -> None:
    if bucket_size_mb <= 0:
        raise ConfigError(f"bucket_size_mb={bucket_size_mb!r} is invalid: expected a number of MiB > 0")


@dataclass
class ScratchDDPStrategyConf:
    """Schema of ``strategy=ddp_scratch`` (:class:`lightning_zero.ScratchDDPStrategy`)."""

    _target_: str = "lightning_zero.ScratchDDPStrategy"
    bucket_size_mb: float = 25.0
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    param_dtype: Optional[str] = "auto"
    reduce_dtype: Optional[str] = "auto"
    master_weights: bool = True
    cast_module: bool = False
    activation_checkpointing_policy: Optional[list[str]] = None
    process_group_backend: Optional[str] = None
    timeout: float = 1800.0
    collective_timeout: Optional[float] = DEFAULT_COLLECTIVE_TIMEOUT
    start_method: str = "popen"
    grad_compression: Optional[str] = None
    powersgd: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_bucket(self.bucket_size_mb)
        _check_common(self.process_group_backend, self.timeout, self.start_method, self.collective_timeout)
        _check_precision_settings(self)
        _check_module_classes(self)
        with _as_config_error():
            compression_config(self.grad_compression, self.powersgd, reduce_dtype=self.reduce_dtype)


@dataclass
class ZeroStrategyConf:
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
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    param_dtype: Optional[str] = "auto"
    reduce_dtype: Optional[str] = "auto"
    master_weights: bool = True
    cast_module: bool = False
    grad_accum_dtype: Optional[str] = None
    quantized_weights: bool = False
    quantized_grads: bool = False
    quant_block_size: int = QUANT_BLOCK_SIZE
    shard_size: Optional[int] = None
    grad_reduction: str = "auto"
    elementwise_optimizers: Optional[list[str]] = None
    activation_checkpointing_policy: Optional[list[str]] = None
    process_group_backend: Optional[str] = None
    timeout: float = 1800.0
    collective_timeout: Optional[float] = DEFAULT_COLLECTIVE_TIMEOUT
    start_method: str = "popen"

    def __post_init__(self) -> None:
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
        _check_common(self.process_group_backend, self.timeout, self.start_method, self.collective_timeout)
        _check_precision_settings(self)
        _check_module_classes(self)
        with _as_config_error():
            optimizer_classes("elementwise_optimizers", self.elementwise_optimizers)
            parse_dtype("grad_accum_dtype", self.grad_accum_dtype)
        if self.stage == 3 and self.grad_accum_dtype not in (None, "auto"):
            raise ConfigError(f"grad_accum_dtype={self.grad_accum_dtype!r} applies to stages 1 and 2 only: got stage=3")
        with _as_config_error():
            check_quantization(self.quant_block_size, self.quantized_grads, self.reduce_dtype)
            check_shard_size(self.shard_size)
            check_grad_reduction(self.grad_reduction, self.stage, self.grad_sync)


@dataclass
class RobustDDPStrategyConf:
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
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    param_dtype: Optional[str] = "auto"
    reduce_dtype: Optional[str] = "auto"
    master_weights: bool = False
    cast_module: bool = False
    activation_checkpointing_policy: Optional[list[str]] = None
    process_group_backend: Optional[str] = None
    timeout: float = 1800.0
    collective_timeout: Optional[float] = DEFAULT_COLLECTIVE_TIMEOUT
    start_method: str = "popen"

    def __post_init__(self) -> None:
        with _as_config_error():
            check_workers(self.workers_per_rank, self.worker_momentum)
            check_sharding(self.sharded_aggregation, self.aggregation_replicas)
        self.aggregator_pipeline()
        _check_common(self.process_group_backend, self.timeout, self.start_method, self.collective_timeout)
        _check_precision_settings(self)
        _check_module_classes(self)

    def aggregator_pipeline(self) -> RobustAggregator:
        """The aggregator these settings build (unknown names and parameters raise :class:`ConfigError`)."""
        with _as_config_error():
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
        with _as_config_error():
            check_robust_zero(self.stage, asdict(self))
        _check_state_dict_type(self.state_dict_type)


@dataclass
class _CheckedByItsStrategy:
    """The settings of a schema whose strategy's constructor checks its values itself (it builds nothing)."""

    process_group_backend: Optional[str] = None
    timeout: float = 1800.0
    collective_timeout: Optional[float] = DEFAULT_COLLECTIVE_TIMEOUT
    start_method: str = "popen"

    def __post_init__(self) -> None:
        _check_common(self.process_group_backend, self.timeout, self.start_method, self.collective_timeout)
        settings = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        with _as_config_error():
            pydoc.locate(self._target_)(**settings)  # type: ignore[attr-defined]


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


def _trainer_arguments() -> set[str]:
    from lightning.pytorch import Trainer

    return {name for name in inspect.signature(Trainer.__init__).parameters if name != "self"}


def _unknown_keys(section: str, unknown: list[str], allowed: set[str], owner: str) -> ConfigError:
    """One message for keys nothing takes (a ``+key=`` override is added without any check), with the close
    matches: Hydra's own hint for a misspelt key is to add it with a ``+``."""
    close = [m for key in unknown for m in difflib.get_close_matches(key, sorted(allowed - HYDRA_KEYS), n=1)]
    hint = f"; did you mean {', '.join(f'{section}.{m}' for m in close)}?" if close else ""
    return ConfigError(f"{section} has unknown keys {unknown}: they are not arguments of {owner}{hint}")


def _keyword_arguments(target: Any) -> tuple[set[str], bool]:
    """The names ``target`` (a class: its ``__init__``) takes by keyword, and whether it also takes ``**kwargs``."""
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): anything goes
        return set(), True
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind is p.VAR_KEYWORD for p in parameters)


def _check_strategy_keys(strategy: DictConfig) -> None:
    """Every key of ``strategy`` is a field of its schema (typed strategies) or an argument of its ``_target_``.

    An untyped ``_target_`` that takes ``**kwargs`` is checked with the wrapper it passes them to (DDP, FSDP: see
    :data:`FORWARDED_KWARGS`); one that passes them elsewhere is not checked (its own arguments alone would refuse
    keys it takes).
    """
    target = strategy.get("_target_")
    schema = OmegaConf.get_type(strategy)
    if is_dataclass(schema):
        allowed, owner = {f.name for f in fields(schema)}, str(target)
    elif isinstance(target, str):
        try:
            obj = pydoc.locate(target)
        except pydoc.ErrorDuringImport as err:
            raise ConfigError(f"strategy._target_={target!r} cannot be imported: {err.value!r}") from None
        if obj is None:
            raise ConfigError(f"strategy._target_={target!r} cannot be imported: expected the import path of a class")
        allowed, var_keyword = _keyword_arguments(obj)
        owner = target
        if var_keyword:
            forward = next((f for path, f in FORWARDED_KWARGS.items() if pydoc.locate(path) is obj), None)
            if forward is None:
                return
            wrapper, set_by_strategy = forward
            allowed |= _keyword_arguments(pydoc.locate(wrapper))[0] - set(set_by_strategy)
            owner = f"{target} nor of {wrapper} (its **kwargs)"
    else:
        return
    unknown = sorted(set(strategy) - HYDRA_KEYS - allowed)
    if unknown:
        raise _unknown_keys("strategy", unknown, allowed, owner)


def _check_devices(devices: Any) -> None:
    if devices in ("auto", -1, "-1"):
        return
    if isinstance(devices, bool):
        raise ConfigError(f"trainer.devices={devices!r} is invalid: expected an integer >= 1, -1, 'auto' or a list")
    if isinstance(devices, int) and devices < 1:
        raise ConfigError(
            f"trainer.devices={devices} is invalid: expected an integer >= 1 (processes per node), -1, 'auto'"
            " or a list of device indices"
        )
    if isinstance(devices, str) and devices.strip().isdigit() and int(devices) < 1:
        raise ConfigError(f"trainer.devices={devices!r} is invalid: expected an integer >= 1, -1, 'auto' or a list")
    if isinstance(devices, (list, tuple)) and not devices:
        raise ConfigError("trainer.devices=[] is invalid: expected a non-empty list of device indices")


def validate_config(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` with one clear message if ``cfg`` cannot run; touches no process or device."""
    strategy = cfg.get("strategy")
    schema = None
    if isinstance(strategy, DictConfig):
        _check_strategy_keys(strategy)  # before the dataclass is built: to_object drops keys it does not have
    if isinstance(strategy, DictConfig) and is_dataclass(OmegaConf.get_type(strategy)):
        try:
            schema = OmegaConf.to_object(strategy)  # builds the dataclass: runs its __post_init__
        except ConfigError as err:
            raise ConfigError(f"strategy ({strategy._target_}): {err}") from None
    trainer = cfg.get("trainer")
    if trainer is None:
        raise ConfigError("trainer is missing: choose one with trainer=cpu, trainer=gpu or trainer=ddp_sim")
    allowed = _trainer_arguments()
    unknown = sorted(set(trainer) - {"_target_"} - allowed)
    if unknown:
        raise _unknown_keys("trainer", unknown, allowed, "lightning.pytorch.Trainer")
    if "strategy" in trainer:
        raise ConfigError("trainer.strategy is not used: choose the strategy with strategy=<name>")
    _check_devices(trainer.get("devices", "auto"))
    num_nodes = trainer.get("num_nodes", 1)
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ConfigError(f"trainer.num_nodes={num_nodes!r} is invalid: expected an integer >= 1")
    max_steps = trainer.get("max_steps", -1)
    if max_steps is not None and (not isinstance(max_steps, int) or (max_steps != -1 and max_steps < 1)):
        raise ConfigError(f"trainer.max_steps={max_steps!r} is invalid: expected -1 (no limit) or an integer >= 1")
    if isinstance(strategy, DictConfig) and strategy.get("_target_") == MODEL_PARALLEL_TARGET:
        _check_model_parallel(strategy, trainer.get("devices", "auto"), num_nodes)
    if isinstance(schema, RobustDDPStrategyConf):
        _check_robust(schema, trainer.get("devices", "auto"), num_nodes)
    if isinstance(schema, ZeroStrategyConf):
        _check_shard_size(schema, trainer.get("devices", "auto"), num_nodes)
    if isinstance(schema, PipelineStrategyConf):
        _check_model_split(schema.stages, "stages", trainer.get("devices", "auto"), num_nodes, schema.balance)
    if isinstance(schema, TensorParallelStrategyConf):
        _check_model_split(
            schema.tensor_parallel_size, "tensor_parallel_size", trainer.get("devices", "auto"), num_nodes
        )
    if isinstance(schema, (PipelineStrategyConf, TensorParallelStrategyConf)):
        return _check_ckpt_path(cfg.get("ckpt_path"))  # no precision policy: these refuse its settings
    if schema is not None:
        _check_precision(schema, trainer.get("precision", "32-true"))
    _check_ckpt_path(cfg.get("ckpt_path"))


def _check_ckpt_path(ckpt_path: Any) -> None:
    """``ckpt_path`` is Lightning's ``fit(ckpt_path=...)``: ``last`` (resume if a ``last*.ckpt`` exists, else start),
    ``hpc`` (SLURM), or an existing checkpoint file or directory."""
    if ckpt_path is None or ckpt_path in ("last", "hpc"):
        return
    if not isinstance(ckpt_path, str) or not os.path.exists(ckpt_path):
        raise ConfigError(
            f"ckpt_path={ckpt_path!r} is invalid: expected null, 'last' (resume from the newest last*.ckpt in the"
            " checkpoint directory if there is one), 'hpc', or an existing checkpoint path"
        )


def _check_precision(schema: Any, precision: Any) -> None:
    """The precision settings against ``trainer.precision`` (the strategy resolves the same policy at run time)."""
    try:
        if isinstance(schema, RobustDDPStrategyConf):
            check_precision_settings(schema.param_dtype, schema.reduce_dtype, schema.master_weights, schema.cast_module)
        resolve_policy(
            unified_precision(precision),
            param_dtype=schema.param_dtype,
            reduce_dtype=schema.reduce_dtype,
            master_weights=schema.master_weights,
            cast_module=schema.cast_module,
            sharded=isinstance(schema, ZeroStrategyConf),
        )
    except ValueError as err:
        raise ConfigError(f"strategy ({schema._target_}) with trainer.precision={precision!r}: {err}") from None


def _processes(devices: Any, num_nodes: int) -> int | None:
    """devices x num_nodes when ``devices`` is a number of processes, else ``None`` ('auto', -1 or a list: the
    strategy checks when the Trainer is built)."""
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        return None
    return devices * num_nodes


def _check_shard_size(schema: ZeroStrategyConf, devices: Any, num_nodes: int) -> None:
    """``shard_size`` against devices x num_nodes processes (when devices is a number)."""
    processes = _processes(devices, num_nodes)
    if processes is not None and schema.shard_size is not None:
        try:
            check_shard_size(schema.shard_size, processes)
        except ValueError as err:
            raise ConfigError(
                f"strategy ({schema._target_}): {err} (trainer.devices={processes // num_nodes} x"
                f" trainer.num_nodes={num_nodes})"
            ) from None


def _check_model_split(
    size: int | None, name: str, devices: Any, num_nodes: int, balance: list[int] | None = None
) -> None:
    """A model split ``size`` ways (``name``: pipeline stages, tensor-parallel ranks) divides devices x num_nodes, and
    a pipeline's ``balance`` has one entry per stage (when devices is a number)."""
    processes = _processes(devices, num_nodes)
    if processes is None:
        return
    context = f"(trainer.devices={processes // num_nodes} x trainer.num_nodes={num_nodes})"
    size = size or processes
    try:
        Mesh(processes, size, name=name)
    except ValueError as err:
        raise ConfigError(f"strategy: {err} {context}") from None
    if balance is not None and len(balance) != size:
        raise ConfigError(
            f"strategy (pipeline_scratch): balance={list(balance)} has {len(balance)} entries: expected one per stage,"
            f" {size} {context}"
        )


def _check_state_dict_type(value: Any) -> None:
    if value not in STATE_DICT_TYPES:
        raise ConfigError(f"state_dict_type={value!r} is invalid: expected one of {STATE_DICT_TYPES}")


def _check_robust(schema: RobustDDPStrategyConf, devices: Any, num_nodes: int) -> None:
    """The rule's tolerance bound for n = devices x num_nodes x workers_per_rank (when devices is a number)."""
    processes = _processes(devices, num_nodes)
    if processes is None:
        return
    try:
        schema.aggregator_pipeline().validate(processes * schema.workers_per_rank)
        check_sharding(schema.sharded_aggregation, schema.aggregation_replicas, processes)
    except ValueError as err:
        devices = processes // num_nodes
        raise ConfigError(
            f"strategy (robust_ddp_scratch): {err} (n = trainer.devices={devices} x trainer.num_nodes={num_nodes}"
            f" x workers_per_rank={schema.workers_per_rank})"
        ) from None


def _check_model_parallel(strategy: DictConfig, devices: Any, num_nodes: int) -> None:
    """``strategy=fsdp2``: the device mesh (data x tensor parallel) must cover exactly the job's processes."""
    sizes = {}
    for key in ("data_parallel_size", "tensor_parallel_size"):
        value = strategy.get(key, "auto")
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            hint = " (strategy=fsdp2 takes it from trainer.devices: set a number of processes)"
            hint = hint if key == "data_parallel_size" else ""
            raise ConfigError(f"strategy.{key}={value!r} is invalid: expected 'auto' or an integer >= 1{hint}")
        sizes[key] = value
    dp, tp = sizes["data_parallel_size"], sizes["tensor_parallel_size"]
    if isinstance(dp, int) and isinstance(tp, int) and isinstance(devices, int) and devices >= 1:
        processes = devices * num_nodes
        if dp * tp != processes:
            raise ConfigError(
                f"strategy.data_parallel_size={dp} x strategy.tensor_parallel_size={tp} is invalid: expected"
                f" trainer.devices x trainer.num_nodes = {processes} processes"
            )
