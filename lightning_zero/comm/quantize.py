"""Blockwise int8 quantization for compressed collectives (ZeRO++'s qwZ and qgZ): pure tensor functions.

[Note: blockwise quantization] A flat tensor is cut into blocks of ``block_size`` consecutive elements (the last one
padded with zeros). Each block gets one fp32 scale, its largest magnitude divided by 127, and each element is stored
as ``round(x / scale)`` in int8 (symmetric: -127..127, zero maps to zero). Dequantizing multiplies back.

- Error: rounding to the nearest step bounds every element's error by ``scale / 2 = absmax(block) / 254``, so the
  error is relative to the largest value *of its block*, not of the tensor: small blocks follow the local magnitude
  (an outlier spoils only its own block). :func:`max_error` gives the bound per element.
- Bytes: one byte per element plus four per block: ``numel + 4 * ceil(numel / block_size)``, about a quarter of fp32
  (:func:`quantized_nbytes`). ZeRO++ uses blocks of 2048 for weights and 512 for gradients; the block size is a
  setting of the engines that use this module.
- A block of zeros gets scale 0 and dequantizes to zeros exactly. Non-finite values are not representable: they
  raise, so that an overflow is not hidden inside a block.

Everything is vectorised over blocks (one reshape, one ``amax``, one division), on the tensor's device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

QMAX = 127
"""The largest int8 magnitude used (symmetric range, so that -x quantizes to -q)."""


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} is invalid: expected an integer >= 1")


def num_blocks(numel: int, block_size: int) -> int:
    _check_block_size(block_size)
    return math.ceil(numel / block_size)


def quantized_nbytes(numel: int, block_size: int) -> int:
    """Bytes of the int8 values and fp32 scales of ``numel`` elements (padding not counted)."""
    return numel + 4 * num_blocks(numel, block_size)


def _blocks(x: Tensor, block_size: int) -> Tensor:
    """``x`` flat, in fp32, zero-padded to whole blocks: ``(num_blocks, block_size)``."""
    flat = x.detach().reshape(-1).float()
    pad = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block_size)


def quantize(x: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """``x`` (any float dtype and shape) as ``(values, scales)``: int8 ``(num_blocks * block_size,)`` (padded) and
    fp32 ``(num_blocks,)``."""
    blocks = _blocks(x, block_size)
    if not torch.isfinite(blocks).all():
        raise ValueError("blockwise int8 quantization got a non-finite value (inf or NaN): it cannot be represented")
    scales = blocks.abs().amax(dim=1) / QMAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # zero blocks: 0 / 1 = 0
    values = torch.round(blocks / safe.unsqueeze(1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return values.view(-1), scales


def dequantize(values: Tensor, scales: Tensor, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The first ``numel`` elements of what :func:`quantize` encoded, flat, in ``dtype``."""
    block_size = values.numel() // max(scales.numel(), 1)
    if scales.numel() * block_size != values.numel() or numel > values.numel():
        raise ValueError(
            f"{values.numel()} int8 values and {scales.numel()} scales do not encode {numel} elements in whole blocks"
        )
    full = values.view(-1, block_size).float() * scales.float().unsqueeze(1)
    return full.view(-1)[:numel].to(dtype)


def max_error(x: Tensor, block_size: int) -> Tensor:
    """The bound of :func:`quantize` then :func:`dequantize` per element of ``x`` (flat): half its block's step."""
    blocks = _blocks(x, block_size)
    half_step = blocks.abs().amax(dim=1, keepdim=True) / (2 * QMAX)
    return half_step.expand_as(blocks).reshape(-1)[: x.numel()]
