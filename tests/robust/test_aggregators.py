"""The pure robust rules: closed forms, invariances, resistance to outliers and non-finite rows, and check_rule."""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch

from lightning_zero.robust.aggregators import RULES, check_rule, mean
from lightning_zero.robust.distance_rules import (
    bulyan,
    bulyan_select,
    centered_clipping,
    geometric_median,
    krum,
    krum_scores,
    krum_select,
    multi_krum,
    multi_krum_select,
)
from lightning_zero.robust.order_statistics import median, trimmed_mean
from lightning_zero.robust.stack import drop_nonfinite

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
# 1-D points on a line: three close ones, one a bit off, one far outlier
LINE = torch.tensor([[0.0], [1.0], [2.0], [3.5], [100.0]], dtype=torch.float64)

# every rule with an f it tolerates at n=9 (Bulyan needs n >= 4f+3)
RULE_F = {
    "mean": 0,
    "median": 2,
    "trimmed_mean": 2,
    "krum": 2,
    "multi_krum": 2,
    "geometric_median": 2,
    "centered_clipping": 2,
    "bulyan": 1,
}


def _rand(n: int, d: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# --- closed forms ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fn", "f"), [(median, 0), (median, 1), (trimmed_mean, 1), (mean, 0)])
def test_three_rows_on_a_line_give_the_middle_row(fn, f):
    assert torch.equal(fn(X, f), torch.tensor([4.0, 5.0, 6.0]))


def test_even_n_median_averages_the_two_middle_values_and_is_symmetric():
    x = torch.tensor([[1.0, -3.0], [2.0, 0.0], [3.0, 5.0], [10.0, 1.0]])
    assert torch.equal(median(x), torch.tensor([2.5, 0.5]))
    assert torch.equal(median(-x), -median(x))
    assert torch.equal(median(x), torch.from_numpy(np.median(x.numpy(), axis=0)))


def test_trimmed_mean_drops_f_per_side_per_coordinate():
    x = torch.tensor([[0.0, 50.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [100.0, -50.0]])
    assert torch.equal(trimmed_mean(x, 1), torch.tensor([2.0, 2.0]))
    assert torch.equal(trimmed_mean(x, 2), torch.tensor([2.0, 2.0]))


def test_trimmed_mean_with_f_zero_is_the_mean():
    x = _rand(7, 5)
    assert torch.equal(trimmed_mean(x, 0), mean(x))


def test_krum_scores_sum_the_squared_distances_to_the_nearest_others():
    # f=1, n=5: n-f-2 = 2 nearest other points
    expected = torch.tensor([1 + 4, 1 + 1, 1 + 1.5**2, 1.5**2 + 2.5**2, 96.5**2 + 98**2], dtype=torch.float64)
    assert torch.equal(krum_scores(LINE, 1), expected)
    assert int(krum_select(LINE, 1)[0]) == 1
    assert torch.equal(krum(LINE, 1), LINE[1])


def test_krum_scores_are_zero_without_neighbours_and_ties_go_to_the_lower_index():
    assert torch.equal(krum_scores(LINE, 3), torch.zeros(5, dtype=torch.float64))
    # f=0, n=3: one neighbour each, and every score is 1, so the order is the row order whatever the values
    x = torch.tensor([[2.0], [0.0], [1.0]])
    assert torch.equal(krum_scores(x, 0), torch.ones(3))
    assert torch.equal(krum_select(x, 0, m=3), torch.tensor([0, 1, 2]))


def test_multi_krum_is_the_mean_of_the_m_best():
    assert torch.equal(krum_select(LINE, 1, m=3), torch.tensor([1, 2, 0]))
    assert torch.equal(multi_krum(LINE, 1, m=3), torch.tensor([1.0], dtype=torch.float64))
    # default m = n - f = 4: everything but the outlier
    assert torch.equal(multi_krum_select(LINE, 1), torch.tensor([1, 2, 0, 3]))
    assert torch.equal(multi_krum(LINE, 1), LINE[:4].mean(dim=0))
    assert torch.equal(multi_krum(LINE, 1, m=1), krum(LINE, 1))
    x = _rand(9, 4)
    assert torch.allclose(multi_krum(x, 2, m=5), x[krum_select(x, 2, m=5)].mean(dim=0), atol=0, rtol=1e-12)


def test_bulyan_picks_by_iterated_krum_and_averages_the_beta_closest_to_the_median():
    # n=7=4f+3 with f=1: theta=5 picks, beta=3 values per coordinate. Iterated Krum (f=1) on the remaining points:
    # round 1 (4 neighbours) scores 30, 15, 10, 15, 30 (and ~1e4 for +-100) -> 2; round 2 (3): 26, 14, 14, 26 -> 1
    # (tie, and tied in round 1 too: lower index); round 3 (2): 25, 10, 17 -> 3; round 4 (1): 16, 16 -> 0 (tie twice:
    # lower index); round 5 (no neighbour: all 0) -> 4, the best of round 1 among 4, 100, -100.
    x = torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0], [100.0], [-100.0]], dtype=torch.float64)
    assert torch.equal(bulyan_select(x, 1), torch.tensor([2, 1, 3, 0, 4]))
    # median of 0..4 is 2; the 3 closest are 1, 2, 3
    assert torch.equal(bulyan(x, 1), torch.tensor([2.0], dtype=torch.float64))


