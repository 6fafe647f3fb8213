"""Optimizer-step time of lightning_zero's strategies against their peers, plus model-state bytes against the formulas.

Runbook (2 CPU ranks, gloo, one thread each; each full run takes several minutes on a 2-core machine)::

    # DDP figures: ddp_scratch vs Lightning ddp vs nocomm (the default --candidates), gpt25m, 12 steps x 3 rounds
    torchrun --nproc_per_node 2 benchmarks/step_time.py
    # ZeRO figures: zero1_scratch and zero2_scratch vs Lightning ddp and ddp + torch's ZeroRedundancyOptimizer
    torchrun --nproc_per_node 2 benchmarks/step_time.py --candidates zero1_scratch zero2_scratch ddp ddp_zero_redundancy
    # ZeRO-3 figures: zero3_scratch vs FSDP2 (fully_shard under Lightning's ModelParallelStrategy), ddp and nocomm
    torchrun --nproc_per_node 2 benchmarks/step_time.py --candidates zero3_scratch fsdp2 ddp nocomm
    # Mixed-precision figures: all four of ours vs Lightning ddp and FSDP2, every candidate at bf16-mixed; the same
    # candidates without --precision (32-true) give the fp32 figures to compare with
    C="ddp_scratch zero1_scratch zero2_scratch zero3_scratch ddp fsdp2"
    torchrun --nproc_per_node 2 benchmarks/step_time.py --precision bf16-mixed --candidates $C
    # smoke run (seconds; takes --candidates as above)
    torchrun --nproc_per_node 2 benchmarks/step_time.py --preset tiny --steps 4 --warmup 1 --rounds 1

Protocol: in one torchrun launch, each round fits the *same* model (same seed, same init, same data,
``AdamW(fused=True)``, the Trainer's ``precision=--precision``) for ``--steps`` optimizer steps under every candidate in
turn (A B C A B C ...), so machine drift hits all candidates alike. Each optimizer step is timed from
``on_train_batch_start`` to ``on_train_batch_end``; the first ``--warmup`` steps of every fit are dropped. A step's time
is the slowest rank's time for that step (the step is not done until every rank is). Only ratios measured within one run
are meaningful: absolute times move ~20% between runs on this machine.

Candidates:

- ``ddp_scratch``: :class:`lightning_zero.ScratchDDPStrategy` (bucketed all-reduce overlapped with backward).
- ``ddp_scratch_bf16comm``, ``ddp_scratch_powersgd``: ``ddp_scratch`` with a communication option (README
  "Communication options"): ``reduce_dtype="bf16"`` (gradients averaged in bf16, 2Ψ bytes per step), or PowerSGD at
  rank 4 from the first step (:data:`POWERSGD`); the traffic line compares the ledger with each option's theory.
- ``ddp_scratch_first_layout``: ``ddp_scratch`` that keeps its first buckets (reverse registration order) instead of
  rebuilding them by arrival after the first step ([Note: bucket rebuild] in ``lightning_zero/dp/rebuild.py``): with
  ``--head-first`` (the LM head registered before the embeddings) it shows what the rebuild buys.
- ``ddp_scratch_native``: ``ddp_scratch`` with ``all_reduce_algorithm="native"``, gloo's own all-reduce for every
  bucket: on several nodes of several ranks, the peer of the default ``"auto"``, which takes the hierarchical
  all-reduce there ([Note: hierarchical all-reduce] in ``lightning_zero/comm/hierarchy.py``).
- ``ddp``: Lightning's built-in ``DDPStrategy()`` (torch ``DistributedDataParallel``), defaults.
- ``ddp_powersgd_hook``: torch DDP with torch's own ``powerSGD_hook`` at the settings of ``ddp_scratch_powersgd``
  (rank 4, from its earliest iteration, 2; error feedback, warm start), the peer of ``ddp_scratch_powersgd``. Lightning
  registers comm hooks on CUDA only, so :class:`PowerSGDHookStrategy` registers it itself; one bucket
  (``bucket_cap_mb=4096``), because torch's hook with several buckets can interleave its P and Q all-reduces
  differently on two gloo ranks ("Received data size doesn't match", ``tests/comm/test_powersgd.py``).
- ``nocomm``: ``ScratchDDPStrategy`` with gradient sync switched off for every step: the same per-rank work (the
  reducer's hooks still copy gradients into its buckets) with no collective at all. ``x - nocomm`` is the cost of
  communication that backward did not hide.
- ``zero1_scratch``, ``zero2_scratch``: :class:`lightning_zero.ZeroStrategy` with ``stage=1`` / ``stage=2`` (default
  ``grad_sync`` and ``grad_reduction="auto"``: stage 2 reduces each bucket's pieces into their owners, [Note: gradient
  reduction] in ``lightning_zero/zero/stage12_reduction.py``).
- ``zero2_scratch_all_reduce``: ``zero2_scratch`` with ``grad_reduction="all_reduce"`` (every rank receives the whole
  averaged bucket): the peer that shows what reducing to owners saves.
- ``zero3_scratch_quantized``: ``zero3_scratch`` with ZeRO++'s qwZ and qgZ (``quantized_weights=True``,
  ``quantized_grads=True``: parameters all-gathered and gradients reduce-scattered as blockwise int8).
- ``ddp_zero_redundancy``: Lightning's ``DDPStrategy()`` with the same AdamW inside torch's
  ``ZeroRedundancyOptimizer`` (``GPTLightningModule(zero_redundancy=True)``): the peer of ``zero1_scratch``.
- ``fsdp2``: Lightning's ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)``; the module's
  ``configure_model`` applies torch's FSDP2 ``fully_shard`` to every transformer ``Block``, then to the root model
  (default ``reshard_after_forward=True``), on the mesh's ``"data_parallel"`` dimension. The same
  ``AdamW(fused=True)`` steps the DTensor parameter shards: the fused CPU kernel handles DTensors (checked on torch
  2.13 against an unsharded model), so every candidate keeps the fused optimizer. The peer of ``zero3_scratch``.
- ``zero3_scratch_hybrid``: ``zero3_scratch`` with ``shard_size=LOCAL_WORLD_SIZE`` (hybrid sharding: parameters
  sharded and gathered inside each node, gradients averaged across nodes); its peers are ``zero3_scratch`` (the
  ``vs zero3_scratch`` column) and ``fsdp2_hsdp``.
- ``fsdp2_hsdp``: FSDP2's HSDP, ``fully_shard`` on a 2-D ``(nodes, ranks per node)`` mesh (Lightning's
  ``ModelParallelStrategy(data_parallel_size=nodes, tensor_parallel_size=ranks per node)``, the module applying
  ``fully_shard`` on the whole mesh). Lightning's sampler follows the first dimension, so a node's ranks get the same
  batches: the same work per rank, so a timing peer, not a training setup. Model states are not counted for either.
- ``zero3_scratch``: :class:`lightning_zero.ZeroStrategy` with ``stage=3`` and ``auto_wrap_policy={Block}`` (each
  ``Block`` gathered on its own, like ``fsdp2``'s units; the rest is the root unit). The model is built on the meta
  device in ``configure_model`` and materialised with each module's ``reset_parameters()`` (so its initial weights
  differ from the other candidates', which does not change the step time).

Precision (``--precision``, default ``32-true``): under ``bf16-mixed`` Lightning's ``MixedPrecision`` plugin runs every
candidate's forward under CPU autocast to bf16. lightning_zero's strategies take their default policy from it
([Note: precision policy] in ``lightning_zero/training/precision.py``): gradients reduced and accumulated in fp32; the
ZeRO stages gather the parameters in bf16 and the module computes with their rounded values (they warn once about it, on
stderr), with fp32 master shards. ``fsdp2`` gets FSDP2's
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` in ``configure_model``, the same rules:
without it FSDP2 would gather fp32 under autocast. ``ModelParallelStrategy`` also accepts ``bf16-true``, but there
Lightning casts the module to bf16 before sharding, so shards, gradients and AdamW's moments are bf16 with no fp32
master: not the peer of the ZeRO stages.

Columns ``vs ddp``, ``vs nocomm``, ``vs ddp_zero_redundancy``, ``vs fsdp2`` and ``vs zero3_scratch`` (each only when
that candidate runs) are ratios of median step times.

Memory: at ``on_train_end`` of every fit (before teardown), the per-rank model-state bytes are counted with
:func:`lightning_zero.training.memory.strategy_model_state_bytes` (params, grads, optimizer state, strategy buffers;
each storage once, in that order; the same count as the ``RunStats`` callback's) and compared with the ZeRO paper's
accounting, :func:`lightning_zero.training.memory.zero_model_state_bytes`, for Ψ trainable parameters, N ranks, each
candidate's stage (:data:`STAGES`) and the bytes per element it keeps at ``--precision`` (:data:`STATE_BYTES`: params,
grads, optimizer K). ``32-true``, fp32 AdamW (4, 4, 8), gives the floors: ``ddp_scratch`` (and Lightning ``ddp``) 16Ψ,
``zero1_scratch`` (and ``ddp_zero_redundancy``) 8Ψ + 8Ψ/N (4Ψ params + 4Ψ grads + 8Ψ/N Adam), ``zero2_scratch`` 4Ψ +
12Ψ/N (4Ψ + 4Ψ/N + 8Ψ/N), ``zero3_scratch`` and ``fsdp2`` 16Ψ/N (4Ψ/N + 4Ψ/N + 8Ψ/N). ``bf16-mixed`` (the README's table
in "Mixed precision") is the same except for ``zero1_scratch`` and ``zero2_scratch``, whose fp32 master shard makes K =
12: 8Ψ + 12Ψ/N and 4Ψ + 16Ψ/N. The ratio is printed for params + grads + optimizer and for the total; the two differ by
the strategy buffers that no gradient aliases (zero2's two-bucket pool). For lightning_zero's candidates the strategy
counts itself (``strategy.model_state_bytes()``): for the ZeRO candidates the parameters include the engine's shard
parameters and the buffers are ``engine.strategy_buffers`` (with stage 2's default ``grad_sync="microbatch"`` the
gradient is the shard accumulator, ``shard.grad``). For Lightning's ``ddp`` and ``ddp_zero_redundancy`` the strategy
buffers of torch's C++ DDP reducer (~4Ψ of buckets) are not visible from Python and are left out;
``ddp_zero_redundancy``'s optimizer state is that of its local optimizer (``.optim``). ``fsdp2``'s parameters, gradients
and AdamW moments are DTensors: their local shards (``DTensor.to_local()``, padded as FSDP2 pads them) are counted; its
all-gather/reduce-scatter buffers (and, under ``bf16-mixed``, its bf16 unsharded parameters) are internal and transient
(freed between steps), so no strategy buffers are reported. ``nocomm`` is not measured (same tensors as
``ddp_scratch``).

Traffic: :data:`lightning_zero.comm.collectives.LEDGER` gives the bytes per optimizer step of the gradient reduction
(tag ``"grads"``, all-reduce or reduce-scatter of the buckets, input bytes) for the lightning_zero candidates, against
4Ψ (fp32 at both precisions), and of the parameter all-gather (tag ``"params"``, output bytes) for the ZeRO candidates,
in their default ``param_dtype`` (b = 4 bytes under ``32-true``, 2 under ``bf16-mixed``): after the step for stages 1
and 2, against bΨ; before each unit's forward and again before its backward for stage 3, against 2bΨ. Lightning's
candidates (``ddp``, ``ddp_zero_redundancy``, ``fsdp2``) bypass the ledger.

The process group is created by the first fit and reused by every later one: Lightning's ``_init_dist_connection`` (used
by ``DDPStrategy``, ``ModelParallelStrategy`` and by lightning_zero's strategies) returns early when
``torch.distributed`` is initialised, and no strategy destroys the group in ``teardown``. The script checks that the
group object never changes (each ``fsdp2`` fit's ``init_device_mesh`` adds one subgroup of its own, destroyed with the
rest at the end). Nothing of a fit outlives it but plain numbers (:class:`FitStats`), so each fit's model and
optimizer state are freed before the next, and ``destroy_process_group`` at the end really destroys the gloo group
(joining its worker threads) before the interpreter exits.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from torch.utils.data import DataLoader, Dataset

from lightning_zero import ScratchDDPStrategy, ZeroStrategy
from lightning_zero.comm.collectives import LEDGER
from lightning_zero.comm.powersgd import compressed_step_bytes
from lightning_zero.comm.powersgd_config import PowerSGDConfig
from lightning_zero.training.memory import ModelStateBytes, strategy_model_state_bytes, zero_model_state_bytes
from lightning_zero.training.precision import LOW_PRECISION

try:  # run as a script, sys.path[0] is benchmarks/; imported from the repo root, it is a namespace package
    from benchmarks.gpt import GPT, PRESETS, Block, GPTConfig, GPTLightningModule, random_token_dataset
    from benchmarks.processes import launch_prefix
except ImportError:
    from gpt import GPT, PRESETS, Block, GPTConfig, GPTLightningModule, random_token_dataset  # type: ignore[no-redef]
    from processes import launch_prefix  # type: ignore[no-redef]

CANDIDATES = (
    "ddp_scratch",
    "ddp_scratch_first_layout",
    "ddp_scratch_native",
    "ddp_scratch_bf16comm",
    "ddp_scratch_powersgd",
    "ddp",
    "ddp_powersgd_hook",
    "nocomm",
    "zero1_scratch",
    "zero2_scratch",
    "zero2_scratch_all_reduce",
    "ddp_zero_redundancy",
    "fsdp2",
    "zero3_scratch",
    "zero3_scratch_quantized",
    "zero3_scratch_hybrid",
    "fsdp2_hsdp",
)
DEFAULT_CANDIDATES = ("ddp_scratch", "ddp", "nocomm")  # the DDP figures; independent of --preset
PEERS = ("ddp", "nocomm", "ddp_powersgd_hook", "ddp_zero_redundancy", "fsdp2", "zero3_scratch")  # ratio columns
ZERO_CANDIDATES = ("zero1_scratch", "zero2_scratch", "zero3_scratch")
COMM_OPTIONS = ("ddp_scratch_bf16comm", "ddp_scratch_powersgd")  # README "Communication options"
ZERO_OPTIONS = ("zero2_scratch_all_reduce", "zero3_scratch_quantized")  # README "Communication options"
POWERSGD = {"rank": 4, "start_iter": 0}  # compress from the first step: every timed step is a compressed one
LEDGER_CANDIDATES = (
    "ddp_scratch",
    "ddp_scratch_first_layout",
    "ddp_scratch_native",
    *COMM_OPTIONS,
    *ZERO_CANDIDATES,
    *ZERO_OPTIONS,
)  # communicate through lightning_zero.comm.collectives
PHASES = ("forward", "backward", "optimizer")  # of a step, as StepTimer splits it
PRECISIONS = ("32-true", "bf16-mixed")  # those the model-state table below covers
# Parameter all-gathers per optimizer step, in units of Ψ elements: once after the step (stages 1 and 2), before each
# unit's forward and again before its backward (stage 3). Each element is sent in the stages' default param_dtype.
PARAM_GATHERS = {
    "zero1_scratch": 1,
    "zero2_scratch": 1,
    "zero2_scratch_all_reduce": 1,
    "zero3_scratch": 2,
    "zero3_scratch_quantized": 2,
}
# Candidates whose strategy buffers are not visible from Python, and why.
HIDDEN_BUFFERS = {
    "ddp": "C++ DDP buckets",
    "ddp_powersgd_hook": "C++ DDP buckets",
    "ddp_zero_redundancy": "C++ DDP buckets",
    "fsdp2": "FSDP2's transient communication buffers",
}
# Model states per rank as the ZeRO paper counts them (lightning_zero.training.memory.zero_model_state_bytes): the stage
# (0: plain data parallelism) that shards each candidate's states ...
STAGES = {
    "ddp_scratch": 0,
    "ddp_scratch_first_layout": 0,
    "ddp_scratch_native": 0,
    "ddp_scratch_bf16comm": 0,
    "ddp_scratch_powersgd": 0,  # + PowerSGD's error feedback (4Ψ) and Q memories, in the strategy buffers
    "ddp": 0,
    "ddp_powersgd_hook": 0,  # + torch's error feedback and Q memories (C++-side state, not counted)
    "zero1_scratch": 1,
    "ddp_zero_redundancy": 1,
    "zero2_scratch": 2,
    "zero2_scratch_all_reduce": 2,
    "zero3_scratch": 3,
    "zero3_scratch_quantized": 3,
    "fsdp2": 3,
}
# ... and the bytes per element it keeps (params, grads, optimizer K). 32-true: fp32 AdamW, 4, 4, 8. bf16-mixed (the
# README's table): the modules stay fp32 and gradients accumulate in fp32; ZeRO-1/2 keep an fp32 master shard apart
# from the parameters they gather in bf16 (K = 12), ZeRO-3's fp32 shard is the master and ddp_scratch's fp32
# parameters are; Lightning's ddp only adds autocast, and FSDP2's MixedPrecisionPolicy keeps fp32 shards.
STATE_BYTES = {
    "32-true": dict.fromkeys(STAGES, (4, 4, 8)),
    "bf16-mixed": {
        **dict.fromkeys(STAGES, (4, 4, 8)),
        "zero1_scratch": (4, 4, 12),
        "zero2_scratch": (4, 4, 12),
        "zero2_scratch_all_reduce": (4, 4, 12),
    },
}
MIB = 2**20


class NoCommStrategy(ScratchDDPStrategy):
    """``ddp_scratch`` minus communication: the compute peer every data-parallel candidate is compared with.

    The reducer stays installed (its hooks keep binding ``p.grad`` to bucket views, as in ``ddp_scratch``) but every
    backward runs in its no-sync state. ``GradientReducer.no_sync`` restores the previous value on exit, so the
    ``block_backward_sync`` Lightning enters on non-boundary micro-batches keeps it off too.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(broadcast_buffers=False, **kwargs)  # no per-step buffer broadcast either

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        if self.reducer is not None:
            self.reducer.require_backward_grad_sync = False


class PowerSGDHookStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with torch's ``powerSGD_hook`` registered on any device (Lightning registers comm
    hooks on CUDA only): the torch peer of ``ddp_scratch_powersgd``."""

    def __init__(self) -> None:
        super().__init__(bucket_cap_mb=4096)  # one bucket: see the module docstring

    def _register_ddp_hooks(self) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD["rank"],
            start_powerSGD_iter=2,  # torch's earliest with error feedback or warm start
        )
        self.model.register_comm_hook(state, powersgd.powerSGD_hook)


class FirstLayoutStrategy(ScratchDDPStrategy):
    """``ddp_scratch`` without the rebuild of its buckets by arrival order: the peer that shows what it buys."""

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        if self.reducer is not None:
            self.reducer.keep_layout()


class StepTimer(L.Callback):
    """Wall time of every optimizer step (``accumulate_grad_batches=1``: one batch = one step) on this rank, and of
    its phases (:data:`PHASES`): forward (to ``on_before_backward``), backward (to ``on_after_backward``: it includes
    the wait for the gradient reduction, which every data-parallel candidate finishes inside backward), and the rest
    (clipping, the optimizer step, ZeRO's parameter all-gather of stages 1 and 2)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.phases: list[tuple[float, ...]] = []
        self._marks: list[float] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._marks = [time.perf_counter()]

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._marks.append(time.perf_counter())

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._marks.append(time.perf_counter())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        marks = [*self._marks, time.perf_counter()]
        self.times.append(marks[-1] - marks[0])
        if len(marks) == len(PHASES) + 1:  # one backward in the step
            self.phases.append(tuple(b - a for a, b in pairwise(marks)))


@dataclass
class FitStats:
    """What one fit leaves behind: ledger traffic over the whole fit and model-state bytes at its end."""

    grad_bytes: int = 0
    grad_calls: int = 0
    param_bytes: int = 0
    steps: int = 0
    memory: ModelStateBytes | None = None


class CommProbe(L.Callback):
    """Fills a :class:`FitStats`: ledger traffic during training, model-state bytes at the end.

    ``on_train_end`` runs before ``strategy.teardown``, so ``trainer.strategy.reducer`` / ``.engine`` (and their
    buffers) still exist and the last step's gradients are still bound. Keep ``probe.stats``, not the probe: Lightning
    binds ``pl_module.log`` / ``log_dict`` onto every callback, so a kept callback keeps the module, the trainer, the
    optimizer state and (through them) the process group alive.
    """

    def __init__(self, measure_memory: bool) -> None:
        self.measure_memory = measure_memory
        self.stats = FitStats()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        LEDGER.reset()  # drop setup traffic (the initial parameter broadcast is tagged "sync_states" anyway)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stats = self.stats
        # "grads", and PowerSGD's "grads_powersgd_p"/"_q"/"_uncompressed"
        grads = [v for (op, tag), v in LEDGER.summary().items() if op != "send" and tag.startswith("grads")]
        stats.grad_calls, stats.grad_bytes = sum(c for c, _ in grads), sum(b for _, b in grads)
        stats.param_bytes = LEDGER.bytes("all_gather", "params")
        stats.steps = trainer.global_step
        if not self.measure_memory:
            return
        stats.memory = strategy_model_state_bytes(trainer.strategy)


@dataclass
class CandidateResult:
    times: list[float] = field(default_factory=list)  # seconds, warm-up dropped, all rounds
    phases: list[tuple[float, ...]] = field(default_factory=list)  # per kept step: seconds per PHASES entry
    stats: list[FitStats] = field(default_factory=list)  # one per fit


def make_strategy(name: str, bucket_size_mb: float, world_size: int) -> Strategy:
    if name == "ddp_scratch":
        return ScratchDDPStrategy(bucket_size_mb=bucket_size_mb)
    if name == "ddp_scratch_native":
        return ScratchDDPStrategy(bucket_size_mb=bucket_size_mb, all_reduce_algorithm="native")
    if name == "ddp_scratch_first_layout":
        return FirstLayoutStrategy(bucket_size_mb=bucket_size_mb)
    if name == "ddp_scratch_bf16comm":
        return ScratchDDPStrategy(bucket_size_mb=bucket_size_mb, reduce_dtype="bf16")
    if name == "ddp_scratch_powersgd":
        return ScratchDDPStrategy(bucket_size_mb=bucket_size_mb, grad_compression="powersgd", powersgd=POWERSGD)
    if name == "ddp":
        return DDPStrategy()  # Lightning's defaults (25 MiB buckets, no gradient_as_bucket_view)
    if name == "ddp_powersgd_hook":
        return PowerSGDHookStrategy()
    if name == "nocomm":
        return NoCommStrategy(bucket_size_mb=bucket_size_mb)
    if name in (
        "zero3_scratch",
        "zero3_scratch_quantized",
    ):  # one gather unit per Block, like fsdp2's fully_shard units
        quantized = name == "zero3_scratch_quantized"
        return ZeroStrategy(stage=3, auto_wrap_policy={Block}, quantized_weights=quantized, quantized_grads=quantized)
    if name in ZERO_CANDIDATES:
        return ZeroStrategy(stage=int(name[4]), bucket_size_mb=bucket_size_mb)  # default grad_sync of the stage
    if name == "zero2_scratch_all_reduce":
        return ZeroStrategy(stage=2, bucket_size_mb=bucket_size_mb, grad_reduction="all_reduce")
    if name == "fsdp2":
        # Pure data parallelism on a (N, 1) mesh: the "auto" sizes would make it tensor-parallel within a node, and
        # the DistributedSampler (sized by the data-parallel dimension) would give every rank the same batches.
        # GPTLightningModule.configure_model applies fully_shard on the mesh's "data_parallel" dimension.
        return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    if name == "ddp_zero_redundancy":
        # The optimizer is ZeroRedundancyOptimizer(AdamW): GPTLightningModule(zero_redundancy=True) in fit_once.
        return DDPStrategy()
    if name == "zero3_scratch_hybrid":  # parameters gathered inside each node's group of its ranks
        return ZeroStrategy(stage=3, auto_wrap_policy={Block}, shard_size=int(os.environ["LOCAL_WORLD_SIZE"]))
    if name == "fsdp2_hsdp":
        # FSDP2's HSDP on a (nodes, ranks per node) mesh: GPTLightningModule(hsdp=True). Lightning sizes the sampler
        # by the first dimension, so the ranks of a node see the same batches: the same work, a timing peer only.
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        return ModelParallelStrategy(data_parallel_size=world_size // local, tensor_parallel_size=local)
    raise ValueError(f"unknown candidate {name!r}: expected one of {CANDIDATES}")


def fit_once(
    name: str, args: argparse.Namespace, dataset: Dataset, devices: int, num_nodes: int
) -> tuple[StepTimer, FitStats]:
    """One fit of a freshly initialised model under candidate ``name``; returns (its step timer, FitStats)."""
    L.seed_everything(args.seed, verbose=False)  # same init and same DistributedSampler order for every candidate
    module = GPTLightningModule(
        model_config(args), zero_redundancy=name == "ddp_zero_redundancy", hsdp=name == "fsdp2_hsdp"
    )
    timer = StepTimer()
    probe = CommProbe(measure_memory=name in STAGES)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=make_strategy(name, args.bucket_size_mb, devices * num_nodes),
        precision=args.precision,
        max_steps=args.steps,
        callbacks=[timer, probe],
        **QUIET_TRAINER,
    )
    trainer.fit(module, DataLoader(dataset, batch_size=args.batch_size))
    if trainer.global_step != args.steps:
        raise RuntimeError(f"{name}: ran {trainer.global_step} optimizer steps, expected {args.steps}")
    # Free this fit's model, optimizer state and buckets before the next candidate allocates its own.
    del trainer, module
    gc.collect()
    return timer, probe.stats


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def reproduce_command(args: argparse.Namespace, nproc: int) -> str:
    script = os.path.relpath(os.path.abspath(__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return (
        f"{launch_prefix(nproc)} {script} --preset {args.preset} --steps {args.steps}"
        f" --warmup {args.warmup} --rounds {args.rounds} --batch-size {args.batch_size}"
        f" --bucket-size-mb {args.bucket_size_mb:g} --seed {args.seed} --precision {args.precision}"
        f"{' --head-first' if args.head_first else ''} --candidates {' '.join(args.candidates)}"
    )


def model_config(args: argparse.Namespace) -> GPTConfig:
    return replace(PRESETS[args.preset], head_first=args.head_first)


QUIET_TRAINER = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,  # nothing is logged; only avoids the "fewer batches than the log interval" warning
}
"""The Trainer arguments of every timed fit (shared with ``benchmarks/gpu_step_time.py``)."""


def add_protocol_arguments(
    parser: argparse.ArgumentParser, *, steps: int, warmup: int, rounds: int, batch_size: int
) -> None:
    """The protocol's options, shared with ``benchmarks/gpu_step_time.py`` (with its own defaults)."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpt25m")
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps per fit")
    parser.add_argument("--warmup", type=int, default=warmup, help="steps dropped at the start of every fit")
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds over all candidates")
    parser.add_argument("--batch-size", type=int, default=batch_size, help="sequences per rank per step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_protocol_arguments(parser, steps=12, warmup=3, rounds=3, batch_size=2)
    parser.add_argument(
        "--bucket-size-mb", type=float, default=25.0, help="bucket cap (MiB) of ddp_scratch, nocomm and zero*_scratch"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--head-first", action="store_true", help="register the LM head before the embeddings (same forward)"
    )
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="32-true", help="the Trainer's precision, for every candidate"
    )
    parser.add_argument(
        "--candidates",
        nargs="+",
        choices=CANDIDATES,
        default=list(DEFAULT_CANDIDATES),
        help=f"fitted in this order every round (default: {' '.join(DEFAULT_CANDIDATES)})",
    )
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.rounds < 1 or args.batch_size < 1 or args.bucket_size_mb <= 0:
        parser.error("--rounds and --batch-size must be >= 1 and --bucket-size-mb > 0")
    return args


def quiet_lightning() -> None:
    """Keep stdout to the tables: Lightning's info logs and the warnings that do not apply to a synthetic benchmark."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_utilities"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=r".*can run with static graph.*")
    # Lightning 2.6.6 on torch 2.13 (lightning/pytorch/utilities/_pytree.py), once per rank, not ours to fix.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "LOCAL_WORLD_SIZE" not in os.environ:
        sys.exit("launch with torchrun, e.g.: torchrun --nproc_per_node 2 benchmarks/step_time.py")
    torch.set_num_threads(1)  # 2 ranks on 2 cores: one thread each, or ranks fight for cores
    quiet_lightning()
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    world = int(os.environ["WORLD_SIZE"])
    num_nodes = world // local_world
    is_rank0 = int(os.environ["RANK"]) == 0
    config = model_config(args)

    if is_rank0:
        print(f"reproduce: {reproduce_command(args, local_world)}")
        print(
            f"torch {torch.__version__}, lightning {L.__version__}, {world} ranks x {torch.get_num_threads()} thread,"
            f" preset {args.preset} ({config.n_layer}L x {config.n_embd}, vocab {config.vocab_size},"
            f" T={config.block_size}{', LM head registered first' if config.head_first else ''}),"
            f" {args.batch_size} seq/rank, {args.precision}, AdamW(fused=True)",
            flush=True,
        )

    # Enough distinct samples for one epoch of max_steps on every rank (the DistributedSampler splits them).
    dataset = random_token_dataset(
        args.steps * args.batch_size * world, config.block_size, config.vocab_size, args.seed
    )
    results = {name: CandidateResult() for name in args.candidates}
    world_group = None
    fits = 0
    for round_idx in range(args.rounds):
        for name in args.candidates:
            timer, stats = fit_once(name, args, dataset, local_world, num_nodes)
            fits += 1
            # The first fit creates the default process group; every later fit, whichever strategy, must reuse it.
            if world_group is None:
                world_group = dist.group.WORLD
            elif dist.group.WORLD is not world_group:
                raise RuntimeError(f"round {round_idx + 1}, {name}: the default process group was re-created")
            results[name].times.extend(timer.times[args.warmup :])
            results[name].phases.extend(timer.phases[args.warmup :])
            results[name].stats.append(stats)

    # Per-rank step times -> the slowest rank's time for each step.
    local_times = {name: r.times for name, r in results.items()}
    gathered: list[dict[str, list[float]]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, local_times)
    gathered_phases: list[dict[str, list[tuple[float, ...]]]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered_phases, {name: r.phases for name, r in results.items()})
    memories = {name: [s.memory for s in r.stats] for name, r in results.items() if name in STAGES}
    gathered_memory: list[dict[str, list[ModelStateBytes | None]]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered_memory, memories)

    if is_rank0:
        report(args, config, results, gathered, gathered_memory, fits)
        report_phases(gathered_phases)
    dist.barrier()
    dist.destroy_process_group()


def report_phases(gathered: list[dict[str, list[tuple[float, ...]]]]) -> None:
    """Median time per phase of a step (:class:`StepTimer`), each the slowest rank's for that step: what overlap can
    hide. A synchronous step cannot start a gradient's reduction before backward produces it, nor the next forward
    before the optimizer step, so at best a step takes forward + max(backward, reduction) + optimizer."""
    print("\nphases, ms (median over steps of the slowest rank's time for each phase)")
    width = max(20, *(len(name) for name in gathered[0]))
    print(f"{'candidate':<{width}}" + "".join(f" {phase:>10}" for phase in PHASES))
    for name in gathered[0]:
        per_step = zip(*(g[name] for g in gathered), strict=True)
        slowest = [[max(rank[i] for rank in ranks) for i in range(len(PHASES))] for ranks in per_step]
        if slowest:
            medians = [1e3 * statistics.median(column) for column in zip(*slowest)]
            print(f"{name:<{width}}" + "".join(f" {m:>10.1f}" for m in medians))


def report(
    args: argparse.Namespace,
    config: GPTConfig,
    results: dict[str, CandidateResult],
    gathered: list[dict[str, list[float]]],
    gathered_memory: list[dict[str, list[ModelStateBytes | None]]],
    fits: int,
) -> None:
    psi = GPT(config).num_parameters()
    world = len(gathered)
    medians: dict[str, float] = {}
    rows = []
    for name in results:
        # strict: every rank ran the same steps; unequal lengths would mean a bug, not data to truncate.
        per_step = [max(ts) for ts in zip(*(g[name] for g in gathered), strict=True)]
        kept = args.steps - args.warmup  # each fit contributed this many consecutive entries
        rounds = [statistics.median(per_step[i : i + kept]) for i in range(0, len(per_step), kept)]
        p25, med, p75 = quartiles(per_step)
        medians[name] = med
        rows.append((name, med, p25, p75, len(per_step), rounds))
    peers = [peer for peer in PEERS if peer in medians]

    print(f"\nstep time, ms (slowest rank per step; {args.warmup} warm-up steps dropped per fit; {fits} fits,")
    print("process group created by the first fit and reused by all)")
    width = max(20, *(len(name) for name, *_ in rows))
    header = f"{'candidate':<{width}} {'median':>8} {'p25':>8} {'p75':>8} {'n':>4}"
    header += "".join(f" {'vs ' + peer:>{max(9, len(peer) + 3)}}" for peer in peers) + "  per-round medians"
    print(header)
    print("-" * len(header))
    for name, med, p25, p75, n, rounds in rows:
        ratios = "".join(f" {med / medians[peer]:>{max(9, len(peer) + 3)}.3f}" for peer in peers)
        per_round = " / ".join(f"{1e3 * r:.1f}" for r in rounds)
        print(f"{name:<{width}} {1e3 * med:8.1f} {1e3 * p25:8.1f} {1e3 * p75:8.1f} {n:>4}{ratios}  {per_round}")
    if "nocomm" in medians:
        exposed = ", ".join(f"{n} {1e3 * (m - medians['nocomm']):+.1f}" for n, m in medians.items() if n != "nocomm")
        print(f"exposed communication (median - nocomm median), ms: {exposed}")
        leaked = sum(s.grad_bytes for s in results["nocomm"].stats)
        print(f"nocomm gradient all-reduce bytes: {leaked} (must be 0)")

    gather_bytes = LOW_PRECISION.get(args.precision, torch.float32).itemsize  # the ZeRO stages' default param_dtype
    for name in results:
        if name in LEDGER_CANDIDATES:
            stats = results[name].stats[-1]
            grads = stats.grad_bytes / stats.steps
            line = (
                f"{name} per step: gradient reduction {grads / MIB:.2f} MiB in {stats.grad_calls / stats.steps:g}"
                f" calls = {grads / (4 * psi):.4f} x 4Ψ"
            )
            theory = grad_theory(name, config)
            if theory is not None:
                line += f" = {grads / theory:.4f} x its theory ({theory / MIB:.2f} MiB)"
            if name in PARAM_GATHERS:
                params = stats.param_bytes / stats.steps
                units = PARAM_GATHERS[name] * gather_bytes
                line += f", parameter all-gather {params / MIB:.2f} MiB = {params / (units * psi):.4f} x {units}Ψ"
            print(f"{line} (bucket cap {args.bucket_size_mb:g} MiB)")
        if name in STAGES:
            print(memory_line(name, args.precision, psi, world, gathered_memory))


def grad_theory(name: str, config: GPTConfig) -> float | None:
    """Gradient bytes per step of a communication option ([Note: PowerSGD, one bucket] for PowerSGD's)."""
    params = [p for p in GPT(config).parameters() if p.requires_grad]
    if name == "ddp_scratch_bf16comm":
        return 2 * sum(p.numel() for p in params)
    if name == "ddp_scratch_powersgd":
        return compressed_step_bytes([tuple(p.shape) for p in params], PowerSGDConfig.from_options(POWERSGD))
    return None


def memory_line(
    name: str, precision: str, psi: int, world: int, gathered_memory: list[dict[str, list[ModelStateBytes | None]]]
) -> str:
    """Model states of ``name`` against the ZeRO paper's accounting of them (:data:`STAGES`, :data:`STATE_BYTES`): the
    largest count over ranks and fits (equal up to padding)."""
    mems = [m for per_rank in gathered_memory for m in per_rank.get(name, []) if m is not None]
    worst = max(mems, key=lambda m: m.total)
    stage, (param_bytes, grad_bytes, optimizer_bytes) = STAGES[name], STATE_BYTES[precision][name]
    expected_psi = zero_model_state_bytes(
        stage, 1, world, param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes
    )
    expected = expected_psi * psi
    formula = (
        f"formula stage {stage}, {param_bytes}/{grad_bytes}/{optimizer_bytes} bytes per element (params/grads/K):"
        f" {expected_psi:g}Ψ ({expected / MIB:.2f} MiB)"
    )
    states = worst.params + worst.grads + worst.optimizer
    line = (
        f"{name} model states per rank, MiB (Ψ = {psi:,}, N = {world}): params {worst.params / MIB:.2f},"
        f" grads {worst.grads / MIB:.2f}, optimizer {worst.optimizer / MIB:.2f}"
    )
    if name in HIDDEN_BUFFERS:
        return (
            f"{line}, strategy_buffers n/a ({HIDDEN_BUFFERS[name]}); params+grads+optimizer {states / MIB:.2f}"
            f" = {states / expected:.4f} x {formula}"
        )
    return (
        f"{line}, strategy_buffers {worst.strategy_buffers / MIB:.2f}, total {worst.total / MIB:.2f}; {formula}:"
        f" params+grads+optimizer {states / expected:.4f} x, total {worst.total / expected:.4f} x"
    )


if __name__ == "__main__":
    main()
