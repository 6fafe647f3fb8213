"""The pure pre-aggregators (nnm, bucketing, clip) and check_pre_aggregator."""

from __future__ import annotations

import math
import re

import pytest
import torch

from lightning_zero.robust.preaggregators import PRE_AGGREGATORS, bucketing, check_pre_aggregator, clip, nnm


def _rand(n: int, d: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- nnm ------------------------------------------------------------------------------------------------------------


def test_nnm_mixes_each_row_with_its_nearest_rows_itself_included():
    x = torch.tensor([[0.0], [1.0], [10.0]], dtype=torch.float64)
    # f=1: each row becomes the mean of its 2 nearest rows: {0, 1}, {1, 0}, {10, 1}
    assert torch.equal(nnm(x, 1), torch.tensor([[0.5], [0.5], [5.5]], dtype=torch.float64))


def test_nnm_keeps_the_shape_and_with_f_zero_every_row_is_the_mean():
    x = _rand(7, 5)
    assert nnm(x, 2).shape == (7, 5)
    mixed = nnm(x, 0)
    assert torch.allclose(mixed, x.mean(dim=0).expand(7, -1), atol=1e-12, rtol=0)


def test_nnm_equals_the_mean_of_the_n_minus_f_nearest_rows():
    x = _rand(9, 4, seed=1)
    f = 3
    for i, row in enumerate(nnm(x, f)):
        nearest = torch.linalg.vector_norm(x - x[i], dim=1).argsort()[: 9 - f]
        assert torch.allclose(row, x[nearest].mean(dim=0), atol=1e-12, rtol=0)


def test_nnm_does_not_modify_its_input_and_keeps_its_dtype():
    x = _rand(5, 3).float()
    before = x.clone()
    out = nnm(x, 1)
    assert torch.equal(x, before)
    assert out.dtype == torch.float32


# --- bucketing ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "s"), [(8, 2), (9, 2), (7, 3), (5, 1), (3, 5), (6, 6)])
def test_bucketing_returns_ceil_n_over_s_rows(n, s):
    assert bucketing(_rand(n, 3), s, generator=_gen()).shape == (math.ceil(n / s), 3)


def test_bucketing_with_s_one_is_a_permutation_of_the_rows():
    x = _rand(6, 3)
    out = bucketing(x, 1, generator=_gen(4))
    assert not torch.equal(out, x)  # shuffled (for this seed)
    assert torch.equal(out.sort(dim=0).values, x.sort(dim=0).values)
    assert sorted(map(tuple, out.tolist())) == sorted(map(tuple, x.tolist()))


@pytest.mark.parametrize(("n", "s"), [(8, 2), (9, 3), (9, 2), (5, 2), (7, 3)])
def test_the_buckets_weighted_by_their_sizes_sum_to_the_rows(n, s):
    x = _rand(n, 4)
    out = bucketing(x, s, generator=_gen(1))
    sizes = torch.tensor([s] * (n // s) + ([n % s] if n % s else []), dtype=x.dtype)
    assert torch.allclose((sizes[:, None] * out).sum(dim=0), x.sum(dim=0), atol=1e-12, rtol=0)
    if n % s == 0:  # equal buckets: the mean of the buckets is the mean of the rows
        assert torch.allclose(out.mean(dim=0), x.mean(dim=0), atol=1e-12, rtol=0)


def test_bucketing_draws_only_from_its_generator():
    x = _rand(8, 3)
    torch.manual_seed(0)
    first = bucketing(x, 2, generator=_gen(5))
    torch.manual_seed(1)  # the global RNG plays no part
    assert torch.equal(bucketing(x, 2, generator=_gen(5)), first)
    gen = _gen(5)
    bucketing(x, 2, generator=gen)
    assert not torch.equal(gen.get_state(), _gen(5).get_state())  # the generator advanced


# --- clip -----------------------------------------------------------------------------------------------------------


def test_clip_bounds_every_norm_and_leaves_short_rows_untouched():
    x = _rand(8, 5) * torch.tensor([0.1, 0.2, 1.0, 3.0, 10.0, 0.05, 4.0, 0.3], dtype=torch.float64)[:, None]
    c = 1.0
    out = clip(x, c)
    norms = torch.linalg.vector_norm(x, dim=1)
    out_norms = torch.linalg.vector_norm(out, dim=1)
    assert (out_norms <= c + 1e-12).all()
    short = norms <= c
    assert short.any() and (~short).any()
    assert torch.equal(out[short], x[short])
    # long rows keep their direction and land on the sphere
    assert torch.allclose(out_norms[~short], torch.full_like(out_norms[~short], c), atol=1e-12, rtol=0)
    assert torch.allclose(out[~short], x[~short] * (c / norms[~short])[:, None], atol=1e-12, rtol=0)


def test_clip_keeps_a_zero_row_and_the_input():
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    before = x.clone()
    assert torch.equal(clip(x, 2.5), torch.tensor([[0.0, 0.0], [1.5, 2.0]]))
    assert torch.equal(x, before)


# --- check_pre_aggregator and the registry --------------------------------------------------------------------------


def test_check_nnm_accepts_the_bound_and_rejects_one_less_with_the_numbers():
    assert check_pre_aggregator("nnm", 5, 2) == (5, 2)
    with pytest.raises(
        ValueError, match=re.escape("pre_aggregator='nnm' with n=4, f=2 is invalid: NNM needs n >= 2f+1 = 5")
    ):
        check_pre_aggregator("nnm", 4, 2)


@pytest.mark.parametrize(("n", "s", "expected"), [(8, 2, 4), (9, 2, 5), (7, 7, 1), (7, 10, 1), (5, 1, 5)])
def test_check_bucketing_hands_on_ceil_n_over_s_and_the_same_f(n, s, expected):
    assert check_pre_aggregator("bucketing", n, 2, s=s) == (expected, 2)


@pytest.mark.parametrize("s", [0, -1, 2.5, True])
def test_check_bucketing_rejects_a_bad_s(s):
    with pytest.raises(ValueError, match=re.escape(f"s={s!r}: expected an integer bucket size >= 1")):
        check_pre_aggregator("bucketing", 8, 2, s=s)


def test_check_bucketing_and_clip_need_their_parameter():
    with pytest.raises(ValueError, match="pre_aggregator='bucketing' needs s"):
        check_pre_aggregator("bucketing", 8, 2)
    with pytest.raises(ValueError, match="pre_aggregator='clip' needs c"):
        check_pre_aggregator("clip", 8, 2)


@pytest.mark.parametrize("c", [0.0, -1.0, math.inf, math.nan])
def test_check_clip_rejects_a_bad_c(c):
    assert check_pre_aggregator("clip", 8, 2, c=1.5) == (8, 2)
    with pytest.raises(ValueError, match=re.escape(f"c={c!r}: expected a finite norm bound > 0")):
        check_pre_aggregator("clip", 8, 2, c=c)
    with pytest.raises(ValueError, match="expected a finite norm bound > 0"):  # the function refuses it too
        clip(_rand(3, 2), c)


def test_check_pre_aggregator_rejects_unknown_names_and_parameters():
    with pytest.raises(
        ValueError, match=re.escape("pre_aggregator='nmm' is invalid: expected one of ['nnm', 'bucketing', 'clip']")
    ):
        check_pre_aggregator("nmm", 8, 2)
    with pytest.raises(ValueError, match=re.escape("got unknown parameters ['size']: expected some of ['s']")):
        check_pre_aggregator("bucketing", 8, 2, size=2)
    with pytest.raises(ValueError, match=re.escape("got unknown parameters ['k']: it takes no parameters")):
        check_pre_aggregator("nnm", 8, 2, k=3)


@pytest.mark.parametrize(("n", "f", "message"), [(0, 0, "n=0 is invalid"), (5, -1, "f=-1 is invalid")])
def test_check_pre_aggregator_rejects_bad_n_and_f(n, f, message):
    with pytest.raises(ValueError, match=message):
        check_pre_aggregator("clip", n, f, c=1.0)


def test_the_registry_flags():
    assert {k: (v.preserves_rows, v.needs_generator) for k, v in PRE_AGGREGATORS.items()} == {
        "nnm": (True, False),
        "bucketing": (False, True),
        "clip": (True, False),
    }
    assert PRE_AGGREGATORS["bucketing"].params == ("s",)
    assert PRE_AGGREGATORS["clip"].params == ("c",)
