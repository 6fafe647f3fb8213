"""The rules that rank workers by their distances to each other: Krum, Multi-Krum and Bulyan; and the two that
iterate towards a robust centre by norms: the geometric median and centered clipping.

Every distance and norm sums over every coordinate through the rule's ``total``
(:data:`~lightning_zero.robust.stack.Total`), so a rank holding a column shard of the stack ranks and weighs the
workers as the whole stack would. The selection rules also expose their picks (``*_select``) and the rule's vector
from those picks (``*_from_picks``), so a caller that needs both computes the distances once. The conventions are
those of :mod:`lightning_zero.robust.aggregators`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_zero.robust.order_statistics import middle
from lightning_zero.robust.stack import (
    Total,
    acc_dtype,
    check_positive_int,
    check_positive_number,
    pairwise_sq_dists,
    robust_rule,
    row_norms,
    whole,
)


def _krum_scores_from(dist: Tensor, f: int) -> Tensor:
    """Krum scores from squared distances: sum over the ``n - f - 2`` nearest *other* vectors."""
    n = dist.shape[0]
    k = n - f - 2
    if k <= 0:
        return torch.zeros(n, dtype=dist.dtype, device=dist.device)
    # the diagonal (a vector's distance to itself) must never count as a neighbour
    off_diagonal = dist + torch.diag(torch.full((n,), math.inf, dtype=dist.dtype, device=dist.device))
    return torch.sort(off_diagonal, dim=1).values[:, :k].sum(dim=1)


@robust_rule()
def krum_scores(x: Tensor, f: int, total: Total = whole) -> Tensor:
    """Krum scores (Blanchard et al., 2017): ``score_i`` = sum of squared distances from ``x_i`` to its ``n - f - 2``
    nearest other vectors; 0 for every row when ``n - f - 2 <= 0``.

    Scores are computed on the finite rows with the lowered ``f`` (one per finite row, in their order); use
    :func:`krum_select` for indices in the caller's numbering.
    """
    return _krum_scores_from(pairwise_sq_dists(x, total), f)


def _krum_order(x: Tensor, f: int, total: Total) -> Tensor:
    """Row indices by increasing Krum score; ties go to the lower index."""
    return torch.sort(_krum_scores_from(pairwise_sq_dists(x, total), f), stable=True).indices


def _resolve_m(x: Tensor, f: int, m: int | None) -> int:
    if m is None:
        return max(x.shape[0] - f, 1)
    check_positive_int("krum", "m", m)
    # m <= n - f is check_rule's job; here m can only exceed the rows left when more than f rows were non-finite
    return min(int(m), x.shape[0])


@robust_rule(selects=True)
def krum_select(x: Tensor, f: int, m: int = 1, total: Total = whole) -> Tensor:
    """Indices (LongTensor ``(m,)``) of the ``m`` rows with the lowest Krum scores, best first; ties go to the lower
    index. Indices are in the caller's numbering, never a non-finite row.

    When more than ``f`` rows were non-finite, fewer than ``m`` finite rows may be left: ``m`` is then lowered to
    their number (:func:`~lightning_zero.robust.aggregators.check_rule` has already rejected ``m > n - f``).
    """
    return _krum_order(x, f, total)[: _resolve_m(x, f, m)]


@robust_rule()
def krum(x: Tensor, f: int, total: Total = whole) -> Tensor:
    """Krum (Blanchard et al., 2017): the vector with the lowest Krum score (see :func:`krum_scores`)."""
    return krum_from_picks(x, _krum_order(x, f, total), f)


def krum_pick(x: Tensor, f: int, total: Total = whole) -> Tensor:
    """Krum's single pick, as a selection: ``krum_select(x, f, m=1)``."""
    return krum_select(x, f, m=1, total=total)


def krum_from_picks(x: Tensor, picks: Tensor, f: int) -> Tensor:
    """Krum's vector from its picks."""
    return x[picks[0]].clone()


def multi_krum_from_picks(x: Tensor, picks: Tensor, f: int) -> Tensor:
    """Multi-Krum's vector from its picks."""
    return x[picks].mean(dim=0)


@robust_rule(selects=True)
def multi_krum_select(x: Tensor, f: int, m: int | None = None, total: Total = whole) -> Tensor:
    """Indices of the ``m`` rows :func:`multi_krum` averages (default ``m = n - f``), in the caller's numbering."""
    return _krum_order(x, f, total)[: _resolve_m(x, f, m)]


@robust_rule()
def multi_krum(x: Tensor, f: int, m: int | None = None, total: Total = whole) -> Tensor:
    """Multi-Krum: the MEAN (not the sum) of the ``m`` rows with the lowest Krum scores; default ``m = n - f``.

    ``m = 1`` is :func:`krum`; ``m = n`` with ``f = 0`` is :func:`~lightning_zero.robust.aggregators.mean`.
    """
    return multi_krum_from_picks(x, _krum_order(x, f, total)[: _resolve_m(x, f, m)], f)


@robust_rule()
def geometric_median(x: Tensor, f: int = 0, *, nu: float = 0.1, iterations: int = 3, total: Total = whole) -> Tensor:
    """Approximate geometric median by smoothed Weiszfeld iterations (as ByzFL's ``GeometricMedian``).

    ``z <- sum_i w_i x_i / sum_i w_i`` with ``w_i = 1 / max(nu, ||z - x_i||)``, ``iterations`` times, starting at
    ZERO rather than at the mean: from zero a far outlier is far and gets a tiny weight in the very first step,
    whereas the mean is already dragged towards it and the few iterations would start from a spoiled point. ``nu > 0``
    keeps a weight finite when ``z`` lands on a row. ``f`` only forgives dropped non-finite rows.
    """
    check_positive_number("geometric_median", "nu", nu)
    check_positive_int("geometric_median", "iterations", iterations)
    acc = x.to(acc_dtype(x))
    z = torch.zeros_like(acc[0])
    for _ in range(iterations):
        distances = row_norms(acc - z, total)
        weights = 1.0 / distances.clamp_min(nu)
        z = (weights / weights.sum()) @ acc
    return z.to(x.dtype)


