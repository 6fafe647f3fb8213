"""Blockwise int8 quantization (``lightning_zero/comm/quantize.py``): pure, no processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zero.comm import collectives as comm
from lightning_zero.comm import quantized
from lightning_zero.comm.quantize import (
    QMAX,
    dequantize,
    max_error,
    num_blocks,
    pack,
    quantize,
    quantized_nbytes,
    unpack,
)
from tests.helpers.workers import run_workers


@pytest.mark.parametrize("numel", [1, 7, 512, 513, 5000])
@pytest.mark.parametrize("block_size", [1, 64, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_within_half_a_step_of_its_block(numel, block_size, dtype):
    g = torch.Generator().manual_seed(numel * 31 + block_size)
    x = (torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)).to(dtype)  # magnitudes vary along x
    values, scales = quantize(x, block_size)
    assert values.dtype == torch.int8 and scales.dtype == torch.float32
    assert values.shape == x.shape and scales.shape == (num_blocks(numel, block_size),)  # no padding kept
    back = dequantize(values, scales, block_size, torch.float32)
    error = (back - x.float()).abs()
    assert (error <= max_error(x, block_size) + 1e-6 * x.float().abs()).all()  # + fp32 rounding of q * scale
    assert values.abs().max().item() == QMAX  # every block's largest value uses the full range
    assert dequantize(values, scales, block_size, dtype).dtype == dtype


def test_rows_are_quantized_in_blocks_of_their_own():
    """A (rows, numel) tensor is rows quantized separately: blocks never straddle two rows (two ranks' chunks)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 100, generator=g) * torch.tensor([[1.0], [1e3], [1e-3]])
    values, scales = quantize(x, 64)
    assert values.shape == (3, 100) and scales.shape == (3, 2)
    for row in range(3):
        row_values, row_scales = quantize(x[row], 64)
        assert torch.equal(values[row], row_values) and torch.equal(scales[row], row_scales)
        assert torch.equal(max_error(x, 64)[row], max_error(x[row], 64))
    assert torch.equal(dequantize(values, scales, 64)[2], dequantize(values[2], scales[2], 64))


def test_block_scales_follow_local_magnitude():
    """An outlier spoils only its own block: the other blocks keep their own, finer step."""
    x = torch.full((1024,), 0.01)
    x[0] = 1000.0
    back = dequantize(*quantize(x, 512), 512)
    assert torch.equal(back[512:], x[512:])  # a constant block is exact: 127 * (0.01 / 127)
    assert (back[1:512] == 0).all()  # 0.01 is below half a step of 1000 / 127
    per_tensor = dequantize(*quantize(x, 1024), 1024)
    assert (per_tensor[512:] == 0).all()  # one scale for all: the small values vanish everywhere


def test_scales_are_each_blocks_largest_magnitude_over_qmax_exactly():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 1000, generator=g)
    x[1, 512:] = -x[1, 512:].abs() - 5.0  # a block whose largest magnitude is its most negative value
    _, scales = quantize(x, 512)
    for row in range(3):
        for b, block in enumerate(x[row].split(512)):
            assert scales[row, b].item() == (max(abs(v) for v in block.tolist()) / torch.tensor(float(QMAX))).item()


