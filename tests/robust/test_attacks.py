"""The attack simulation: which rows are replaced, the closed forms, reproducibility, and check_attack."""

from __future__ import annotations

import math
import re
from statistics import NormalDist

import pytest
import torch

from lightning_zero.robust.attacks import ATTACKS, alie_textbook_z, apply_attack, check_attack, flip_labels

N, D = 8, 5
BYZ = [2, 6]
HONEST = [i for i in range(N) if i not in BYZ]
KWARGS = {
    "sign_flip": {"scale": 2.0},
    "gaussian": {"std": 3.0},
    "alie": {"z": 1.5},
    "ipm": {"eps": 0.5},
    "mimic": {},
    "nan": {},
    "inf": {},
    "label_flip": {"num_classes": 10},
}


def _rand(n: int = N, d: int = D, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attack_replaces_exactly_the_byzantine_rows_and_not_the_input(attack):
    x = _rand()
    before = x.clone()
    out = apply_attack(attack, x, BYZ, generator=_gen(), **KWARGS[attack])
    assert torch.equal(x, before)
    assert out is not x and out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out[HONEST], x[HONEST])
    changed = [bool((out[i] != x[i]).any()) for i in BYZ]  # NaN != anything, so nan rows count as changed
    assert changed == [not ATTACKS[attack].data_level] * len(BYZ)


def test_sign_flip_sends_minus_scale_times_the_own_vector():
    x = _rand()
    out = apply_attack("sign_flip", x, BYZ, scale=2.0)
    assert torch.equal(out[BYZ], -2.0 * x[BYZ])
    assert torch.equal(apply_attack("sign_flip", x, BYZ)[BYZ], -x[BYZ])  # default scale 1


def test_ipm_sends_minus_eps_times_the_honest_mean():
    x = _rand()
    honest_mean = x[HONEST].sum(dim=0) / len(HONEST)
    for eps, kwargs in [(0.5, {"eps": 0.5}), (0.1, {})]:
        out = apply_attack("ipm", x, BYZ, **kwargs)
        for i in BYZ:
            assert torch.allclose(out[i], -eps * honest_mean, atol=1e-12, rtol=0)


def test_alie_shifts_the_honest_mean_by_z_sample_standard_deviations():
    x = _rand()
    h = x[HONEST]
    honest_mean = h.sum(dim=0) / len(HONEST)
    sample_std = (((h - honest_mean) ** 2).sum(dim=0) / (len(HONEST) - 1)).sqrt()
    out = apply_attack("alie", x, BYZ, z=1.5)
    for i in BYZ:
        assert torch.allclose(out[i], honest_mean - 1.5 * sample_std, atol=1e-12, rtol=0)


def test_alie_with_a_single_honest_row_sends_that_row():
    x = _rand(3, 4)
    out = apply_attack("alie", x, [0, 2], z=2.0)
    assert torch.equal(out[0], x[1]) and torch.equal(out[2], x[1])


def test_mimic_copies_the_lowest_honest_row_or_the_target():
    x = _rand()
    byz = [0, 3]
    assert torch.equal(apply_attack("mimic", x, byz)[byz], x[[1, 1]])
    assert torch.equal(apply_attack("mimic", x, byz, target=5)[byz], x[[5, 5]])


def test_nan_and_inf_rows():
    x = _rand()
    assert apply_attack("nan", x, BYZ)[BYZ].isnan().all()
    out = apply_attack("inf", x, BYZ)[BYZ]
    assert (out == math.inf).all()


def test_gaussian_is_reproducible_from_the_generator_and_scales_with_std():
    x = _rand()
    torch.manual_seed(0)
    first = apply_attack("gaussian", x, BYZ, generator=_gen(3), std=1.0)
    torch.manual_seed(1)  # the global RNG plays no part
    assert torch.equal(apply_attack("gaussian", x, BYZ, generator=_gen(3), std=1.0), first)
    assert not torch.equal(apply_attack("gaussian", x, BYZ, generator=_gen(4), std=1.0), first)
    doubled = apply_attack("gaussian", x, BYZ, generator=_gen(3), std=2.0)
    assert torch.allclose(doubled[BYZ], 2.0 * first[BYZ], atol=1e-12, rtol=0)
    # rows drawn i.i.d. N(0, std^2): a large draw has the right spread
    big = apply_attack("gaussian", torch.zeros(3, 20000, dtype=torch.float64), [0, 1], generator=_gen(0), std=3.0)
    assert abs(float(big[:2].std()) - 3.0) < 0.05
    assert abs(float(big[:2].mean())) < 0.05


def test_gaussian_needs_a_generator():
    with pytest.raises(ValueError, match=re.escape("attack='gaussian' needs a torch.Generator")):
        apply_attack("gaussian", _rand(), BYZ)


def test_no_byzantine_worker_changes_nothing():
    x = _rand()
    assert torch.equal(apply_attack("alie", x, [], z=1.0), x)


