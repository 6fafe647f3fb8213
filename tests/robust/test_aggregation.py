"""RobustAggregator, the per-step pipeline (attack, non-finite filter, pre-aggregators, rule, metrics).

Checked: ``validate(n)`` (tolerance bounds with the numbers in the message, ``bucketing`` checking the rule at
``ceil(n / s)``, the attack's workers: default the last ``f``), construction-time rejection of unknown names and
parameters, the row-count guard of ``__call__``, the metrics in closed form (``honest_distance`` under ``ipm``,
``byzantine_selected`` of selection rules, ``None`` behind ``bucketing``, ``dropped`` under a ``nan`` attack), the
state of ``centered_clipping`` across calls, the ``state_dict`` round trip (centre and generator), and
``parse_stage``.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from lightning_zero.robust.aggregation import AggregationResult, RobustAggregator, parse_stage
from lightning_zero.robust.aggregators import check_rule
from lightning_zero.robust.attacks import apply_attack
from lightning_zero.robust.distance_rules import centered_clipping, multi_krum_select


def _stack(n: int, d: int = 6, seed: int = 0) -> torch.Tensor:
    """Honest-looking worker vectors: a common direction plus noise, float64."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=g, dtype=torch.float64)
    return base + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)


# --- validate -------------------------------------------------------------------------------------------------------


def test_validate_rejects_krum_below_its_bound_with_the_numbers():
    n, f = 6, 2
    bound = 2 * f + 3
    agg = RobustAggregator("krum", f=f)
    with pytest.raises(ValueError, match=rf"n={n}, f={f}.*2f\+3 = {bound}"):
        agg.validate(n)
    agg.validate(bound)  # the bound itself is fine
    assert agg.n == bound


@pytest.mark.parametrize("n", [8, 9, 10])
def test_bucketing_checks_the_rule_at_ceil_n_over_s(n):
    f, s = 2, 2
    seen = math.ceil(n / s)
    bound = 2 * f + 1
    RobustAggregator("centered_clipping", f=f).validate(n)  # without bucketing every n here passes
    agg = RobustAggregator("centered_clipping", f=f, pre_aggregators=[{"name": "bucketing", "s": s}])
    if seen < bound:
        with pytest.raises(ValueError, match=rf"n={seen}, f={f}.*= {bound}"):
            agg.validate(n)
        assert agg.n is None
    else:
        agg.validate(n)
        assert agg.n == n


def test_bucketing_with_n_8_s_2_raises_for_centered_clipping_mentioning_n_4():
    agg = RobustAggregator("centered_clipping", f=2, pre_aggregators=[{"name": "bucketing", "s": 2}])
    with pytest.raises(ValueError, match=r"aggregator='centered_clipping' with n=4, f=2"):
        agg.validate(8)