@pytest.mark.parametrize("shape", [(3, 1000), (2, 1024), (1, 7), (5,)])
def test_values_are_each_element_over_its_blocks_scale_rounded(shape):
    """Element by element against a per-block loop, the short last block included (quantized from a view of its
    own, not from a padded copy); dequantizing into ``out`` gives what the returned tensor holds, in fp32 and
    rounded to bf16 on the way."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 7
    values, scales = quantize(x, 512)
    rows, row_values, row_scales = (
        x.reshape(-1, shape[-1]),
        values.reshape(-1, shape[-1]),
        scales.reshape(len(x.reshape(-1, shape[-1])), -1),
    )
    for row in range(rows.shape[0]):
        for b, block in enumerate(rows[row].split(512)):
            expected = torch.round(block / row_scales[row, b]).to(torch.int8)
            assert torch.equal(row_values[row, b * 512 : b * 512 + block.numel()], expected)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full(shape, float("nan"))
        assert dequantize(values, scales, 512, dtype, out=out) is out
        assert torch.equal(out, dequantize(values, scales, 512, dtype).float())


def test_a_scale_that_rounds_down_keeps_values_in_int8():
    """A subnormal block whose absmax / 127 rounds down to a smaller step: the quotient exceeds 127 and is clamped
    (an int8 cast would wrap it to a negative value)."""
    tiny = torch.tensor(2.0**-149)  # the smallest fp32 subnormal
    x = torch.tensor([190.0, -190.0, 95.0]) * tiny
    values, scales = quantize(x, 4)
    assert scales.item() == tiny.item()  # 190 / 127 = 1.496 steps of 2^-149, rounded to 1
    assert values.tolist() == [QMAX, -QMAX, 95]


def test_exact_values_zero_blocks_and_symmetry():
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, -127.0, 1.0, 64.0, -3.0, 5.0])  # block 0 zeros; block 1 on the grid
    values, scales = quantize(x, 4)
    assert scales[0].item() == 0.0
    back = dequantize(values, scales, 4)
    assert torch.equal(back[:8], x[:8])
    assert torch.equal(dequantize(*quantize(-x, 4), 4), -back)


def test_pack_and_unpack_lay_values_and_scales_in_one_row_of_bytes():
    x = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    values, scales = quantize(x, 4)
    packed = pack(values, scales)
    assert packed.dtype == torch.uint8 and packed.shape == (2, quantized_nbytes(10, 4))
    back_values, back_scales = unpack(packed, 10)
    assert torch.equal(back_values, values) and torch.equal(back_scales, scales)
    assert torch.equal(pack(values[1], scales[1]), packed[1])  # a flat tensor is one row
    for row in range(2):  # a row of a packed buffer: its scales start at any byte offset (here 10 and 32)
        row_values, row_scales = unpack(packed[row], 10)
        assert torch.equal(row_values, values[row]) and torch.equal(row_scales, scales[row])
    odd = pack(*quantize(x[:, :7], 4))  # rows of 7 + 8 bytes: the second row's scales start at byte 22
    assert torch.equal(unpack(odd[1], 7)[1], quantize(x[1, :7], 4)[1])
    with pytest.raises(ValueError, match="rows of 21 bytes do not hold 10 int8 values and whole fp32 scales"):
        unpack(packed[:, :21], 10)


def test_sizes_and_bad_input():
    assert quantized_nbytes(5000, 512) == 5000 + 4 * 10
    assert quantized_nbytes(1024, 2048) == 1024 + 4
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"block_size={bad!r} is invalid: expected an integer >= 1"):
            quantize(torch.ones(4), bad)
    with pytest.raises(ValueError, match="non-finite value"):
        quantize(torch.tensor([1.0, float("inf")]), 2)
    with pytest.raises(ValueError, match="non-finite value"):
        quantize(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match=r"2 scales do not fit int8 values of shape \(9,\) in blocks of 4: expected 3"):
        dequantize(torch.zeros(9, dtype=torch.int8), torch.ones(2), 4)


def test_single_process_collectives_quantize_too_and_reject_bad_input():
    """Without a process group (world size 1) nothing is sent, but the values are those N ranks would get."""
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    expected = dequantize(*quantize(x, 64), 64)
    gathered, reduced = torch.empty(300), torch.empty(300)
    quantized.all_gather_quantized(gathered, x, 64)
    quantized.reduce_scatter_quantized(reduced, x, 64, "sum")
    assert torch.equal(gathered, expected) and torch.equal(reduced, expected)
    assert comm.LEDGER.bytes() == 2 * quantized_nbytes(300, 64)
    with pytest.raises(ValueError, match=r"reduce_scatter_quantized op 'max' is invalid: expected one of \('sum',"):
        quantized.reduce_scatter_quantized(reduced, x, 64, "max")
    with pytest.raises(ValueError, match="input has 300 elements: expected world_size=1 x output 2"):
        quantized.reduce_scatter_quantized(torch.zeros(2), x, 64)
    with pytest.raises(ValueError, match="output has 2 elements: expected world_size=1 x input 300"):
        quantized.all_gather_quantized(torch.zeros(2), x, 64)


K = 1001  # elements per rank: every chunk ends in a short block, and packed rows are not multiples of 4 bytes


def _rank_data(rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s reduce-scatter input: magnitudes that differ by 10x between ranks and vary along the tensor,
    outliers, and a block of zeros in chunk 0."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(world * K, generator=g) * torch.logspace(-2, 1, world * K) * 10.0**rank
    x[torch.randint(0, world * K, (5,), generator=g)] = 1e3 * (rank + 1)
    x[:128] = 0.0
    return x


def _quantized_collectives(block_size: int) -> dict:
    dist.init_process_group("gloo")
    rank, world = comm.rank(), comm.world_size()
    out: dict = {"world": world}
    # all-gather: each rank's piece, 10x apart; sync, async, and through the gloo substitute (broadcasts)
    piece = torch.randn(K, generator=torch.Generator().manual_seed(rank)) * (10.0**rank)
    exact = torch.empty(world * K)
    comm.all_gather(exact, piece)
    comm.LEDGER.reset()
    gathered = {}
    for name, threshold in (("sync", 1 << 40), ("async", 1 << 40), ("substitute", 0)):
        comm.GLOO_SUBSTITUTE_MIN_BYTES = threshold
        result = torch.empty(world * K, dtype=torch.bfloat16)
        handle = quantized.all_gather_quantized(result, piece, block_size, async_op=name != "sync", tag="params")
        if handle is not None:
            handle.wait()
        gathered[name] = result
    bound = torch.cat([max_error(p, block_size) for p in exact.view(world, -1)])
    out["gather_error"] = (gathered["sync"].float() - exact).abs() - bound
    out["gathered"], out["exact"] = gathered, exact
    out["gather_ledger"] = comm.LEDGER.summary()
    # reduce-scatter: the exact average in float64 from every rank's input, and the bound of each contribution
    data = _rank_data(rank, world)
    everyone = torch.empty(world * data.numel())
    comm.all_gather(everyone, data)
    inputs = everyone.view(world, world, K)  # [rank r, chunk d]
    exact_avg = inputs[:, rank].double().mean(0)
    bound = sum(max_error(inputs[r, rank], block_size).double() for r in range(world)) / world
    comm.LEDGER.reset()
    reduced = {}
    for name in ("sync", "async", "sum"):
        result = torch.full((K,), float("nan"))
        source = data.clone()
        op = "sum" if name == "sum" else "avg"
        handle = quantized.reduce_scatter_quantized(
            result, source, block_size, op, async_op=name == "async", tag="grads"
        )
        source.fill_(float("nan"))  # quantized when the call returns: the input may change at once
        if handle is not None:
            handle.wait()
        reduced[name] = result
    out["reduce_error"] = (reduced["sync"].double() - exact_avg).abs() - bound
    out["reduced"], out["exact_avg"] = reduced, exact_avg
    out["reduce_ledger"] = comm.LEDGER.summary()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_quantized_collectives_are_within_the_bound_and_move_a_quarter_of_the_bytes(world_size):
    block_size = 128
    wire = world_size * quantized_nbytes(K, block_size)  # int8 values + fp32 scales of N pieces (chunks)
    for run in run_workers(_quantized_collectives, world_size, block_size, timeout=100):
        assert run["world"] == world_size
        # all-gather: every element within half a step of its block (plus bf16 rounding of the output); the same
        # values whether waited on at once, later, or sent through the substitute; N x (k + 4 ceil(k / B)) bytes
        assert (run["gather_error"] <= 1e-2 * run["exact"].abs() + 1e-6).all()
        assert torch.equal(run["gathered"]["async"], run["gathered"]["sync"])
        assert torch.equal(run["gathered"]["substitute"], run["gathered"]["sync"])
        assert run["gather_ledger"] == {("all_gather", "params"): (3, 3 * wire)}
        assert wire < 0.26 * world_size * K * 4
        # reduce-scatter: within sum_r max_error_r / N of the exact average (+ fp32 rounding), not exact (it is
        # quantized), async equal to sync, "sum" N times the average; N x (k + 4 ceil(k / B)) bytes per call
        error, exact = run["reduce_error"], run["exact_avg"]
        assert (error <= 1e-6 * exact.abs() + 1e-9).all(), error.max()
        assert (run["reduced"]["sync"].double() != exact).any()
        assert torch.equal(run["reduced"]["async"], run["reduced"]["sync"])
        torch.testing.assert_close(run["reduced"]["sum"], run["reduced"]["sync"] * world_size)
        assert run["reduce_ledger"] == {("reduce_scatter", "grads"): (3, 3 * wire)}
