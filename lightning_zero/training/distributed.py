"""What both front ends of every strategy share (the Trainer's in ``lightning_zero/strategies/``, Fabric's in
``lightning_zero/fabric/``): the settings, the ranks, the process group and Lightning's collectives.

:class:`DistributedPlumbing` is a mixin for a Lightning ``ParallelStrategy`` (``lightning.pytorch`` or
``lightning.fabric``), which provides ``cluster_environment``, ``parallel_devices`` and the ranks:

- **Settings** checked when the strategy is built (:meth:`DistributedPlumbing._init_settings`), with one error each.
- **The process group** from the cluster environment, backend ``gloo`` on CPU and ``nccl`` on CUDA unless
  ``process_group_backend`` says otherwise; torn down at exit ([Note: process group torn down at exit]).
- **Collectives** (``barrier``, ``broadcast``, ``all_reduce``, ``all_gather``) through
  :mod:`lightning_zero.comm.collectives`.
- **The precision policy** ([Note: precision policy] in ``lightning_zero/training/precision.py``) from the
  strategy's settings and the Lightning precision plugin's ``precision``.
"""

from __future__ import annotations

import atexit
import gc
import os
import time
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn

from lightning_zero.comm import collectives as comm
from lightning_zero.comm import watchdog
from lightning_zero.training import activation_checkpointing, faults
from lightning_zero.training.precision import (
    DEFAULT,
    PrecisionPolicy,
    ShardedGradScaler,
    cast_buffers,
    cast_floats,
    parse_dtype,
    resolve_policy,
    restore_buffers,
    unified_precision,
)

START_METHODS = ("popen", "spawn", "fork", "forkserver")
BACKENDS = ("gloo", "nccl", "mpi", "ucc")