# --- alie_textbook_z and flip_labels --------------------------------------------------------------------------------


def test_alie_textbook_z_is_zero_at_n8_f2_and_follows_the_formula():
    assert alie_textbook_z(8, 2) == 0.0  # s = 5 - 2 = 3, quantile (6 - 3) / 6 = 0.5
    # n=25, f=5: s = floor(13.5) - 5 = 8, quantile (20 - 8) / 20 = 0.6
    assert alie_textbook_z(25, 5) == NormalDist().inv_cdf(0.6)
    assert alie_textbook_z(25, 5) > 0
    # n=50, f=10: s = 26 - 10 = 16, quantile (40 - 16) / 40 = 0.6
    assert alie_textbook_z(50, 10) == NormalDist().inv_cdf(0.6)


@pytest.mark.parametrize(("n", "f"), [(2, 1), (3, 3), (0, 0)])
def test_alie_textbook_z_rejects_sizes_without_a_quantile(n, f):
    with pytest.raises(ValueError, match=r"is (invalid|undefined)"):
        alie_textbook_z(n, f)


def test_flip_labels_maps_c_to_num_classes_minus_one_minus_c():
    y = torch.tensor([0, 1, 2, 9, 5])
    assert torch.equal(flip_labels(y, 10), torch.tensor([9, 8, 7, 0, 4]))
    assert torch.equal(flip_labels(flip_labels(y, 10), 10), y)
    assert torch.equal(y, torch.tensor([0, 1, 2, 9, 5]))


def test_flip_labels_rejects_labels_out_of_range_and_too_few_classes():
    with pytest.raises(
        ValueError, match=re.escape("labels in [0, 10]: expected classes in [0, num_classes-1] = [0, 9]")
    ):
        flip_labels(torch.tensor([0, 10]), 10)
    with pytest.raises(ValueError, match="num_classes=1: expected an integer >= 2"):
        flip_labels(torch.tensor([0]), 1)


# --- check_attack and the registry ----------------------------------------------------------------------------------


def test_check_attack_rejects_unknown_attacks_and_parameters():
    with pytest.raises(ValueError, match=r"attack='alei' is invalid: expected one of \['sign_flip', 'gaussian'"):
        check_attack("alei", 8, [7])
    with pytest.raises(ValueError, match=re.escape("got unknown parameters ['tau']: expected some of ['z']")):
        check_attack("alie", 8, [7], tau=1.5)
    with pytest.raises(ValueError, match=re.escape("got unknown parameters ['z']: it takes no parameters")):
        check_attack("nan", 8, [7], z=1.0)


def test_check_attack_byzantine_indices_are_unique_in_range_and_leave_an_honest_worker():
    check_attack("nan", 4, [0, 1, 2])  # n - 1 byzantine: the edge that passes
    with pytest.raises(
        ValueError, match="with n=4 and 4 byzantine workers is invalid: at least one worker must be honest"
    ):
        check_attack("nan", 4, [0, 1, 2, 3])
    with pytest.raises(ValueError, match=re.escape("byzantine workers [4, -1] outside [0, n-1] = [0, 3]")):
        check_attack("nan", 4, [0, 4, -1])
    with pytest.raises(ValueError, match=re.escape("repeated byzantine workers [1, 1]")):
        check_attack("nan", 4, [1, 1])


def test_check_attack_required_and_bad_parameters():
    with pytest.raises(ValueError, match=r"attack='alie' needs z .*alie_textbook_z\(n, f\)"):
        check_attack("alie", 8, [7])
    check_attack("alie", 8, [7], z=-0.5)  # any finite z, either direction
    with pytest.raises(ValueError, match=re.escape("z=nan: expected a finite number")):
        check_attack("alie", 8, [7], z=math.nan)
    with pytest.raises(ValueError, match="attack='label_flip' needs num_classes"):
        check_attack("label_flip", 8, [7])
    with pytest.raises(ValueError, match="num_classes=1: expected an integer >= 2"):
        check_attack("label_flip", 8, [7], num_classes=1)
    check_attack("label_flip", 8, [7], num_classes=2)
    for name, param in [("gaussian", "std"), ("sign_flip", "scale"), ("ipm", "eps")]:
        with pytest.raises(
            ValueError, match=re.escape(f"attack='{name}' got {param}=0.0: expected a finite number > 0")
        ):
            check_attack(name, 8, [7], **{param: 0.0})
    with pytest.raises(ValueError, match=re.escape("attack='mimic' got target=7: expected an honest worker, one of")):
        check_attack("mimic", 8, [7], target=7)
    with pytest.raises(ValueError, match="target=8"):
        apply_attack("mimic", _rand(), [7], target=8)


def test_the_registry_flags():
    assert [k for k, v in ATTACKS.items() if v.data_level] == ["label_flip"]
    assert set(ATTACKS) == set(KWARGS)
    assert all(set(KWARGS[k]) <= set(v.params) for k, v in ATTACKS.items())
