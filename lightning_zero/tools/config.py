"""The checks ``lightning-zero-train`` runs on a composed config before any process starts.

Values out of range (``strategy.stage=4``) and keys added with a ``+`` (``+strategy.bucket_size_m=10``) are caught by
:func:`validate_config`, which builds the strategy's schema (:mod:`lightning_zero.tools.config_schema`, its
``__post_init__``) and checks the trainer's settings against it, right after composition and before any ``Trainer``
or process exists.
"""

from __future__ import annotations

import difflib
import inspect
import os
import pydoc
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_zero.robust.engine import check_precision_settings, check_sharding
from lightning_zero.tools.config_schema import (
    ConfigError,
    PipelineStrategyConf,
    RobustDDPStrategyConf,
    TensorParallelStrategyConf,
    ZeroStrategyConf,
)
from lightning_zero.training.mesh import Mesh
from lightning_zero.training.precision import resolve_policy, unified_precision
from lightning_zero.zero.hybrid import check_shard_size

# Hydra's structured configs need ``Optional[...]`` (not ``X | None``) on Python 3.10.

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


def _check_robust(schema: RobustDDPStrategyConf, devices: Any, num_nodes: int) -> None:
    """The rule's tolerance bound for n = devices x num_nodes x workers_per_rank (when devices is a number)."""
    processes = _processes(devices, num_nodes)
    if processes is None:
        return
    try:
        schema.check_byzantine(processes)
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