def test_validate_checks_each_pre_aggregator_at_what_it_sees():
    # nnm needs n >= 2f+1 at its own input
    with pytest.raises(ValueError, match=r"pre_aggregator='nnm' with n=4, f=2"):
        RobustAggregator("median", f=2, pre_aggregators=["nnm"]).validate(4)
    # bucketing without s only fails at validate (its parameters are known, s is missing)
    agg = RobustAggregator("median", f=1, pre_aggregators=["bucketing"])
    with pytest.raises(ValueError, match=r"needs s"):
        agg.validate(8)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"rule": "no_such_rule"}, r"aggregator='no_such_rule' is invalid"),
        ({"rule": "krum", "rule_kwargs": {"m": 2}}, r"aggregator='krum' got unknown parameters \['m'\]"),
        ({"rule": "geometric_median", "rule_kwargs": {"tau": 1.0}}, r"unknown parameters \['tau'\]"),
        ({"pre_aggregators": ["no_such_stage"]}, r"pre_aggregator='no_such_stage' is invalid"),
        ({"pre_aggregators": [{"name": "clip", "s": 2}]}, r"pre_aggregator='clip' got unknown parameters \['s'\]"),
        ({"attack": "no_such_attack", "f": 1}, r"attack='no_such_attack' is invalid"),
        ({"attack": "ipm", "f": 1, "attack_kwargs": {"z": 1.0}}, r"attack='ipm' got unknown parameters \['z'\]"),
        ({"f": -1}, r"f=-1 is invalid"),
        ({"f": True}, r"f=True is invalid"),
        ({"f": 1.0}, r"f=1.0 is invalid"),
    ],
)
def test_unknown_names_and_parameters_raise_at_construction(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        RobustAggregator(**kwargs)


def test_an_attack_with_f_0_and_no_byzantine_list_raises():
    agg = RobustAggregator("mean", f=0, attack="sign_flip")
    with pytest.raises(ValueError, match=r"attack='sign_flip' needs byzantine_workers or f > 0"):
        agg.validate(4)
    # naming the workers instead is fine, even with f = 0
    named = RobustAggregator("mean", f=0, attack="sign_flip", byzantine=[1])
    named.validate(4)
    assert named.byzantine == [1]


@pytest.mark.parametrize(("n", "f"), [(5, 1), (8, 2), (11, 3)])
def test_default_byzantine_workers_are_the_last_f(n, f):
    agg = RobustAggregator("median", f=f, attack="sign_flip")
    agg.validate(n)
    assert agg.byzantine == list(range(n - f, n))
    # and those are the rows the attack replaces: the mean of the attacked stack in closed form
    x = _stack(n)
    plain = RobustAggregator("mean", f=f, attack="sign_flip")
    plain.validate(n)
    expected = torch.cat([x[: n - f], -x[n - f :]]).mean(dim=0)
    torch.testing.assert_close(plain(x).vector, expected)


def test_validate_checks_the_attack_itself():
    agg = RobustAggregator("median", f=1, attack="sign_flip", byzantine=[9])
    with pytest.raises(ValueError, match=r"byzantine workers \[9\] outside \[0, n-1\] = \[0, 4\]"):
        agg.validate(5)
    with pytest.raises(ValueError, match=r"needs z"):
        RobustAggregator("median", f=1, attack="alie").validate(5)


def test_mean_with_f_warns_without_an_attack_and_not_with_one(recwarn):
    RobustAggregator("mean", f=1).validate(4)
    assert any("tolerates no Byzantine worker" in str(w.message) for w in recwarn.list)
    recwarn.clear()
    RobustAggregator("mean", f=1, attack="ipm").validate(4)
    assert not recwarn.list


@pytest.mark.parametrize("rows", [4, 6])
def test_a_stack_with_another_row_count_than_validated_raises(rows):
    agg = RobustAggregator("median", f=1)
    agg.validate(5)
    with pytest.raises(ValueError, match=rf"got {rows} worker vectors, validated for n=5"):
        agg(_stack(rows))


def test_calling_before_validate_raises():
    with pytest.raises(ValueError, match=r"validated for n=None"):
        RobustAggregator("median")(_stack(3))


# --- metrics in closed form -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "f", "eps"), [(8, 2, 0.5), (5, 1, 3.0), (10, 4, 0.1)])
def test_mean_under_ipm_is_off_the_honest_mean_by_f_1_plus_eps_over_n(n, f, eps):
    x = _stack(n, seed=n)
    agg = RobustAggregator("mean", f=f, attack="ipm", attack_kwargs={"eps": eps})
    agg.validate(n)
    result = agg(x)
    assert isinstance(result, AggregationResult)
    honest_mean = x[: n - f].mean(dim=0)
    expected = f * (1 + eps) / n * float(torch.linalg.vector_norm(honest_mean))
    assert result.honest_distance == pytest.approx(expected, rel=1e-5)
    assert result.byzantine_selected is None
    assert result.dropped == 0
    assert result.seconds >= 0.0
    torch.testing.assert_close(result.vector, (n - f - f * eps) / n * honest_mean)


def test_without_an_attack_honest_distance_is_to_the_mean_of_all_rows():
    x = _stack(7)
    agg = RobustAggregator("median", f=2)
    agg.validate(7)
    result = agg(x)
    expected_vector = torch.quantile(x, 0.5, dim=0)
    torch.testing.assert_close(result.vector, expected_vector)
    expected = float(torch.linalg.vector_norm(expected_vector - x.mean(dim=0)))
    assert result.honest_distance == pytest.approx(expected, rel=1e-5)  # the metric is taken in float32


def test_krum_never_selects_a_sign_flipped_row_scaled_by_100():
    n, f = 7, 2
    x = _stack(n)
    agg = RobustAggregator("krum", f=f, attack="sign_flip", attack_kwargs={"scale": 100.0})
    agg.validate(n)
    result = agg(x)
    assert result.byzantine_selected == 0.0
    # Krum's pick is one honest row, unchanged
    assert any(torch.equal(result.vector, x[i]) for i in range(n - f))


def test_krum_selection_share_counts_byzantine_picks():
    # mimic copies honest row 0 onto every Byzantine row: those copies are the closest rows, so Krum picks one
    n, f = 7, 2
    x = _stack(n)
    agg = RobustAggregator("multi_krum", f=f, rule_kwargs={"m": 3}, attack="mimic", byzantine=[0, 1])
    agg.validate(n)
    attacked = apply_attack("mimic", x, [0, 1])
    picks = multi_krum_select(attacked, f, m=3).tolist()
    expected = sum(i in (0, 1) for i in picks) / len(picks)
    assert expected > 0  # the case is meant to pick some
    assert agg(x).byzantine_selected == pytest.approx(expected)


@pytest.mark.parametrize(("n", "f"), [(7, 2), (9, 3)])
def test_multi_krum_without_attack_selects_no_byzantine_row(n, f):
    agg = RobustAggregator("multi_krum", f=f, rule_kwargs={"m": n - f})
    agg.validate(n)
    assert agg.byzantine == []
    result = agg(_stack(n))
    assert result.byzantine_selected == 0.0
    assert result.dropped == 0


def test_bucketing_hides_the_selection_share():
    n, f = 10, 1
    agg = RobustAggregator(
        "krum", f=f, pre_aggregators=[{"name": "bucketing", "s": 2}], attack="sign_flip", attack_kwargs={"scale": 9.0}
    )
    agg.validate(n)
    result = agg(_stack(n))
    assert result.byzantine_selected is None
    assert torch.isfinite(result.vector).all()


def test_nnm_keeps_rows_so_the_selection_share_is_reported():
    n, f = 7, 2
    agg = RobustAggregator("krum", f=f, pre_aggregators=["nnm"], attack="sign_flip", attack_kwargs={"scale": 100.0})
    agg.validate(n)
    assert agg(_stack(n)).byzantine_selected is not None


@pytest.mark.parametrize(("n", "f"), [(5, 2), (8, 3)])
def test_a_nan_attack_is_dropped_before_the_median(n, f):
    x = _stack(n)
    agg = RobustAggregator("median", f=f, attack="nan")
    agg.validate(n)
    result = agg(x)
    assert result.dropped == f
    assert torch.isfinite(result.vector).all()
    # the median of what is left: the honest rows
    torch.testing.assert_close(result.vector, torch.quantile(x[: n - f], 0.5, dim=0))
    assert math.isfinite(result.honest_distance)


def test_a_nan_attack_poisons_the_bare_mean():
    n, f = 6, 1
    agg = RobustAggregator("mean", f=f, attack="nan")
    agg.validate(n)
    result = agg(_stack(n))
    assert torch.isnan(result.vector).all()
    assert result.dropped == 0


def test_selection_share_after_dropping_rows_is_in_the_original_numbering():
    # the NaN row 0 is dropped; Multi-Krum then keeps all 6 finite rows (1..6), none of them Byzantine. Picks left in
    # the filtered numbering (0..5) would count row 0 as Byzantine and give 1/6.
    n, f = 7, 1
    agg = RobustAggregator("multi_krum", f=f, rule_kwargs={"m": n - f}, attack="nan", byzantine=[0])
    agg.validate(n)
    result = agg(_stack(n))
    assert result.dropped == 1
    assert result.byzantine_selected == 0.0
    torch.testing.assert_close(result.vector, _stack(n)[1:].mean(dim=0))


def test_the_input_stack_is_not_modified():
    x = _stack(6)
    before = x.clone()
    agg = RobustAggregator("median", f=2, attack="sign_flip")
    agg.validate(6)
    agg(x)
    assert torch.equal(x, before)


# --- state ----------------------------------------------------------------------------------------------------------


def test_centered_clipping_starts_from_the_previous_result():
    n, f, tau = 6, 2, 0.5
    x1, x2 = _stack(n, seed=1), _stack(n, seed=2)
    agg = RobustAggregator("centered_clipping", f=f, rule_kwargs={"tau": tau})
    agg.validate(n)
    first = agg(x1).vector
    torch.testing.assert_close(first, centered_clipping(x1, f, tau=tau))
    torch.testing.assert_close(agg.center, first)
    second = agg(x2).vector
    torch.testing.assert_close(second, centered_clipping(x2, f, center=first, tau=tau))
    # the centre matters here: from zeros the result differs
    assert not torch.allclose(second, centered_clipping(x2, f, tau=tau))
    torch.testing.assert_close(agg.center, second)


def test_stateless_rules_keep_no_centre():
    agg = RobustAggregator("median", f=1)
    agg.validate(4)
    agg(_stack(4))
    assert agg.center is None
    assert agg.state_dict()["center"] is None


def test_state_dict_round_trip_restores_the_centre_and_the_generator():
    n, f, std, tau = 6, 2, 4.0, 1.0
    x = _stack(n)
    kwargs = {
        "rule": "centered_clipping",
        "f": f,
        "rule_kwargs": {"tau": tau},
        "attack": "gaussian",
        "attack_kwargs": {"std": std},
    }
    agg = RobustAggregator(**kwargs, seed=3)
    agg.validate(n)
    agg(x)  # advance the generator and set a centre
    saved = agg.state_dict()
    saved_center = saved["center"].clone()
    after_save = agg(x).vector  # draws new rows, moves the centre

    # the closed form of the step after the save: the gaussian rows the saved generator draws next
    g = torch.Generator()
    g.set_state(saved["generator"])
    attacked = apply_attack("gaussian", x, list(range(n - f, n)), generator=g, std=std)
    torch.testing.assert_close(after_save, centered_clipping(attacked, f, center=saved_center, tau=tau))

    # a fresh aggregator with another seed, loaded, repeats that step exactly
    other = RobustAggregator(**kwargs, seed=99)
    other.validate(n)
    other.load_state_dict(saved)
    torch.testing.assert_close(other.center, saved_center)
    assert other.center is not saved["center"]
    assert torch.equal(other(x).vector, after_save)

    # and so does the original one, loaded back
    agg.load_state_dict(saved)
    assert torch.equal(agg(x).vector, after_save)


def test_load_state_dict_without_a_centre_clears_it():
    agg = RobustAggregator("centered_clipping", f=1)
    agg.validate(4)
    fresh = agg.state_dict()
    agg(_stack(4))
    assert agg.center is not None
    agg.load_state_dict(fresh)
    assert agg.center is None


def test_the_seed_drives_bucketing():
    n = 8
    x = _stack(n)

    def run(seed: int) -> torch.Tensor:
        agg = RobustAggregator("median", f=1, pre_aggregators=[{"name": "bucketing", "s": 2}], seed=seed)
        agg.validate(n)
        return agg(x).vector

    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))


