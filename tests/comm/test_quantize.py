"""Blockwise int8 quantization (``lightning_zero/comm/quantize.py``): pure, no processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zero.comm import collectives as comm
from lightning_zero.comm.quantize import QMAX, dequantize, max_error, num_blocks, quantize, quantized_nbytes
from tests.helpers.workers import run_workers


@pytest.mark.parametrize("numel", [1, 7, 512, 513, 5000])
@pytest.mark.parametrize("block_size", [1, 64, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_within_half_a_step_of_its_block(numel, block_size, dtype):
    g = torch.Generator().manual_seed(numel * 31 + block_size)
    x = (torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)).to(dtype)  # magnitudes vary along x
    values, scales = quantize(x, block_size)
    assert values.dtype == torch.int8 and scales.dtype == torch.float32
    assert values.numel() == num_blocks(numel, block_size) * block_size and scales.numel() == num_blocks(
        numel, block_size
    )
    back = dequantize(values, scales, numel, torch.float32)
    error = (back - x.float()).abs()
    assert (error <= max_error(x, block_size) + 1e-6 * x.float().abs()).all()  # + fp32 rounding of q * scale
    assert values.abs().max().item() == QMAX  # every block's largest value uses the full range
    assert dequantize(values, scales, numel, dtype).dtype == dtype


def test_block_scales_follow_local_magnitude():
    """An outlier spoils only its own block: the other blocks keep their own, finer step."""
    x = torch.full((1024,), 0.01)
    x[0] = 1000.0
    values, scales = quantize(x, 512)
    back = dequantize(values, scales, x.numel())
    assert torch.equal(back[512:], x[512:])  # a constant block is exact: 127 * (0.01 / 127)
    assert (back[1:512] == 0).all()  # 0.01 is below half a step of 1000 / 127
    per_tensor = dequantize(*quantize(x, 1024), x.numel())
    assert (per_tensor[512:] == 0).all()  # one scale for all: the small values vanish everywhere


def test_exact_values_zero_blocks_and_symmetry():
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, -127.0, 1.0, 64.0, -3.0, 5.0])  # block 0 zeros; block 1 on the grid
    values, scales = quantize(x, 4)
    assert scales[0].item() == 0.0
    back = dequantize(values, scales, x.numel())
    assert torch.equal(back[:8], x[:8])
    assert torch.equal(dequantize(*quantize(-x, 4), x.numel()), -back)


def test_sizes_and_bad_input():
    assert quantized_nbytes(5000, 512) == 5000 + 4 * 10
    assert quantized_nbytes(1024, 2048) == 1024 + 4
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"block_size={bad!r} is invalid: expected an integer >= 1"):
            quantize(torch.ones(4), bad)
    with pytest.raises(ValueError, match="non-finite value"):
        quantize(torch.tensor([1.0, float("inf")]), 2)
    with pytest.raises(ValueError, match="do not encode 9 elements"):
        dequantize(torch.zeros(8, dtype=torch.int8), torch.ones(2), 9)


def _quantized_gather(block_size: int) -> dict:
    dist.init_process_group("gloo")
    rank, world = comm.rank(), comm.world_size()
    g = torch.Generator().manual_seed(rank)
    piece = torch.randn(1000, generator=g) * (10.0**rank)  # the ranks' magnitudes differ by 10x
    exact = torch.empty(world * piece.numel())
    comm.all_gather(exact, piece)
    comm.LEDGER.reset()
    out = torch.empty(world * piece.numel(), dtype=torch.bfloat16)
    comm.all_gather_quantized(out, piece, block_size, tag="params")
    bound = torch.cat([max_error(p, block_size) for p in exact.view(world, -1)])
    out = {"error": (out.float() - exact).abs() - bound, "exact": exact, "bytes": comm.LEDGER.bytes(tag="params")}
    dist.destroy_process_group()
    return {**out, "world": world}


@pytest.mark.timeout(120)
def test_quantized_all_gather_is_within_the_bound_and_moves_a_quarter_of_the_bytes():
    block_size = 128
    for run in run_workers(_quantized_gather, 2, block_size, timeout=100):
        assert run["world"] == 2
        assert (run["error"] <= 1e-2 * run["exact"].abs() + 1e-6).all()  # the bound, plus bf16 rounding of the output
        padded = num_blocks(1000, block_size) * block_size
        assert run["bytes"] == 2 * (padded + 4 * num_blocks(1000, block_size))  # int8 values + fp32 scales
        assert run["bytes"] < 0.27 * 2 * 1000 * 4