def test_bulyan_is_the_coordinatewise_beta_closest_average_of_its_picks():
    n, f = 11, 2
    x = _rand(n, 6, seed=3)
    chosen = x[bulyan_select(x, f)].numpy()
    beta = n - 4 * f
    med = np.median(chosen, axis=0)
    expected = [chosen[np.argsort(np.abs(chosen[:, j] - med[j]), kind="stable")[:beta], j].mean() for j in range(6)]
    assert torch.allclose(bulyan(x, f), torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)


def test_geometric_median_first_step_from_zero_is_the_weighted_mean():
    x = _rand(6, 3)
    nu = 0.1
    weights = 1.0 / torch.linalg.vector_norm(x, dim=1).clamp_min(nu)
    expected = (weights[:, None] * x).sum(dim=0) / weights.sum()
    assert torch.allclose(geometric_median(x, nu=nu, iterations=1), expected, atol=1e-12, rtol=0)


def test_geometric_median_with_many_iterations_beats_the_mean_and_every_row():
    x = _rand(7, 3)
    x[6] = 50.0
    z = geometric_median(x, nu=1e-8, iterations=300)

    def objective(p):
        return float(torch.linalg.vector_norm(x - p, dim=1).sum())

    assert objective(z) < objective(x.mean(dim=0))
    assert all(objective(z) <= objective(row) + 1e-9 for row in x)


def test_centered_clipping_matches_its_formula_and_chains_as_a_stateful_rule():
    x = _rand(6, 4) * 3
    v = torch.full((4,), 0.5, dtype=torch.float64)
    tau = 1.0
    diff = x - v
    factor = torch.clamp(tau / torch.linalg.vector_norm(diff, dim=1), max=1.0)
    expected = v + (diff * factor[:, None]).mean(dim=0)
    assert torch.allclose(centered_clipping(x, center=v, tau=tau), expected, atol=1e-12, rtol=0)
    # the caller feeds the result back as the next centre: two chained steps are two iterations
    once = centered_clipping(x, tau=tau)
    assert torch.allclose(
        centered_clipping(x, center=once, tau=tau), centered_clipping(x, tau=tau, iterations=2), atol=1e-12, rtol=0
    )


def test_centered_clipping_with_a_large_tau_from_zero_is_the_mean_and_a_zero_difference_is_kept():
    x = _rand(5, 3)
    assert torch.allclose(centered_clipping(x, tau=1e9), x.mean(dim=0), atol=1e-12, rtol=0)
    # the centre sits on row 0: its zero difference has factor 1, no 0/0
    out = centered_clipping(x, center=x[0].clone(), tau=0.1)
    assert torch.isfinite(out).all()


def test_centered_clipping_rejects_a_centre_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"center has shape \(2,\): expected \(3,\)"):
        centered_clipping(X, center=torch.zeros(2))


# --- properties over every rule -------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", list(RULES))
def test_output_is_invariant_to_the_order_of_the_rows(rule):
    x = _rand(9, 5, seed=1)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(7))
    f = RULE_F[rule]
    spec = RULES[rule]
    assert torch.allclose(spec.fn(x[perm], f), spec.fn(x, f), atol=1e-6, rtol=0)
    if spec.select is not None:
        picked = set(perm[spec.select(x[perm], f)].tolist())
        assert picked == set(spec.select(x, f).tolist())