# --- parse_stage ----------------------------------------------------------------------------------------------------


def test_parse_stage_accepts_a_name_or_a_mapping():
    assert parse_stage("nnm") == ("nnm", {})
    assert parse_stage({"name": "clip", "c": 1.0}) == ("clip", {"c": 1.0})
    assert parse_stage({"name": "bucketing", "s": 2}) == ("bucketing", {"s": 2})


@pytest.mark.parametrize("bad", [{"c": 1.0}, 3, None, ["nnm"], ("clip", 1.0)])
def test_parse_stage_rejects_other_entries(bad):
    with pytest.raises(ValueError, match=re.escape(f"pre_aggregators entry {bad!r} is invalid")):
        parse_stage(bad)


def test_a_bad_stage_entry_raises_at_construction():
    with pytest.raises(ValueError, match=r"pre_aggregators entry"):
        RobustAggregator("median", pre_aggregators=[{"c": 1.0}])


def test_check_rule_and_validate_agree_on_the_bound():
    # validate adds nothing to check_rule for a bare rule: same pass/fail at every n
    f = 1
    for n in range(1, 8):
        try:
            check_rule("bulyan", n, f)
            expected_ok = True
        except ValueError:
            expected_ok = False
        agg = RobustAggregator("bulyan", f=f)
        if expected_ok:
            agg.validate(n)
        else:
            with pytest.raises(ValueError):
                agg.validate(n)
        assert expected_ok == (n >= 4 * f + 3)