@robust_rule()
def centered_clipping(
    x: Tensor,
    f: int = 0,
    *,
    center: Tensor | None = None,
    tau: float = 10.0,
    iterations: int = 1,
    total: Total = whole,
) -> Tensor:
    """Centered clipping (Karimireddy et al., 2021).

    ``v <- v + mean_i (x_i - v) * min(1, tau / ||x_i - v||)``, ``iterations`` times, from ``center`` (zeros when
    ``None``); a zero difference keeps factor 1. The rule is stateful: the caller passes the previous step's result as
    the next ``center`` (with worker momentum the aggregate moves slowly, so the last one is a good centre). ``f`` is
    not a parameter of the rule (only dropped non-finite rows use it); its tolerance ``n > 2f`` is checked by
    :func:`~lightning_zero.robust.aggregators.check_rule`.
    """
    check_positive_number("centered_clipping", "tau", tau)
    check_positive_int("centered_clipping", "iterations", iterations)
    acc = x.to(acc_dtype(x))
    if center is None:
        v = torch.zeros_like(acc[0])
    else:
        if tuple(center.shape) != (x.shape[1],):
            raise ValueError(f"center has shape {tuple(center.shape)}: expected ({x.shape[1]},), one value per column")
        v = center.to(dtype=acc.dtype, device=acc.device)
    for _ in range(iterations):
        diff = acc - v
        norms = row_norms(diff, total)
        # where() rather than min(1, tau / norm): a zero norm must give factor 1, not a 0/0
        scale = torch.where(norms > tau, tau / norms, torch.ones_like(norms))
        v = v + (diff * scale[:, None]).mean(dim=0)
    return v.to(x.dtype)


def _bulyan_sizes(n: int, f: int) -> tuple[int, int]:
    theta, beta = n - 2 * f, n - 4 * f
    if beta < 1:
        raise ValueError(
            f"bulyan with n={n}, f={f} selects theta=n-2f={theta} and keeps beta=theta-2f={beta} values per "
            f"coordinate: it needs n >= 4f+3 = {4 * f + 3}"
        )
    return theta, beta


def _bulyan_pick(x: Tensor, f: int, total: Total) -> Tensor:
    """The ``theta = n - 2f`` rows picked by iterated Krum, in picking order.

    The last rounds run on ``r < f + 3`` remaining rows, where Krum has no neighbour to count and scores every row 0
    (:func:`krum_scores`' convention); with ``f = 1`` the final round always does. Ties in a round, those included, go
    to the better Krum score on the whole set, and only then to the lower index: picking by index alone would make the
    result depend on the order of the rows.
    """
    n = x.shape[0]
    theta, _ = _bulyan_sizes(n, f)
    dist = pairwise_sq_dists(x, total)  # computed once; each round re-scores the remaining rows
    overall = _krum_scores_from(dist, f)
    remaining = torch.arange(n, device=x.device)
    picked = []
    for _ in range(theta):
        sub = dist[remaining][:, remaining]
        by_overall = torch.sort(overall[remaining], stable=True).indices
        round_scores = _krum_scores_from(sub, f)[by_overall]
        best = int(by_overall[torch.sort(round_scores, stable=True).indices[0]])
        picked.append(remaining[best])
        remaining = torch.cat([remaining[:best], remaining[best + 1 :]])
    return torch.stack(picked)


@robust_rule(selects=True)
def bulyan_select(x: Tensor, f: int, total: Total = whole) -> Tensor:
    """Indices (``(theta,)``, ``theta = n - 2f``) of the rows Bulyan's iterated Krum picks, in picking order and the
    caller's numbering."""
    return _bulyan_pick(x, f, total)


@robust_rule()
def bulyan(x: Tensor, f: int, total: Total = whole) -> Tensor:
    """Bulyan (El Mhamdi et al., 2018) on top of Krum.

    1. pick ``theta = n - 2f`` rows by iterated Krum: Krum with the same ``f`` on the remaining rows, remove the
       winner, repeat (ties go to the better Krum score on all rows, then to the lower index);
    2. per coordinate, average the ``beta = theta - 2f`` values of the picked rows closest to their coordinate-wise
       median (:func:`~lightning_zero.robust.order_statistics.median`'s even-n convention; equal distances go to the
       lower row index).

    Needs ``n >= 4f + 3``.
    """
    return bulyan_from_picks(x, _bulyan_pick(x, f, total), f)


def bulyan_from_picks(x: Tensor, picks: Tensor, f: int) -> Tensor:
    """Bulyan's coordinate-wise stage (2.) on the rows its iterated Krum picked."""
    _, beta = _bulyan_sizes(x.shape[0], f)
    # ascending row order, so that equal distances to the median go to the lower original index
    chosen = x[torch.sort(picks).values]
    center = middle(torch.sort(chosen, dim=0).values)
    closest = torch.sort((chosen - center).abs(), dim=0, stable=True).indices[:beta]
    return torch.gather(chosen, 0, closest).mean(dim=0)