@pytest.mark.parametrize("rule", list(RULES))
def test_identical_rows_are_a_fixed_point(rule):
    row = torch.tensor([0.3, -1.2, 2.5, 0.0], dtype=torch.float64)  # norm < tau=10 of centered_clipping
    x = row.repeat(9, 1)
    assert torch.allclose(RULES[rule].fn(x, RULE_F[rule]), row, atol=1e-12, rtol=0)


def test_identical_rows_are_a_fixed_point_of_centered_clipping_from_that_centre():
    row = torch.tensor([30.0, -40.0])  # norm 50 > tau: from zero one step only moves tau towards it
    x = row.repeat(5, 1)
    assert torch.equal(centered_clipping(x, center=row, tau=1.0), row)


@pytest.mark.parametrize("rule", list(RULES))
def test_the_input_is_not_modified(rule):
    x = _rand(9, 5)
    x[2] = math.nan
    before = x.clone()
    RULES[rule].fn(x, RULE_F[rule])
    assert torch.equal(x.isnan(), before.isnan())
    assert torch.equal(x.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rule", list(RULES))
def test_the_result_has_the_input_dtype(rule, dtype):
    x = _rand(9, 5).to(dtype)
    out = RULES[rule].fn(x, RULE_F[rule])
    assert out.dtype == dtype
    assert out.shape == (5,)


BAD_ROWS = {
    "+1e6": (1e6, 1e6),
    "-1e6": (-1e6, -1e6),
    "+-1e6": (1e6, -1e6),
    "nan": (math.nan, math.nan),
    "+inf": (math.inf, math.inf),
    "nan_and_inf": (math.nan, -math.inf),
}
# rules whose output must stay in the honest per-coordinate range; the others must at least stay finite
BOUNDED = ["median", "trimmed_mean", "krum", "multi_krum", "bulyan"]


@pytest.mark.parametrize("bad", list(BAD_ROWS))
@pytest.mark.parametrize("rule", [r for r in RULES if r != "mean"])
def test_f_bad_rows_cannot_push_a_robust_rule_out_of_the_honest_range(rule, bad):
    f = 2
    n = 11 if rule == "bulyan" else 9  # Bulyan needs n >= 4f+3
    x = _rand(n, 6, seed=5)
    honest = x[: n - f].clone()
    for row, value in zip(range(n - f, n), BAD_ROWS[bad]):
        x[row] = value
    x = x[torch.randperm(n, generator=torch.Generator().manual_seed(2))]  # bad rows anywhere
    out = RULES[rule].fn(x, f)
    assert torch.isfinite(out).all()
    if rule in BOUNDED:
        assert (out >= honest.min(dim=0).values - 1e-12).all()
        assert (out <= honest.max(dim=0).values + 1e-12).all()


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_mean_is_not_protected_from_a_non_finite_row(value):
    x = _rand(5, 3)
    x[1, 0] = value
    out = mean(x)
    assert (out[0].isnan() if math.isnan(value) else out[0].isinf()).item()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("rule", ["krum", "multi_krum", "bulyan"])
def test_selections_never_contain_a_non_finite_row_and_use_the_original_numbering(rule, value):
    f = 2
    n = 11 if rule == "bulyan" else 9
    x = _rand(n, 4, seed=9)
    bad = [1, 5]
    x[bad, 2] = value
    picks = RULES[rule].select(x, f)
    assert not set(picks.tolist()) & set(bad)
    assert torch.isfinite(x[picks]).all()
    # the rule's output is built from exactly those rows
    if rule == "krum":
        assert torch.equal(RULES[rule].fn(x, f), x[picks[0]])
    if rule == "multi_krum":
        assert torch.allclose(RULES[rule].fn(x, f), x[picks].mean(dim=0), atol=1e-12, rtol=0)


def test_multi_krum_lowers_m_only_when_more_than_f_rows_were_dropped():
    x = _rand(9, 3)
    x[[0, 1, 2]] = math.nan  # 3 > f=2 bad rows: 6 finite rows are left for m=7
    assert torch.equal(multi_krum_select(x, 2, m=7).sort().values, torch.arange(3, 9))


def test_drop_nonfinite_lowers_f_and_keeps_the_original_indices():
    x = _rand(6, 3)
    x[1, 0], x[4, 2] = math.nan, -math.inf
    finite, f_eff, kept = drop_nonfinite(x, 3)
    assert torch.equal(kept, torch.tensor([0, 2, 3, 5]))
    assert torch.equal(finite, x[kept])
    assert f_eff == 1
    assert drop_nonfinite(x, 1)[1] == 0  # never below zero
    same, f_same, all_kept = drop_nonfinite(X, 1)
    assert same is X and f_same == 1 and torch.equal(all_kept, torch.arange(3))


def test_no_finite_row_is_an_error_naming_n():
    x = torch.full((4, 2), math.nan)
    with pytest.raises(ValueError, match="all n=4 worker vectors hold NaN or Inf"):
        median(x)


def test_a_stack_must_be_two_dimensional():
    with pytest.raises(ValueError, match=r"expected a \(n, d\) tensor .* got \(3,\)"):
        median(torch.zeros(3))


def test_the_registry_flags():
    assert [r for r, s in RULES.items() if not s.robust] == ["mean"]
    assert [r for r, s in RULES.items() if s.stateful] == ["centered_clipping"]
    assert sorted(r for r, s in RULES.items() if s.select is not None) == ["bulyan", "krum", "multi_krum"]
    assert RULES["multi_krum"].params == ("m",)
    assert set(RULES["geometric_median"].params) == {"nu", "iterations"}
    assert set(RULES["centered_clipping"].params) == {"tau", "iterations"}
    x = _rand(9, 3)
    assert torch.equal(RULES["krum"].select(x, 2), krum_select(x, 2, m=1))
    assert torch.equal(RULES["multi_krum"].select(x, 2, m=4), krum_select(x, 2, m=4))


# --- check_rule -----------------------------------------------------------------------------------------------------

BOUNDS = {  # rule -> (bound as text, bound at f=2)
    "median": ("2f+1", 5),
    "trimmed_mean": ("2f+1", 5),
    "geometric_median": ("2f+1", 5),
    "centered_clipping": ("2f+1", 5),
    "krum": ("2f+3", 7),
    "multi_krum": ("2f+3", 7),
    "bulyan": ("4f+3", 11),
}


@pytest.mark.parametrize("rule", list(BOUNDS))
def test_check_rule_accepts_the_bound_and_rejects_one_less_with_the_numbers(rule):
    text, bound = BOUNDS[rule]
    check_rule(rule, bound, 2)
    message = f"aggregator='{rule}' with n={bound - 1}, f=2 is invalid: .* needs n >= {re.escape(text)} = {bound}"
    with pytest.raises(ValueError, match=message):
        check_rule(rule, bound - 1, 2)


def test_check_rule_krum_message_reads_as_documented():
    with pytest.raises(
        ValueError, match=re.escape("aggregator='krum' with n=6, f=2 is invalid: Krum needs n >= 2f+3 = 7")
    ):
        check_rule("krum", 6, 2)


def test_check_rule_multi_krum_m_must_be_in_one_to_n_minus_f():
    check_rule("multi_krum", 9, 2, m=7)
    check_rule("multi_krum", 9, 2, m=1)
    check_rule("multi_krum", 9, 2, m=None)
    for m in (0, 8, 2.5, True):
        with pytest.raises(ValueError, match=re.escape(f"m={m!r}: expected an integer in [1, n-f] = [1, 7]")):
            check_rule("multi_krum", 9, 2, m=m)


@pytest.mark.parametrize(
    ("rule", "kwargs", "message"),
    [
        ("geometric_median", {"nu": 0.0}, "nu=0.0: expected a finite number > 0"),
        ("geometric_median", {"iterations": 0}, "iterations=0: expected an integer >= 1"),
        ("centered_clipping", {"tau": -1.0}, "tau=-1.0: expected a finite number > 0"),
        ("centered_clipping", {"iterations": 1.5}, "iterations=1.5: expected an integer >= 1"),
    ],
)
def test_check_rule_rejects_bad_parameter_values(rule, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_rule(rule, 9, 2, **kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):  # the rule itself refuses them too
        RULES[rule].fn(_rand(9, 2), 2, **kwargs)


def test_check_rule_rejects_unknown_rules_and_parameters():
    with pytest.raises(ValueError, match=r"aggregator='krumm' is invalid: expected one of \['mean', 'median'"):
        check_rule("krumm", 9, 2)
    with pytest.raises(ValueError, match=r"got unknown parameters \['tau'\]: expected some of \['nu', 'iterations'\]"):
        check_rule("geometric_median", 9, 2, tau=1.0)
    with pytest.raises(ValueError, match=r"got unknown parameters \['m'\]: it takes no parameters"):
        check_rule("krum", 9, 2, m=2)


@pytest.mark.parametrize(("n", "f", "message"), [(0, 0, "n=0 is invalid"), (5, -1, "f=-1 is invalid")])
def test_check_rule_rejects_bad_n_and_f(n, f, message):
    with pytest.raises(ValueError, match=message):
        check_rule("median", n, f)


def test_check_rule_mean_with_f_warns_and_never_raises():
    with pytest.warns(UserWarning, match="aggregator='mean' with f=3: the mean tolerates no Byzantine worker"):
        check_rule("mean", 4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_rule("mean", 4, 0)


# --- the column sort behind median and trimmed mean ------------------------------------------------------------------
@pytest.mark.parametrize("n", range(1, 21))
def test_the_sorting_network_sorts_every_column(n):
    from lightning_zero.robust.order_statistics import sorting_network

    g = torch.Generator().manual_seed(n)
    x = torch.cat([torch.randn(n, 300, generator=g), torch.randint(0, 3, (n, 300), generator=g).float()], dim=1)
    rows = list(x.clone())
    for i, j in sorting_network(n):
        assert 0 <= i < j < n
        low = torch.minimum(rows[i], rows[j])
        rows[j] = torch.maximum(rows[i], rows[j])
        rows[i] = low
    assert torch.equal(torch.stack(rows), torch.sort(x, dim=0).values)
    assert len(sorting_network(8)) == 19


@pytest.mark.parametrize("n", range(1, 13))
def test_the_selection_network_leaves_every_range_of_ranks_in_place(n):
    from lightning_zero.robust.order_statistics import selection_network, sorting_network

    g = torch.Generator().manual_seed(n)
    x = torch.cat([torch.randn(n, 300, generator=g), torch.randint(0, 3, (n, 300), generator=g).float()], dim=1)
    values = torch.sort(x, dim=0).values
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            rows = list(x.clone())
            for i, j, low, high in selection_network(n, lo, hi):
                a, b = rows[i], rows[j]
                if low:
                    rows[i] = torch.minimum(a, b)
                if high:
                    rows[j] = torch.maximum(a, b)
            kept = torch.sort(torch.stack(rows[lo:hi]), dim=0).values
            assert torch.equal(kept, values[lo:hi]), (lo, hi)
            assert sum(low + high for _, _, low, high in selection_network(n, lo, hi)) <= 2 * len(sorting_network(n))
    assert sum(low + high for _, _, low, high in selection_network(8, 3, 5)) == 26  # the median of 8
    with pytest.raises(ValueError, match=r"positions \[3, 3\) are not a non-empty range of n=8 sorted values"):
        selection_network(8, 3, 3)


@pytest.mark.parametrize("n", [5, 8, 70])  # 70 rows: torch.sort instead of the network
def test_median_and_trimmed_mean_across_column_blocks_equal_a_whole_sort(n, monkeypatch):
    from lightning_zero.robust import order_statistics

    monkeypatch.setattr(order_statistics, "COLUMN_BLOCK", 7)  # 50 columns: 8 blocks, the last one short
    x = torch.randn(n, 50, generator=torch.Generator().manual_seed(n))
    values = torch.sort(x, dim=0).values
    assert torch.equal(median(x), values[(n - 1) // 2] * 0.5 + values[n // 2] * 0.5)
    torch.testing.assert_close(trimmed_mean(x, 2), values[2 : n - 2].mean(dim=0))


def test_a_finite_row_whose_sum_overflows_is_kept_and_nan_or_inf_anywhere_is_dropped():
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[big, big, 1.0], [1.0, 2.0, 3.0], [1.0, math.nan, 0.0], [-math.inf, 0.0, 0.0], [-big, -big, 0.0]])
    finite, f, kept = drop_nonfinite(x, 2)
    assert kept.tolist() == [0, 1, 4] and f == 0
    assert torch.equal(finite, x[[0, 1, 4]])
