"""Cross-check the rules, pre-aggregators and attacks against ByzFL 0.0.11 (EPFL's reference implementations).

``import byzfl`` fails here: its package ``__init__`` imports its FL framework, which imports torchvision, and the
torchvision ByzFL pulls in is a CUDA build that does not load on this CPU torch (byzfl is installed ``--no-deps``).
Its maths lives in ``byzfl.aggregators`` and ``byzfl.attacks``, which only need numpy, scipy and torch, so the fixture
registers an empty ``byzfl`` package (the real search path, without running ``byzfl/__init__.py``) and imports those.

ByzFL's conventions, read from its sources, and how they map onto ours:

* Inputs: a torch tensor is cast to float32 (``check_vectors_type``), so the comparisons feed float64 numpy arrays,
  which ByzFL keeps in float64 (numpy / scipy path), and compare to 1e-9; one test covers the torch path at float32
  tolerance.
* ``Median``: ``np.median`` on arrays and ``torch.quantile(q=0.5)`` on tensors (``torch.median``, the lower median,
  is commented out in 0.0.11): both average the two middle values for even n, as ours does, so even n agrees too.
* ``Krum(f)`` averages the squared distances to the ``n - f - 1`` nearest others (Blanchard et al. count
  ``n - f - 2``, and sum): the argmin is the same, so ours with ``f`` equals ByzFL's with ``f + 1``.
* ``MultiKrum(f)`` scores like its Krum and averages ``m = n - f`` vectors: ours ``multi_krum(f, m=n-f-1)`` equals
  ByzFL's ``MultiKrum(f + 1)``.
* ``GeometricMedian(nu, T)``: smoothed Weiszfeld from zero, like ours with the same ``nu`` and ``iterations``.
* ``CenteredClipping(m, L, tau)``: its constructor rejects any ``m`` that is not ``None`` (the type check can never
  pass), so only the zero start compares; the object keeps its result as the next centre, like our caller does.
* ``NNM(f)`` and ``Clipping(c)`` are ours (``Clipping`` scales its input in place: it gets a copy).
* ``Bucketing`` shuffles with the global RNG: not comparable; Bulyan is not in ByzFL 0.0.11.
* Attacks: ``InnerProductManipulation(tau)`` is our ``ipm(eps=tau)``; ``ALittleIsEnough(tau)`` is
  ``mean + tau * std`` with the sample std, i.e. our ``alie(z=-tau)``; ``Mimic(epsilon)`` copies the ``epsilon``-th
  honest vector. ``SignFlipping`` sends minus the honest mean, whereas our ``sign_flip`` sends minus the worker's own
  vector (the "bit flipping" of Karimireddy et al.): not compared.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from lightning_zero.robust.attacks import apply_attack
from lightning_zero.robust.distance_rules import centered_clipping, geometric_median, krum, multi_krum
from lightning_zero.robust.order_statistics import median, trimmed_mean
from lightning_zero.robust.preaggregators import clip, nnm

SEEDS = [0, 1, 2]
SIZES = [7, 9, 11]
D = 6
TOL = 1e-9


def _byzfl_modules() -> dict[str, types.ModuleType]:
    return {k: v for k, v in sys.modules.items() if k == "byzfl" or k.startswith("byzfl.")}


@pytest.fixture(scope="module")
def byzfl() -> Iterator[types.SimpleNamespace]:
    spec = importlib.util.find_spec("byzfl")  # locates the package without executing its __init__
    if spec is None or spec.submodule_search_locations is None:
        pytest.skip("byzfl not installed")
    saved = _byzfl_modules()
    package = types.ModuleType("byzfl")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["byzfl"] = package
    try:
        yield types.SimpleNamespace(
            agg=importlib.import_module("byzfl.aggregators"), attacks=importlib.import_module("byzfl.attacks")
        )
    finally:
        for name in _byzfl_modules():
            del sys.modules[name]
        sys.modules.update(saved)


def _x(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _theirs(result) -> torch.Tensor:
    return torch.as_tensor(np.asarray(result), dtype=torch.float64)


def _close(ours: torch.Tensor, theirs, tol: float = TOL) -> bool:
    return torch.allclose(ours.double(), _theirs(theirs), atol=tol, rtol=tol)


grid = pytest.mark.parametrize(("n", "seed"), [(n, s) for n in SIZES for s in SEEDS])


@grid
def test_median(byzfl, n, seed):
    x = _x(n, seed)
    assert _close(median(x), byzfl.agg.Median()(x.numpy()))


@pytest.mark.parametrize("n", [6, 8, 10])
def test_median_even_n_agrees_on_both_byzfl_paths(byzfl, n):
    # ByzFL 0.0.11 uses np.median / torch.quantile(0.5): the average of the two middle values, like ours; not
    # torch.median's lower value (which an earlier ByzFL used on tensors, and which this guards against)
    x = _x(n, 0)
    assert _close(median(x), byzfl.agg.Median()(x.numpy()))
    assert _close(median(x.float()), byzfl.agg.Median()(x.float()).numpy(), tol=1e-6)
    lower = torch.sort(x, dim=0).values[n // 2 - 1]
    assert not torch.allclose(median(x), lower)


@grid
@pytest.mark.parametrize("f", [1, 2, 3])
def test_trimmed_mean(byzfl, n, seed, f):
    x = _x(n, seed)
    assert _close(trimmed_mean(x, f), byzfl.agg.TrMean(f=f)(x.numpy()))


@grid
@pytest.mark.parametrize(("nu", "iterations"), [(0.1, 3), (1e-3, 10), (0.5, 1)])
def test_geometric_median(byzfl, n, seed, nu, iterations):
    x = _x(n, seed)
    x[0] *= 100  # a far row, so that the weights differ
    theirs = byzfl.agg.GeometricMedian(nu=nu, T=iterations)(x.numpy())
    assert _close(geometric_median(x, nu=nu, iterations=iterations), theirs)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("f", [1, 2])
def test_krum_with_f_is_byzfl_krum_with_f_plus_one(byzfl, n, f):
    # many low-dimensional draws: there the neighbour count often changes the winner, so a wrong mapping shows
    for seed in range(10):
        x = torch.randn(n, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        assert torch.equal(krum(x, f), _theirs(byzfl.agg.Krum(f=f + 1)(x.numpy()))), seed


@grid
@pytest.mark.parametrize("f", [1, 2])
def test_multi_krum_with_m_n_minus_f_minus_one_is_byzfl_multikrum_with_f_plus_one(byzfl, n, seed, f):
    x = _x(n, seed)
    assert _close(multi_krum(x, f, m=n - f - 1), byzfl.agg.MultiKrum(f=f + 1)(x.numpy()))


@grid
@pytest.mark.parametrize(("tau", "iterations"), [(1.0, 1), (0.3, 3), (100.0, 2)])
def test_centered_clipping_from_zero_and_then_from_its_last_result(byzfl, n, seed, tau, iterations):
    x = _x(n, seed) + 2.0
    theirs = byzfl.agg.CenteredClipping(m=None, L=iterations, tau=tau)
    first = centered_clipping(x, tau=tau, iterations=iterations)
    assert _close(first, theirs(x.numpy()))
    # ByzFL keeps its result as the next centre: our caller passes it as `center`
    x2 = _x(n, seed + 100)
    assert _close(centered_clipping(x2, center=first, tau=tau, iterations=iterations), theirs(x2.numpy()))


@grid
@pytest.mark.parametrize("f", [0, 1, 3])
def test_nnm(byzfl, n, seed, f):
    x = _x(n, seed)
    assert _close(nnm(x, f), byzfl.agg.NNM(f=f)(x.numpy()))


@grid
@pytest.mark.parametrize("c", [0.5, 2.0, 10.0])
def test_clip(byzfl, n, seed, c):
    x = _x(n, seed) * torch.linspace(0.1, 3.0, n, dtype=torch.float64)[:, None]
    assert _close(clip(x, c), byzfl.agg.Clipping(c=c)(x.numpy().copy()))


@pytest.mark.parametrize("seed", SEEDS)
def test_rules_on_byzfl_torch_path_at_float32_precision(byzfl, seed):
    x = _x(9, seed).float()
    tol = 1e-5
    assert _close(trimmed_mean(x, 2), byzfl.agg.TrMean(f=2)(x).numpy(), tol)
    assert _close(geometric_median(x), byzfl.agg.GeometricMedian(nu=0.1, T=3)(x).numpy(), tol)
    assert _close(krum(x, 2), byzfl.agg.Krum(f=3)(x).numpy(), tol)
    assert _close(nnm(x, 2), byzfl.agg.NNM(f=2)(x).numpy(), tol)


@pytest.mark.parametrize("seed", SEEDS)
def test_ipm_alie_and_mimic_attacks(byzfl, seed):
    n, byzantine = 9, [3, 8]
    x = _x(n, seed)
    honest = x[[i for i in range(n) if i not in byzantine]].numpy()
    ours = apply_attack("ipm", x, byzantine, eps=0.7)
    assert _close(ours[3], byzfl.attacks.InnerProductManipulation(tau=0.7)(honest))
    ours = apply_attack("alie", x, byzantine, z=1.3)
    assert _close(ours[8], byzfl.attacks.ALittleIsEnough(tau=-1.3)(honest))
    ours = apply_attack("mimic", x, byzantine, target=4)  # the 4th honest row (index 3 among the honest)
    assert _close(ours[3], byzfl.attacks.Mimic(epsilon=3)(honest))
