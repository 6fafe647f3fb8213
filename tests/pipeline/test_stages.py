"""Pure pieces of the pipeline: layer partition, micro-batches, activation headers, the parameter checks, and the
activation meter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.pipeline.runtime import ActivationMeter
from lightning_zero.pipeline.stages import (
    check_parameters,
    decode_header,
    encode_header,
    partition,
    split_batch,
)


@pytest.mark.parametrize(
    ("layers", "stages", "balance", "expected"),
    [
        (6, 2, None, [range(0, 3), range(3, 6)]),
        (7, 3, None, [range(0, 3), range(3, 5), range(5, 7)]),
        (6, 4, [2, 2, 1, 1], [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]),
        (3, 3, None, [range(0, 1), range(1, 2), range(2, 3)]),
    ],
)
def test_partition_covers_every_layer_once_in_order(layers, stages, balance, expected):
    slices = partition(layers, stages, balance)
    assert slices == expected
    assert [i for s in slices for i in s] == list(range(layers))


@pytest.mark.parametrize(
    ("layers", "stages", "balance", "message"),
    [
        (2, 3, None, "3 stages but only 2 layers"),
        (6, 2, [3, 2], r"balance=\[3, 2\] sums to 5: expected the 6 layers"),
        (6, 2, [6], r"balance=\[6\] is invalid: expected 2 integers >= 1"),
        (6, 2, [6, 0], r"balance=\[6, 0\] is invalid"),
    ],
)
def test_partition_refuses_impossible_splits(layers, stages, balance, message):
    with pytest.raises(ValueError, match=message):
        partition(layers, stages, balance)


def test_split_batch_cuts_every_tensor_and_weighs_by_size():
    x, y = torch.arange(14).view(7, 2), torch.arange(7)
    pieces = split_batch({"x": x, "y": y, "name": "digits", "scale": torch.tensor(2.0)}, 3)
    assert [w for _, w in pieces] == [3 / 7, 2 / 7, 2 / 7]
    assert torch.equal(torch.cat([p["x"] for p, _ in pieces]), x)
    assert torch.equal(torch.cat([p["y"] for p, _ in pieces]), y)
    assert all(p["name"] == "digits" and p["scale"].item() == 2.0 for p, _ in pieces)
    assert [w for _, w in split_batch((x, y), 8)] == [1 / 7] * 7  # fewer samples: one micro-batch each


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_header_round_trip(dtype):
    tensor = torch.zeros(3, 4, 5, dtype=dtype).requires_grad_(dtype.is_floating_point)
    assert decode_header(encode_header(tensor)) == (dtype, dtype.is_floating_point, (3, 4, 5))
    with pytest.raises(ValueError, match="complex64 and 1 dimensions cannot cross a stage boundary"):
        encode_header(torch.zeros(2, dtype=torch.complex64))


def test_check_parameters_names_tied_and_outside_parameters():
    layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    layers[1].weight = layers[0].weight
    root = nn.Module()
    root.net = layers
    with pytest.raises(ValueError, match=r"parameter net.1.weight is shared by stages 0 and 1"):
        check_parameters(root, "net", layers, partition(2, 2))
    root.bias = nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=r"the trainable parameters \['bias'\] are outside 'net'"):
        check_parameters(root, "net", layers, partition(2, 2))
    root.net = nn.Sequential(nn.Linear(2, 2))
    root.bias.requires_grad_(False)
    check_parameters(root, "net", root.net, partition(1, 1))  # frozen ones may stay outside


def test_activation_meter_counts_saved_storage_once_and_frees_it_with_the_graph():
    layer = nn.Linear(64, 64)
    meter = ActivationMeter()
    meter.reset(list(layer.parameters()))
    x = torch.randn(32, 64, requires_grad=True)
    with meter.counting():
        hidden = torch.tanh(layer(x))  # saves x (the weight is excluded) and tanh's output
        loss = (hidden * hidden).sum()  # saves hidden (already counted: same storage)
    assert meter.live == meter.peak == 2 * 32 * 64 * 4
    loss.backward()
    del loss, hidden
    assert meter.live == 0 and meter.peak == 2 * 32 * 64 * 4
