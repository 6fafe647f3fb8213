"""The pure ZeRO partition math, without processes."""

import warnings

import pytest
import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.optim import SAM
from lightning_zero.zero.partition import NOT_ELEMENTWISE, check_elementwise, flat_layout, shard_ranges


@pytest.mark.parametrize(("numel", "world_size"), [(10, 2), (10, 3), (7, 4), (1, 3), (0, 2), (12, 1)])
def test_shards_are_contiguous_equal_and_cover_the_padded_buffer(numel, world_size):
    ranges = shard_ranges(numel, world_size)
    sizes = {end - start for start, end in ranges.values()}
    assert len(sizes) == 1  # element-balanced: every shard has the same size
    assert ranges[0][0] == 0
    for r in range(1, world_size):
        assert ranges[r][0] == ranges[r - 1][1]
    padded = ranges[world_size - 1][1]
    assert padded >= numel and padded - numel < world_size and padded % world_size == 0


def test_uneven_parameters_are_split_across_shard_boundaries():
    layout = flat_layout([5, 1, 4], world_size=3)  # 10 elements -> padded 12, shards of 4
    assert layout.offsets == (0, 5, 6)
    assert (layout.numel, layout.padded_numel, layout.shard_numel) == (10, 12, 4)
    assert layout.param_pieces(0) == [(0, 0, 0, 4)]
    assert layout.param_pieces(1) == [(0, 4, 0, 1), (1, 0, 1, 1), (2, 0, 2, 2)]
    assert layout.param_pieces(2) == [(2, 2, 0, 2)]  # the last 2 elements of rank 2's shard are padding


def test_pieces_cover_every_element_exactly_once():
    numels = [3, 17, 1, 8, 30]
    for world_size in (1, 2, 3, 4, 7):
        layout = flat_layout(numels, world_size)
        covered = [0] * len(numels)
        for rank in range(world_size):
            for index, in_param, in_shard, length in layout.param_pieces(rank):
                assert in_shard >= 0 and in_shard + length <= layout.shard_numel
                assert in_param + length <= numels[index]
                covered[index] += length
        assert covered == numels


def test_a_rank_can_own_only_padding_or_nothing():
    layout = flat_layout([2], world_size=4)  # shards of 1 element: ranks 2 and 3 hold padding only
    assert [layout.param_pieces(r) for r in range(4)] == [[(0, 0, 0, 1)], [(0, 1, 0, 1)], [], []]
    empty = flat_layout([], world_size=3)
    assert empty.padded_numel == 0 and empty.param_pieces(1) == []


def test_owned_part_of_a_flat_range():
    layout = flat_layout([10], world_size=2)  # shards [0, 5) and [5, 10)
    assert layout.owned(0, 3, 8) == (3, 5)
    assert layout.owned(1, 3, 8) == (5, 8)
    lo, hi = layout.owned(1, 0, 4)
    assert lo == hi  # nothing owned


@pytest.mark.parametrize(("numel", "world_size", "message"), [(5, 0, "world_size=0 is invalid"), (-1, 2, "numel=-1")])
def test_bad_arguments_name_the_number(numel, world_size, message):
    with pytest.raises(ValueError, match=message):
        shard_ranges(numel, world_size)


def _torch_optimizers() -> list[type]:
    return sorted(
        (
            c
            for c in vars(torch.optim).values()
            if isinstance(c, type) and issubclass(c, Optimizer) and c is not Optimizer
        ),
        key=lambda c: c.__name__,
    )


def _steps_like_the_whole(kind: type) -> bool:
    """Whether three closure steps of ``kind`` over two shards of a flattened matrix (cut inside a row, as ZeRO cuts)
    give what three steps over the whole matrix give."""
    g = torch.Generator().manual_seed(0)
    start, target, scale = (torch.randn(4, 6, generator=g) for _ in range(3))

    def run(params: list[torch.Tensor], pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        optimizer = kind(params)
        for _ in range(3):

            def closure() -> torch.Tensor:
                optimizer.zero_grad()
                loss = sum((s.abs() * (p - t) ** 2).sum() for p, (t, s) in zip(params, pieces))
                loss.backward()
                return loss

            optimizer.step(closure)

    whole = start.clone().requires_grad_()
    shards = [piece.clone().requires_grad_() for piece in start.reshape(-1).split([10, 14])]
    cut = list(zip(target.reshape(-1).split([10, 14]), scale.reshape(-1).split([10, 14])))
    try:
        run([whole], [(target, scale)])
        for shard, piece in zip(shards, cut):
            run([shard], [piece])  # each rank steps its own shard
    except (RuntimeError, ValueError):  # Muon takes matrices only, SparseAdam sparse gradients only
        return False
    return torch.allclose(torch.cat(shards).reshape(4, 6), whole.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", _torch_optimizers(), ids=lambda c: c.__name__)
def test_every_torch_optimizer_zero_accepts_steps_shards_like_the_whole(kind):
    assert _steps_like_the_whole(kind) == (kind not in NOT_ELEMENTWISE)
    weight = nn.Parameter(torch.zeros(2, 2))
    if kind in NOT_ELEMENTWISE:
        with pytest.raises(ValueError, match=f"^{kind.__name__} cannot be sharded by ZeRO: "):
            check_elementwise(kind([weight]))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_elementwise(kind([weight]))


def test_an_optimizer_zero_does_not_know_is_refused_by_name_unless_declared_elementwise():
    """Outside ``torch.optim``, or a ``torch.optim`` subclass with a step of its own: refused, naming the class and
    the declaration; declared (or a subclass of a declared class), accepted. A subclass that keeps torch's step, and
    a shard-aware optimizer over an elementwise base, need no declaration; over a refused base they are refused."""

    class Custom(Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

    class CustomAdam(torch.optim.Adam):
        pass

    class SteppingSGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    weight = nn.Parameter(torch.zeros(2))
    for kind in (Custom, SteppingSGD):
        with pytest.raises(ValueError, match=f"{kind.__qualname__} is not an optimizer ZeRO knows") as refusal:
            check_elementwise(kind([weight]))
        assert f"elementwise_optimizers={{{kind.__name__}}}" in str(refusal.value)
        assert "lightning_zero.optim.SAM" in str(refusal.value)
        check_elementwise(kind([weight]), declared={kind})
    check_elementwise(SteppingSGD([weight]), declared={torch.optim.SGD})  # a subclass of a declared class
    check_elementwise(CustomAdam([weight]))
    check_elementwise(SAM([weight], torch.optim.AdamW, lr=0.1))
    with pytest.raises(ValueError, match=r"^LBFGS cannot be sharded by ZeRO"):
        check_elementwise(SAM([weight], torch.optim.LBFGS))
