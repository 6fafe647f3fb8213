"""ZeRO++'s quantized collectives (qwZ's all-gather, qgZ's reduce-scatter): the collectives of
:mod:`lightning_zero.comm.collectives` with their payload sent as blockwise int8 ([Note: blockwise quantization] in
``lightning_zero/comm/quantize.py``), through that shim's own calls and ledger.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm.collectives import Handle, all_gather, finish, nbytes_of
from lightning_zero.comm.groups import ReduceOpName, world_size
from lightning_zero.comm.ledger import LEDGER
from lightning_zero.comm.quantize import dequantize, pack, quantize, unpack


def all_gather_quantized(
    output: Tensor,
    input: Tensor,
    block_size: int,
    *,
    group: Any = None,
    async_op: bool = False,
    tag: str = "",
    dtype: torch.dtype | None = None,
) -> Handle | None:
    """:func:`all_gather` with the pieces sent as blockwise int8 (ZeRO++'s qwZ; [Note: blockwise quantization] in
    ``lightning_zero/comm/quantize.py``): each rank quantizes its ``input`` (k elements), the packed values and
    scales are all-gathered in one call (the ledger records ``N * (k + 4 * ceil(k / block_size))`` bytes, about a
    quarter of fp32), and on completion every piece, this rank's own included, is dequantized into ``output`` (so
    every rank holds the same values), rounded to ``dtype`` on the way when given (e.g. bf16 values in an fp32
    ``output``, as :func:`all_gather` gives them). Lossy: each element within half a step of its block."""
    n, k = world_size(group), input.numel()
    if output.numel() != k * n:
        raise ValueError(f"all_gather output has {output.numel()} elements: expected world_size={n} x input {k}")
    packed = pack(*quantize(input.reshape(-1), block_size))
    everyone = packed.new_empty(n * packed.numel())
    handle = all_gather(everyone, packed, group=group, async_op=True, tag=tag)

    def dequantize_pieces() -> None:  # one rank's piece at a time: a temporary of k fp32 values, not N k
        for row, out in zip(everyone.view(n, -1), output.view(n, k)):
            dequantize(*unpack(row, k), block_size, dtype or output.dtype, out=out)

    return finish([handle], async_op, then=dequantize_pieces)


QUANTIZED_REDUCE_OPS = ("sum", "avg", "mean")
"""The ops of :func:`reduce_scatter_quantized`: sums of dequantized contributions."""


def reduce_scatter_quantized(
    output: Tensor,
    input: Tensor,
    block_size: int,
    op: ReduceOpName = "avg",
    *,
    group: Any = None,
    async_op: bool = False,
    tag: str = "",
) -> Handle | None:
    """:func:`reduce_scatter` with the contributions sent as blockwise int8 (ZeRO++'s qgZ).

    [Note: quantized reduce-scatter] Rank r quantizes chunk d of its ``input`` (the piece bound for rank d, k
    elements) in blocks of its own ([Note: blockwise quantization] in ``lightning_zero/comm/quantize.py``), and one
    all-to-all sends every rank its chunks, packed with their scales; the ledger records this rank's input on the
    wire, ``N * (k + 4 * ceil(k / block_size))`` bytes. On completion each rank dequantizes the N contributions to
    its chunk (its own included) to fp32, sums them in fp32 in rank order, divides by N for ``"avg"`` and writes the
    result into ``output`` (any float dtype): the reduction runs in higher precision after dequantisation, as
    ZeRO++'s does, so only the N quantizations are lossy. Each contribution is off by at most half a step of its
    block, so the average is within ``sum_r max_error(chunk d of rank r) / N`` of the exact one (plus fp32
    rounding). ``input`` is quantized before this returns: it may change at once.
    """
    if op not in QUANTIZED_REDUCE_OPS:
        raise ValueError(f"reduce_scatter_quantized op {op!r} is invalid: expected one of {QUANTIZED_REDUCE_OPS}")
    n, k = world_size(group), output.numel()
    if input.numel() != k * n:
        raise ValueError(f"reduce_scatter input has {input.numel()} elements: expected world_size={n} x output {k}")
    packed = pack(*quantize(input.reshape(n, k), block_size))  # (n, k + 4 * blocks): row d goes to rank d
    LEDGER.record("reduce_scatter", tag, nbytes_of(packed))
    received = packed if n == 1 else torch.empty_like(packed)
    works = [] if n == 1 else [dist.all_to_all_single(received, packed, group=group, async_op=True)]
    described = {"op": "reduce_scatter", "tag": tag, "nbytes": nbytes_of(packed), "group": group}

    def combine() -> None:  # contribution r is rank r's chunk for this rank
        total = dequantize(*unpack(received[0], k), block_size)
        piece = torch.empty_like(total)
        for row in received[1:]:
            total.add_(dequantize(*unpack(row, k), block_size, out=piece))
        if op != "sum":
            total.div_(n)
        output.view(-1).copy_(total)

    return finish(works, async_op, then=combine, **described)