def broadcast_module_states(module: Any, src: int = 0, tag: str = "sync_states", buffers_only: bool = False) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s (tied tensors are sent once)."""
    tensors = [] if buffers_only else list(module.parameters())
    tensors += list(module.buffers())
    for tensor in tensors:
        comm.broadcast(tensor.data, src, tag=tag)


def check_bucket_size(bucket_size_mb: Any) -> None:
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)) or bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb={bucket_size_mb!r} is invalid: expected a number of MiB > 0")


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid: expected True or False")


_exit_handler_registered = False

# [Note: process group torn down at exit]
# gloo runs each collective on a worker thread of its ProcessGroupGloo. The worker drops its reference to a finished
# work (and so to the work's tensors) only after the caller has been woken; where that was the last reference to a
# tensor whose Python object torch keeps alive for it, the worker deallocates that object, which takes the GIL. A
# worker that gets there once the interpreter is finalizing is stopped by CPython inside that destructor:
# std::terminate, SIGABRT ("terminate called without an active exception") after a fit that succeeded. Measured: 2 in
# 97 two-rank CLI runs of tensor_parallel_scratch, whose teardown ends with an all_gather (core dump: gloo's runLoop
# -> ~AsyncAllgatherWork -> THPVariable_dealloc -> take_gil -> pthread_exit, the main thread in Py_FinalizeEx's
# garbage collection); 0 in 60 with what follows. destroy_process_group does not stop gloo's workers: only freeing a
# group does, and a trainer, a strategy or a module may still hold its groups. So at exit, while the interpreter is
# whole: destroy, free what nothing reaches any more (a freed gloo group joins its workers, releasing the GIL in its
# destructor), and release the GIL for a moment so that a worker of a group still held can drop its last work.
_EXIT_GRACE_S = 0.2


def _destroy_process_group_at_exit() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()
        time.sleep(_EXIT_GRACE_S)


def destroy_process_group_at_exit() -> None:
    """Register (once per process) the ``atexit`` handler that destroys a process group still alive at exit."""
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(_destroy_process_group_at_exit)
        _exit_handler_registered = True


def _uses_torchrun_agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def elastic_attempt_store(timeout: timedelta | float | None) -> dist.Store:
    """torchrun's store, seen through a prefix of this restart attempt.

    [Note: torchrun restarts] With ``--rdzv-backend c10d`` (torchrun's default for ``--max-restarts``) the workers
    share the agent's rendezvous store across restarts, and ``init_process_group`` keys nothing by attempt
    (pytorch/pytorch#135712, #167288): a restarted rank can read a peer's address from the failed attempt and give up
    with ``Gloo connectFullMesh failed ... Connection refused``, or hang, as measured here in two restarts of four.
    Torch's own store handler used to add an ``attempt_<n>`` prefix; this puts it back. ``TORCHELASTIC_RESTART_COUNT``
    agrees across the ranks of one agent; a multi-node job whose agents restart unevenly should still launch
    ``torchrun`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (then this is not used).
    """
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout if timeout is not None else default_pg_timeout,
    )
    return dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def reduce_op_name(reduce_op: Any) -> str:
    """Lightning passes ``"mean"``/``"sum"``/... strings or ``torch.distributed.ReduceOp`` members."""
    if reduce_op is None:
        return "sum"
    if isinstance(reduce_op, str):
        return "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
    for name in ("sum", "avg", "max", "min", "product"):
        if reduce_op == getattr(dist.ReduceOp, name.upper()):
            return name
    raise ValueError(f"reduce_op={reduce_op!r} is invalid: expected 'mean', 'sum', 'max', 'min' or a ReduceOp")


Names = tuple[tuple[str, str, dict[str, Any]], ...]
"""A strategy class's registered names: ``(name, description, constructor arguments)``."""

DDP_NAMES: Names = (
    ("ddp_scratch", "From-scratch bucketed DDP, popen launcher", {}),
    ("ddp_scratch_spawn", "From-scratch bucketed DDP, spawn launcher", {"start_method": "spawn"}),
    (
        "ddp_scratch_find_unused_parameters_true",
        "From-scratch bucketed DDP allowing parameters without gradients",
        {"find_unused_parameters": True},
    ),
)
ZERO_NAMES: Names = tuple(
    entry
    for stage in (1, 2, 3)
    for entry in (
        (f"zero{stage}_scratch", f"From-scratch ZeRO stage {stage}", {"stage": stage}),
        (
            f"zero{stage}_scratch_spawn",
            f"From-scratch ZeRO stage {stage}, spawn launcher",
            {"stage": stage, "start_method": "spawn"},
        ),
    )
)
PIPELINE_NAMES: Names = (
    ("pipeline_scratch", "From-scratch pipeline parallelism (GPipe, 1F1B), popen launcher", {}),
    ("pipeline_scratch_spawn", "From-scratch pipeline parallelism, spawn launcher", {"start_method": "spawn"}),
)
TENSOR_PARALLEL_NAMES: Names = (
    ("tensor_parallel_scratch", "From-scratch Megatron tensor parallelism x data parallelism, popen launcher", {}),
    (
        "tensor_parallel_scratch_spawn",
        "From-scratch Megatron tensor parallelism x data parallelism, spawn launcher",
        {"start_method": "spawn"},
    ),
)
ROBUST_NAMES: Names = (
    ("robust_ddp_scratch", "Byzantine-robust data parallelism, popen launcher", {}),
    ("robust_ddp_scratch_spawn", "Byzantine-robust data parallelism, spawn launcher", {"start_method": "spawn"}),
)
ROBUST_ZERO_NAMES: Names = tuple(
    entry
    for stage in (1, 2)
    for entry in (
        (f"robust_zero{stage}_scratch", f"Byzantine-robust aggregation into ZeRO stage {stage}", {"stage": stage}),
        (
            f"robust_zero{stage}_scratch_spawn",
            f"Byzantine-robust aggregation into ZeRO stage {stage}, spawn launcher",
            {"stage": stage, "start_method": "spawn"},
        ),
    )
)


class DistributedPlumbing:
    """Mixin for a Lightning ``ParallelStrategy``: see the module docstring."""

    shards_parameters = False  # ZeRO: param_dtype defaults to the low-precision dtype under "-mixed"
    strategy_name = "scratch"
    parallel_devices: list[torch.device] | None
    cluster_environment: Any
    local_rank: int
    node_rank: int
    global_rank: int
    world_size: int

    def _init_settings(
        self,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        collective_timeout: timedelta | float | None = watchdog.DEFAULT_TIMEOUT,
        start_method: str = "popen",
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        param_dtype: Any = DEFAULT,
        reduce_dtype: Any = DEFAULT,
        master_weights: bool = True,
        cast_module: bool = False,
        activation_checkpointing_policy: Any = None,
    ) -> None:
        """Check and keep the settings both front ends take (documented on the Trainer's
        :class:`~lightning_zero.strategies.base.ScratchParallelStrategy`); each bad one raises naming itself."""
        check_flag("find_unused_parameters", find_unused_parameters)
        check_flag("broadcast_buffers", broadcast_buffers)
        check_flag("master_weights", master_weights)
        check_flag("cast_module", cast_module)
        self.activation_checkpointing_policy = activation_checkpointing.check_policy(activation_checkpointing_policy)
        self._precision_settings = {
            "param_dtype": parse_dtype("param_dtype", param_dtype),
            "reduce_dtype": parse_dtype("reduce_dtype", reduce_dtype),
            "master_weights": master_weights,
            "cast_module": cast_module,
        }
        if process_group_backend is not None and process_group_backend not in BACKENDS:
            raise ValueError(
                f"process_group_backend={process_group_backend!r} is invalid: expected one of {BACKENDS} or None"
                " (gloo on CPU, nccl on CUDA)"
            )
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r} is invalid: expected one of {START_METHODS}")
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            timeout = timedelta(seconds=timeout)
        if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
            raise ValueError(f"timeout={timeout!r} is invalid: expected a positive timedelta or number of seconds")
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.collective_timeout = watchdog.check_timeout(collective_timeout)
        self._start_method = start_method
        self._num_nodes = 1
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self._policy: PrecisionPolicy | None = None
        self._cast_buffers: dict[str, torch.dtype] = {}  # buffers cast by the policy, with their own dtypes

    def _lightning_precision(self) -> str:
        """The ``precision`` of the Lightning precision plugin this strategy runs with."""
        raise NotImplementedError

    @property
    def precision_policy(self) -> PrecisionPolicy:
        """The dtypes of this run, from the strategy's settings and the Lightning ``precision``."""
        if self._policy is None:
            precision = unified_precision(self._lightning_precision())
            self._policy = resolve_policy(precision, **self._precision_settings, sharded=self.shards_parameters)
        return self._policy

    def _setup_precision_of(self, plugin: Any, module: nn.Module | None, cast_module: bool) -> None:
        """At setup: the loss scaler made shard-aware; with ``cast_module`` (the engine casts the parameters) the
        float buffers and the float inputs of every step cast too."""
        policy = self.precision_policy
        mixed = str(getattr(plugin, "precision", "")).endswith("-mixed")
        rounds = mixed and policy.param_dtype is not None and not policy.casts_module
        if rounds and self._precision_settings["param_dtype"] == DEFAULT:
            rank_zero_warn(
                f"{self.strategy_name} with precision={plugin.precision!r} communicates the parameters in"
                f" param_dtype={policy.param_dtype} and the module computes with their rounded values, so the weights"
                " differ from Lightning's ddp by that rounding (fp32 master weights are updated). Pass"
                " param_dtype=None for ddp's arithmetic, or param_dtype='bf16'/'fp16' to silence this.",
                category=PossibleUserWarning,
            )
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and not isinstance(scaler, ShardedGradScaler):
            plugin.scaler = ShardedGradScaler.like(scaler)
        if cast_module and policy.casts_module and module is not None:
            self._cast_buffers.update(cast_buffers(module, policy.cast_dtype))
            plugin.convert_input = partial(cast_floats, dtype=policy.cast_dtype)

    def _teardown_precision_of(self, plugin: Any, module: nn.Module | None) -> None:
        """Undo :meth:`_setup_precision_of`'s casts (the buffers get their own dtype back)."""
        plugin.__dict__.pop("convert_input", None)
        if self._cast_buffers and module is not None:
            restore_buffers(module, self._cast_buffers)
        self._cast_buffers = {}

    # ------------------------------------------------------------ topology
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        if len(self.parallel_devices) == 1:
            # A process given one device uses it whatever its local rank: under Ray Train each worker is its own
            # Trainer (``devices="auto"`` counts one CPU) while its local rank counts the node's workers.
            return self.parallel_devices[0]
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The cluster environment's world size: ``set_world_ranks`` makes it num_nodes * num_processes where
        # Lightning counts the processes, and an environment that counts them itself (Ray Train's) reports its own.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        fabric_rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _resolved_backend(self) -> str:
        if self._process_group_backend is not None:
            return self._process_group_backend
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    def _init_process_group(self) -> None:
        """Ranks, backend and the process group (called from ``setup_environment``)."""
        self.set_world_ranks()
        self._process_group_backend = self._resolved_backend()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type == "cuda" else None
        store = {"store": elastic_attempt_store(self._timeout)} if _uses_torchrun_agent_store() else {}
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id, **store
        )
        destroy_process_group_at_exit()
        faults.record_process(self.global_rank)
        watchdog.configure(self.collective_timeout)  # [Note: collective watchdog] in lightning_zero/comm/watchdog.py
        watchdog.start()

    def _check_before_launch(self) -> None:
        """When the Trainer or Fabric attaches the accelerator and the precision plugin, before any process starts:
        the last moment to reject a bad combination."""
        self._policy = None  # the precision plugin may have changed: the policy is resolved again
        self.precision_policy  # noqa: B018
        if self.parallel_devices and self._process_group_backend == "nccl" and self.root_device.type != "cuda":
            raise ValueError(
                f"process_group_backend='nccl' needs CUDA devices, but this run uses {self.root_device.type!r}:"
                " use 'gloo' (or leave it unset) on CPU"
            )

    # ------------------------------------------------------------ Lightning's collectives
    def _device_ids(self) -> list[int] | None:
        return None if self.root_device.type == "cpu" else [self.root_device.index]

    def barrier(self, name: str | None = None) -> None:
        if comm.is_initialized():
            comm.barrier(device_ids=self._device_ids(), tag=name or "barrier")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not comm.is_initialized():
            return obj
        return comm.broadcast_object(obj, src, tag="strategy")

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce ``tensor`` in place across processes (``"mean"`` by default); non-tensors pass through."""
        if not isinstance(tensor, Tensor) or not comm.is_initialized():
            return tensor
        op = reduce_op_name(reduce_op)
        if op == "avg" and not tensor.is_floating_point():
            comm.all_reduce(tensor, "sum", group=group, tag="reduce")
            return tensor.copy_(tensor / comm.world_size(group))
        comm.all_reduce(tensor, op, group=group, tag="reduce")
        return tensor

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """Stack ``tensor`` from every process into ``(world_size, *shape)``."""
        if not comm.is_initialized():
            return tensor
        return comm.all_gather_stack(tensor, group=group, sync_grads=sync_grads, tag="strategy")

    # ------------------------------------------------------------ registration
    registered_names: Names = ()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register :attr:`registered_names` (the same names in the Trainer's and Fabric's registries); re-importing
        lightning_zero (or reloading it) replaces our own entries, never another's."""
        for name, description, init_params in cls.registered_names:
            if name in strategy_registry:
                owner = strategy_registry[name]["strategy"]
                if not owner.__module__.startswith("lightning_zero"):
                    raise ValueError(
                        f"strategy name {name!r} is already registered by {owner.__module__}.{owner.__name__}"
                    )
            strategy_registry.register(name, cls, description=description, override=True, **init_params)
