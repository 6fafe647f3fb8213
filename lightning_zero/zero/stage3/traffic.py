"""ZeRO-3 communication per optimizer step in theory, as the ledger counts it: pure functions, no processes.

[Note: stage-3 traffic] The ledger (``lightning_zero/comm/ledger.py``) records an all-gather's output and a
reduce-scatter's input, so for one segment of ``k`` elements per shard on N ranks both collectives count
``N * k * itemsize`` bytes, or ``N * (k + 4 * ceil(k / B))`` when sent as blockwise int8 in blocks of B (ZeRO++'s qwZ
for the all-gather, qgZ for the reduce-scatter; [Note: blockwise quantization] in ``lightning_zero/comm/quantize.py``:
each rank's shard, or each chunk of its unsharded gradient, is quantized in blocks of its own).

Per optimizer step with one micro-batch (``grad_sync="microbatch"``; with accumulation multiply the reduce-scatter by
the micro-batches, or not with ``"boundary"``): each unit is gathered before its forward and again before its backward
(2 gathers), except the root unit, kept from its first use to its gradients' reduction, and every unit with
``reshard_after_forward=False`` (1 gather; so is a unit whose output needs no gradient, which has no backward).
Each trainable segment is reduce-scattered once. So with Ψ parameters, fp32 and every unit resharded: about 8Ψ of
all-gather and 4Ψ of reduce-scatter per step; qwZ makes the first about 2Ψ (1 byte per element plus 4 per block),
qgZ the second about Ψ.

With hybrid sharding ([Note: hybrid sharding] in ``lightning_zero/zero/hybrid.py``) N is the shard group's size, and
each trainable segment's reduced shard is then all-reduced across the replicas: ``k * itemsize`` more bytes under
``"grads"`` (the ledger records an all-reduce's input), in the reduce dtype (qgZ: the shard's, after dequantizing).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightning_zero.comm.quantize import quantized_nbytes


def collective_nbytes(shard_numel: int, world_size: int, itemsize: int, block_size: int | None = None) -> int:
    """Ledger bytes of one segment's all-gather (or reduce-scatter): ``shard_numel`` elements per rank of
    ``itemsize`` bytes, or blockwise int8 in blocks of ``block_size`` when given."""
    per_rank = shard_numel * itemsize if block_size is None else quantized_nbytes(shard_numel, block_size)
    return world_size * per_rank


def gathers_per_step(root: bool, reshard_after_forward: bool) -> int:
    """All-gathers of a unit per optimizer step ([Note: stage-3 traffic])."""
    return 1 if root or not reshard_after_forward else 2


@dataclass(frozen=True)
class SegmentTraffic:
    """What the traffic of one segment depends on."""

    shard_numel: int
    gathers: int  # all-gathers per step: gathers_per_step(...)
    trainable: bool  # reduce-scattered once per step
    gather_itemsize: int = 4  # bytes per element of the all-gather (param_dtype)
    reduce_itemsize: int = 4  # bytes per element of the reduce-scatter (reduce_dtype)


def step_nbytes(
    segments: Iterable[SegmentTraffic],
    world_size: int,
    *,
    weight_block_size: int | None = None,
    grad_block_size: int | None = None,
    hybrid: bool = False,
) -> dict[str, int]:
    """Ledger bytes per optimizer step: ``{"params": all-gather output bytes, "grads": reduce-scatter input bytes}``,
    the ledger's tags; ``weight_block_size`` / ``grad_block_size``: qwZ / qgZ in blocks of that size (``None``: off);
    ``hybrid``: plus the replicas' all-reduce of each reduced shard (``world_size`` is then the shard group's)."""
    segments = list(segments)
    params = sum(
        s.gathers * collective_nbytes(s.shard_numel, world_size, s.gather_itemsize, weight_block_size) for s in segments
    )
    grads = sum(
        collective_nbytes(s.shard_numel, world_size, s.reduce_itemsize, grad_block_size)
        for s in segments
        if s.trainable
    )
    if hybrid:
        grads += sum(s.shard_numel * s.reduce_itemsize for s in segments if s.trainable)
    return {"params": params, "grads": grads}
