"""ZeRO-3 bytes per step in theory (``lightning_zero/zero/stage3/traffic.py``): pure, no processes. The ledger is
compared with it in ``tests/strategies/test_zero3_quantized.py`` and ``benchmarks/comm_options.py``."""

from __future__ import annotations

from lightning_zero.zero.stage3.traffic import SegmentTraffic, collective_nbytes, gathers_per_step, step_nbytes


def test_one_collective_counts_every_rank_s_piece_exact_or_as_int8_blocks():
    assert collective_nbytes(1000, 2, 4) == 8000  # fp32
    assert collective_nbytes(1000, 2, 2) == 4000  # bf16
    assert collective_nbytes(1000, 2, 4, block_size=512) == 2 * (1000 + 4 * 2)  # int8 + a scale per (short) block
    assert collective_nbytes(1000, 3, 4, block_size=1) == 3 * 5 * 1000  # a scale per element: worse than fp32


def test_units_are_gathered_twice_per_step_unless_kept():
    assert gathers_per_step(root=False, reshard_after_forward=True) == 2  # before forward and before backward
    assert gathers_per_step(root=False, reshard_after_forward=False) == 1
    assert gathers_per_step(root=True, reshard_after_forward=True) == 1  # kept from first use to its reduction


def test_step_bytes_of_a_model():
    """Two blocks of 4096 elements per shard and a root unit of 1000 (N=2), one frozen segment of 100 (gathered, never
    reduced): about 8Ψ + 4Ψ exact, 2Ψ + Ψ quantized."""
    segments = [
        SegmentTraffic(4096, 2, True),
        SegmentTraffic(4096, 2, True),
        SegmentTraffic(100, 2, False),
        SegmentTraffic(1000, 1, True),
    ]
    exact = step_nbytes(segments, 2)
    assert exact == {"params": 2 * 4 * (2 * 4096 * 2 + 2 * 100 + 1000), "grads": 2 * 4 * (2 * 4096 + 1000)}
    quantized = step_nbytes(segments, 2, weight_block_size=512, grad_block_size=512)
    int8 = {4096: 4096 + 4 * 8, 100: 100 + 4, 1000: 1000 + 4 * 2}
    assert quantized == {
        "params": 2 * (2 * int8[4096] * 2 + 2 * int8[100] + int8[1000]),
        "grads": 2 * (2 * int8[4096] + int8[1000]),
    }
    assert 0.25 < quantized["params"] / exact["params"] < 0.26
    only_weights = step_nbytes(segments, 2, weight_block_size=512)
    assert (only_weights["params"], only_weights["grads"]) == (quantized["params"], exact["grads"])
    bf16 = step_nbytes([SegmentTraffic(4096, 2, True, gather_itemsize=2, reduce_itemsize=4)], 2)
    assert bf16 == {"params": 2 * 2 * 4096 * 2, "grads": 2 * 4 * 4096}
