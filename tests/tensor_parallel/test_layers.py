"""The tensor-parallel layers on 2 gloo ranks against the full layer they were sliced from, in the same process.

Each case builds the full layer from a seed (the same weights on every rank), slices it, and runs both forward and
backward on the same input and upstream gradient: the output, the input gradient and the weight gradients gathered
back with ``unshard`` must equal the full layer's within 1e-6. Sizes that do not split are refused with the numbers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, unshard
from tests.helpers.workers import run_workers

WORLD, IN, OUT, VOCAB = 2, 6, 12, 8
SHAPE = (2, 3)  # (batch, seq) of every input


def _seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _pairs(ref: dict[str, torch.Tensor], ours: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: (ours[name].detach(), ref[name].detach()) for name in ref}


def _column_case(rank: int, chunks: int, gather_output: bool) -> dict:
    torch.manual_seed(0)
    full = nn.Linear(IN, OUT)
    layer = ColumnParallelLinear.from_module(full, gather_output=gather_output, chunks=chunks)
    x, upstream = _seeded(1, *SHAPE, IN), _seeded(2, *SHAPE, OUT)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = full(x_ref)
    (y_ref * upstream).sum().backward()
    y = layer(x_tp)
    # Rank r's slice of every chunk, taken by hand (not with shard()): its heads' q, k and v.
    mine = [c.tensor_split(WORLD, dim=-1)[rank] for c in y_ref.detach().chunk(chunks, -1)]
    local_upstream = torch.cat([c.tensor_split(WORLD, dim=-1)[rank] for c in upstream.chunk(chunks, -1)], -1)
    (y * (upstream if gather_output else local_upstream)).sum().backward()
    full_y = y if gather_output else unshard(y.detach(), -1, chunks=chunks)
    ref = {"y": y_ref, "x.grad": x_ref.grad, "weight.grad": full.weight.grad, "bias.grad": full.bias.grad}
    ours = {
        "y": full_y,
        "x.grad": x_tp.grad,
        "weight.grad": unshard(layer.weight.grad, 0, chunks=chunks),
        "bias.grad": unshard(layer.bias.grad, 0, chunks=chunks),
    }
    pairs = _pairs(ref, ours)
    if not gather_output:
        pairs["local y"] = (y.detach(), torch.cat(mine, -1))
    return pairs


def _row_case(rank: int, input_is_parallel: bool) -> dict:
    torch.manual_seed(0)
    full = nn.Linear(OUT, IN)
    layer = RowParallelLinear.from_module(full, input_is_parallel=input_is_parallel)
    x, upstream = _seeded(3, *SHAPE, OUT), _seeded(4, *SHAPE, IN)
    x_ref = x.clone().requires_grad_()
    x_tp = (x.tensor_split(WORLD, -1)[rank] if input_is_parallel else x).clone().requires_grad_()
    y_ref = full(x_ref)
    (y_ref * upstream).sum().backward()
    y = layer(x_tp)
    (y * upstream).sum().backward()
    x_grad = unshard(x_tp.grad, -1) if input_is_parallel else x_tp.grad
    ref = {"y": y_ref, "x.grad": x_ref.grad, "weight.grad": full.weight.grad, "bias.grad": full.bias.grad}
    ours = {"y": y, "x.grad": x_grad, "weight.grad": unshard(layer.weight.grad, 1), "bias.grad": layer.bias.grad}
    return _pairs(ref, ours)


def _embedding_case() -> dict:
    torch.manual_seed(0)
    full = nn.Embedding(VOCAB, IN)
    layer = VocabParallelEmbedding.from_module(full)
    ids = torch.randint(0, VOCAB, SHAPE, generator=torch.Generator().manual_seed(5))
    ids[0, :2] = torch.tensor([0, VOCAB - 1])  # both ends of the vocabulary, so both ranks' rows are used
    upstream = _seeded(6, *SHAPE, IN)
    y_ref, y = full(ids), layer(ids)
    (y_ref * upstream).sum().backward()
    (y * upstream).sum().backward()
    return _pairs({"y": y_ref, "weight.grad": full.weight.grad}, {"y": y, "weight.grad": unshard(layer.weight.grad, 0)})


def _refusal(build) -> str:
    try:
        build()
    except ValueError as err:
        return str(err)
    return "accepted"


def _layers_worker() -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cases = {
        f"column chunks={chunks} gather_output={gather}": _column_case(rank, chunks, gather)
        for chunks in (1, 3)
        for gather in (False, True)
    }
    cases |= {f"row input_is_parallel={parallel}": _row_case(rank, parallel) for parallel in (True, False)}
    cases["embedding"] = _embedding_case()
    refusals = {
        "column": _refusal(lambda: ColumnParallelLinear.from_module(nn.Linear(4, 5))),
        "fused": _refusal(lambda: ColumnParallelLinear.from_module(nn.Linear(4, 9), chunks=3)),
        "row": _refusal(lambda: RowParallelLinear.from_module(nn.Linear(7, 4))),
        "vocab": _refusal(lambda: VocabParallelEmbedding.from_module(nn.Embedding(15, 4))),
        "padding": _refusal(lambda: VocabParallelEmbedding.from_module(nn.Embedding(16, 4, padding_idx=0))),
    }
    return {"cases": cases, "refusals": refusals}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_layers_worker, WORLD, timeout=120)


CASES = [
    "column chunks=1 gather_output=False",
    "column chunks=1 gather_output=True",
    "column chunks=3 gather_output=False",
    "column chunks=3 gather_output=True",
    "row input_is_parallel=True",
    "row input_is_parallel=False",
    "embedding",
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES)
def test_layer_matches_the_full_layer_forward_and_backward(results, case):
    for rank, result in enumerate(results):
        for name, (ours, ref) in result["cases"][case].items():
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6, msg=f"rank {rank}, {case}: {name}")


@pytest.mark.timeout(120)
def test_sizes_that_do_not_split_are_refused_with_the_numbers(results):
    for result in results:
        refusals = result["refusals"]
        assert refusals["column"] == "out_features=5 is not divisible by the tensor-parallel size 2"
        assert refusals["fused"] == "out_features=9 is not divisible by chunks=3 x the tensor-parallel size 2 = 6"
        assert refusals["row"] == "in_features=7 is not divisible by the tensor-parallel size 2"
        assert refusals["vocab"] == "num_embeddings=15 is not divisible by the tensor-parallel size 2"
        assert "plain nn.Embedding: got padding_idx=0" in refusals["padding"]
