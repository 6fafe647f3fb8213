"""Pure Byzantine-robust aggregation rules: ``(n, d)`` worker vectors in, one ``(d,)`` vector out.

Nothing here touches torch.distributed or Lightning, so every rule is unit-tested on plain tensors
(``tests/robust/test_aggregators.py``) and cross-checked against the ByzFL library
(``tests/robust/test_byzfl_crosscheck.py``).

Runbook::

    check_rule("krum", n=8, f=2)             # tolerance and parameter checks; ValueError names rule, n, f, bound
    spec = RULES["krum"]
    vector = spec.fn(stack, 2)               # stack: (n, d), one row per worker -> (d,)
    picks = spec.select(stack, 2)            # selection rules only: the rows picked, in the stack's numbering

Conventions shared by every rule:

* ``x`` is never modified; the result has ``x``'s dtype and device. Distances and norms are accumulated in at least
  float32 (a bf16/fp16 squared distance overflows or rounds away the differences Krum ranks by).
* Everything is deterministic: no rule draws random numbers; ties go to the lower row index (stable sorts).
* Rows holding NaN/Inf are certainly Byzantine: every robust rule (all but :func:`mean`) first drops them with
  :func:`drop_nonfinite` and lowers ``f`` by as many, and selection rules report rows in the *original* numbering.
  :func:`mean` is the unprotected baseline and does not filter: one NaN row poisons it, which is the point.
* Rules that need sums over all coordinates (distances, norms) take ``total``, which turns sums over the coordinates
  held here into sums over every coordinate; the default, :func:`whole`, is for a stack that holds them all. A rank
  holding a column shard passes one that adds every shard's partial sums
  (:class:`~lightning_zero.robust.shards.ColumnShard`, [Note: sharded aggregation]): everything else the rules do is
  coordinate-wise, so the same functions aggregate a shard.
* The rules do not enforce the tolerance bounds (``n > 2f``, ``n >= 2f+3``, ``n >= 4f+3``): :func:`check_rule`
  does, once, before training, and never lowers ``f`` silently.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Total = Callable[[Tensor], Tensor]
"""Partial sums over the coordinates held here -> sums over every coordinate (the same shape)."""


def whole(partial: Tensor) -> Tensor:
    """The :data:`Total` of a stack that holds every coordinate: the partial sums are the sums."""
    return partial


def _sum_of(rows: list[Tensor]) -> Tensor:
    """The rows added one after the other, into a new tensor."""
    return _sum_into(rows, torch.empty_like(rows[0]))


def _sum_into(rows: list[Tensor], out: Tensor) -> Tensor:
    """The rows added one after the other, into ``out`` (returned)."""
    out.copy_(rows[0])
    for row in rows[1:]:
        out += row
    return out


def mean_of_rows(x: Tensor, rows: list[int]) -> Tensor:
    """The mean of the rows ``rows`` of ``x``, added one by one: no copy of those rows is made (``x[rows]`` would copy
    them all, ``n x d`` values for a whole stack)."""
    return _sum_of([x[i] for i in rows]).div_(len(rows))


def sq_distance_to_mean(vector: Tensor, x: Tensor, rows: list[int]) -> Tensor:
    """``||vector - mean of x's rows||^2`` (a scalar, accumulated in at least float32), column block by column block
    (:data:`COLUMN_BLOCK`): no ``(d,)`` temporaries."""
    dtype = _acc_dtype(x)
    out = torch.zeros((), dtype=dtype, device=x.device)
    every = len(rows) == x.shape[0]
    for lo in range(0, x.shape[1], COLUMN_BLOCK):
        block = x[:, lo : lo + COLUMN_BLOCK]
        mean = block.mean(dim=0) if every else mean_of_rows(block, rows)
        out += (vector[lo : lo + COLUMN_BLOCK].to(dtype) - mean.to(dtype)).square().sum()
    return out


def _check_stack(x: Tensor) -> None:
    if not isinstance(x, Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"expected a (n, d) tensor of worker vectors, one row per worker: got {shape}")


def _check_f(f: Any) -> None:
    if isinstance(f, bool) or not isinstance(f, numbers.Integral) or f < 0:
        raise ValueError(f"f={f!r} is invalid: expected an integer >= 0")


def _acc_dtype(x: Tensor) -> torch.dtype:
    """The dtype distances and norms are accumulated in: x's own, but at least float32."""
    return torch.promote_types(x.dtype, torch.float32)


def _finite_rows(x: Tensor) -> Tensor:
    """Whether each row holds only finite values. A row whose sum is finite holds no NaN or Inf (either would make the
    sum non-finite), so one reduction decides for all rows but those whose sum is not finite (NaN, Inf, or finite
    values that overflow the sum), which are decided by their largest and smallest value (``amax``/``amin`` propagate
    NaN). Measured ~20x faster than ``torch.isfinite(x).all(dim=1)`` on one CPU thread."""
    finite = torch.isfinite(x.sum(dim=1, dtype=_acc_dtype(x)))
    suspects = torch.nonzero(~finite).flatten()
    if suspects.numel():
        rows = x[suspects]
        finite[suspects] = torch.isfinite(rows.amax(dim=1)) & torch.isfinite(rows.amin(dim=1))
    return finite


def drop_nonfinite(x: Tensor, f: int, total: Total = whole) -> tuple[Tensor, int, Tensor]:
    """Drop the rows holding NaN or Inf, and lower ``f`` by as many.

    A non-finite row is certainly Byzantine, so removing ``k`` of them removes ``k`` from both ``n`` and ``f``:
    every tolerance bound (``n > 2f``, ``n >= 2f+3``, ``n >= 4f+3``) that held before still holds for the rest. When
    more rows are dropped than ``f``, the effective ``f`` stops at 0.

    Args:
        x: ``(n, d)`` worker vectors.
        f: the number of Byzantine workers to tolerate, >= 0.
        total: see the module docstring: a row is dropped when it holds NaN or Inf in any shard.

    Returns:
        ``(finite, f_eff, kept)``: the finite rows (``x`` itself when all are finite), ``max(f - dropped, 0)`` and
        the original indices of the kept rows (a LongTensor on ``x``'s device).

    Raises:
        ValueError: when no row is finite (nothing is left to aggregate).
    """
    _check_stack(x)
    _check_f(f)
    n = x.shape[0]
    finite = total((~_finite_rows(x)).to(_acc_dtype(x))) == 0
    kept = torch.nonzero(finite).flatten()
    dropped = n - kept.numel()
    if dropped == 0:
        return x, int(f), kept
    if dropped == n:
        raise ValueError(f"all n={n} worker vectors hold NaN or Inf: nothing finite is left to aggregate")
    return x[kept], max(int(f) - dropped, 0), kept


def _robust(*, selects: bool = False) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Wrap a rule ``fn(x, f, ...)`` so that it runs on the finite rows with the lowered ``f``.

    With ``selects=True`` the rule returns row indices, which are mapped back to the caller's numbering.
    """

    def decorate(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Tensor:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            total = bound.arguments.get("total", whole)
            finite, f_eff, kept = drop_nonfinite(bound.arguments["x"], bound.arguments["f"], total)
            bound.arguments["x"], bound.arguments["f"] = finite, f_eff
            out = fn(*bound.args, **bound.kwargs)
            return kept[out] if selects else out

        return wrapper

    return decorate


def unfiltered(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` without :func:`_robust`'s filter, for a caller that has dropped the non-finite rows already (the
    :class:`~lightning_zero.robust.aggregation.RobustAggregator`): the rows it passes are all finite, so the filter
    would only scan them again."""
    return getattr(fn, "__wrapped__", fn)


# --- parameter checks shared by the rules and check_rule ------------------------------------------------------------


def _check_positive_number(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner} got {name}={value!r}: expected a finite number > 0")


def _check_positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{owner} got {name}={value!r}: expected an integer >= 1")


# --- the rules ------------------------------------------------------------------------------------------------------


def mean(x: Tensor, f: int = 0) -> Tensor:
    """The plain average: the non-robust baseline.

    It tolerates no Byzantine worker and does *not* drop non-finite rows: a single NaN row makes the result NaN.
    ``f`` is accepted for a uniform signature and ignored (:func:`check_rule` warns when it is > 0).
    """
    _check_stack(x)
    return x.mean(dim=0)


def _middle(sorted_values: Tensor | list[Tensor]) -> Tensor:
    """Median of values sorted along dim 0 (a tensor, or its rows): the middle one, or the average of the two middle
    ones for even n."""
    n = len(sorted_values)
    lo, hi = sorted_values[(n - 1) // 2], sorted_values[n // 2]
    # 0.5*lo + 0.5*hi rather than (lo+hi)/2: the sum can overflow in fp16; halving is exact, so equal rows stay exact
    return lo * 0.5 + hi * 0.5


def _half_sum(middle: list[Tensor], out: Tensor) -> None:
    """:func:`_middle` of the one or two middle values of columns, in any order, into ``out``: ``0.5 * a + 0.5 * b``
    as there (halving is exact, so the order of ``a`` and ``b`` does not matter)."""
    torch.mul(middle[0], 0.5, out=out).add_(middle[-1], alpha=0.5)


SORTING_NETWORK_MAX_ROWS = 64
"""Up to this many rows, :func:`_sorted_columns` selects with a comparator network, else sorts with ``torch.sort``."""
COLUMN_BLOCK = 1 << 15
"""Columns selected at once by :func:`_sorted_columns`: ``n x 32768`` values, cache-sized for the usual ``n``."""


@functools.cache
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """The comparators ``(i, j)``, ``i < j``, of Batcher's odd-even merge sort of ``n`` values, in order: after
    ``x[i], x[j] = min(x[i], x[j]), max(x[i], x[j])`` for each, ``x`` is sorted (19 comparators for ``n = 8``)."""
    pairs = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            for j in range(k % p, n - k, 2 * k):
                for i in range(min(k, n - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


@functools.cache
def selection_network(n: int, lo: int, hi: int) -> tuple[tuple[int, int, bool, bool], ...]:
    """The part of :func:`sorting_network` that leaves positions ``lo .. hi-1`` holding the ``lo``-th to ``(hi-1)``-th
    smallest of ``n`` values, in some order: ``(i, j, low, high)`` means ``x[i] = min(x[i], x[j])`` if ``low`` and
    ``x[j] = max(x[i], x[j])`` if ``high``, both from the values before.

    Pruned backwards from the end of the sorting network: a comparator whose outputs are both discarded (outside
    ``lo .. hi-1`` and not compared again) is dropped, as is one whose outputs both land in ``lo .. hi-1`` untouched
    afterwards (it would only order values that are summed); of one output discarded, only the other is computed.
    For ``n = 8``: 26 of the 38 min/max for the median, 32 for the trimmed mean with ``f = 2``.
    """
    if not 0 <= lo < hi <= n:
        raise ValueError(f"positions [{lo}, {hi}) are not a non-empty range of n={n} sorted values")
    # what a position's value is still needed for, going backwards: compared later, kept as it is, or discarded
    compared, kept, discarded = 0, 1, 2
    need = [kept if lo <= p < hi else discarded for p in range(n)]
    comparators = []
    for i, j in reversed(sorting_network(n)):
        if need[i] == need[j] != compared:
            continue
        comparators.append((i, j, need[i] != discarded, need[j] != discarded))
        need[i] = need[j] = compared
    return tuple(reversed(comparators))


def _sorted_columns(x: Tensor, lo: int, hi: int, reduce: Callable[[list[Tensor], Tensor], object]) -> Tensor:
    """``reduce`` of every column's ``lo``-th to ``(hi-1)``-th smallest values, as one ``(d,)`` vector: ``reduce``
    takes those ``hi - lo`` rows of a block of columns (in no particular order) and writes that block's result into
    its second argument.

    Column block by column block (:data:`COLUMN_BLOCK`), so the transient memory is ``n + 2`` blocks, not a sorted
    copy of ``x`` and its int64 indices as ``torch.sort(x, dim=0)`` makes. Up to :data:`SORTING_NETWORK_MAX_ROWS` rows
    the block goes through :func:`selection_network` with elementwise min/max into reused block buffers (the median of
    8 rows of 13.7M columns: 131 ms on one CPU thread, ``torch.sort`` along dim 0 1569 ms); the values are the same,
    finite inputs assumed (a NaN would spread through min/max: the robust rules drop non-finite rows first).
    """
    n, d = x.shape
    out = x.new_empty(d)
    comparators = selection_network(n, lo, hi) if n <= SORTING_NETWORK_MAX_ROWS else None
    buffers = [x.new_empty(min(d, COLUMN_BLOCK)) for _ in range(n + 2)] if comparators else []
    for start in range(0, d, COLUMN_BLOCK):
        block = x[:, start : start + COLUMN_BLOCK]
        if comparators is None:
            rows = list(torch.sort(block, dim=0).values[lo:hi])
        else:
            width = block.shape[1]
            free = buffers if width == COLUMN_BLOCK else [b[:width] for b in buffers]
            rows = _select(list(block), comparators, list(free))[lo:hi]
        reduce(rows, out[start : start + COLUMN_BLOCK])
    return out


def _select(
    rows: list[Tensor], comparators: tuple[tuple[int, int, bool, bool], ...], free: list[Tensor]
) -> list[Tensor]:
    """``rows`` (views of ``x``, never written) through ``comparators``, every min/max written into a buffer taken
    from ``free`` and a row's previous buffer given back once it is replaced."""
    owned: list[Tensor | None] = [None] * len(rows)
    for i, j, low, high in comparators:
        a, b = rows[i], rows[j]
        replaced = []
        if low:
            rows[i] = torch.minimum(a, b, out=free.pop())
            replaced.append(owned[i])
            owned[i] = rows[i]
        if high:
            rows[j] = torch.maximum(a, b, out=free.pop())
            replaced.append(owned[j])
            owned[j] = rows[j]
        free.extend(t for t in replaced if t is not None)
    return rows


@_robust()
def median(x: Tensor, f: int = 0) -> Tensor:
    """Coordinate-wise median.

    For an even number of rows it is the average of the two middle values (numpy's convention, and
    ``torch.quantile(q=0.5)``'s), not ``torch.median``'s lower one: the average is symmetric,
    ``median(-x) == -median(x)``, and does not favour the smaller side. ``f`` only sets how many dropped non-finite
    rows are forgiven; the median itself has no parameter.
    """
    n = x.shape[0]
    return _sorted_columns(x, (n - 1) // 2, n // 2 + 1, _half_sum)


@_robust()
def trimmed_mean(x: Tensor, f: int) -> Tensor:
    """Coordinate-wise trimmed mean: per coordinate drop the ``f`` largest and ``f`` smallest values, average the rest.

    ``f = 0`` is exactly :func:`mean` (of the finite rows). Needs ``n >= 2f + 1``.
    """
    n = x.shape[0]
    if f == 0:
        return x.mean(dim=0)
    if n - 2 * f < 1:
        raise ValueError(f"trimmed_mean with n={n}, f={f} has nothing left: it needs n >= 2f+1 = {2 * f + 1}")
    return _sorted_columns(x, f, n - f, lambda rows, out: _sum_into(rows, out).div_(n - 2 * f))


def _pairwise_sq_dists(x: Tensor, total: Total = whole) -> Tensor:
    """Exact ``(n, n)`` squared Euclidean distances, accumulated in at least float32 (the coordinates held here summed,
    then ``total``).

    Pair by pair as ``((x_i - x_j) ** 2).sum()``: ``torch.cdist`` and the ``|a|^2 + |b|^2 - 2ab`` form lose the small
    distances between close honest vectors to cancellation, and those are exactly what Krum ranks. Column block by
    column block (:data:`COLUMN_BLOCK`): the differences stay cache-sized (measured ~6x faster than whole rows for 8
    rows of 13.7M columns on one CPU thread), and the transient memory is ``n`` blocks.
    """
    n = x.shape[0]
    dtype = _acc_dtype(x)
    dist = torch.zeros(n, n, dtype=dtype, device=x.device)
    for lo in range(0, x.shape[1], COLUMN_BLOCK):
        block = x[:, lo : lo + COLUMN_BLOCK].to(dtype)
        for i in range(n - 1):
            row = (block[i + 1 :] - block[i]).square().sum(dim=1)
            dist[i, i + 1 :] += row
            dist[i + 1 :, i] += row
    return total(dist)


def _row_norms(x: Tensor, total: Total = whole) -> Tensor:
    """The L2 norm of every row of ``x`` (already in the accumulation dtype), over every coordinate."""
    return total(x.square().sum(dim=1)).sqrt()


def _krum_scores_from(dist: Tensor, f: int) -> Tensor:
    """Krum scores from squared distances: sum over the ``n - f - 2`` nearest *other* vectors."""
    n = dist.shape[0]
    k = n - f - 2
    if k <= 0:
        return torch.zeros(n, dtype=dist.dtype, device=dist.device)
    # the diagonal (a vector's distance to itself) must never count as a neighbour
    off_diagonal = dist + torch.diag(torch.full((n,), math.inf, dtype=dist.dtype, device=dist.device))
    return torch.sort(off_diagonal, dim=1).values[:, :k].sum(dim=1)


@_robust()
def krum_scores(x: Tensor, f: int, total: Total = whole) -> Tensor:
    """Krum scores (Blanchard et al., 2017): ``score_i`` = sum of squared distances from ``x_i`` to its ``n - f - 2``
    nearest other vectors; 0 for every row when ``n - f - 2 <= 0``.

    Scores are computed on the finite rows with the lowered ``f`` (one per finite row, in their order); use
    :func:`krum_select` for indices in the caller's numbering.
    """
    return _krum_scores_from(_pairwise_sq_dists(x, total), f)


def _krum_order(x: Tensor, f: int, total: Total) -> Tensor:
    """Row indices by increasing Krum score; ties go to the lower index."""
    return torch.sort(_krum_scores_from(_pairwise_sq_dists(x, total), f), stable=True).indices


def _resolve_m(x: Tensor, f: int, m: int | None) -> int:
    if m is None:
        return max(x.shape[0] - f, 1)
    _check_positive_int("krum", "m", m)
    # m <= n - f is check_rule's job; here m can only exceed the rows left when more than f rows were non-finite
    return min(int(m), x.shape[0])


@_robust(selects=True)
def krum_select(x: Tensor, f: int, m: int = 1, total: Total = whole) -> Tensor:
    """Indices (LongTensor ``(m,)``) of the ``m`` rows with the lowest Krum scores, best first; ties go to the lower
    index. Indices are in the caller's numbering, never a non-finite row.

    When more than ``f`` rows were non-finite, fewer than ``m`` finite rows may be left: ``m`` is then lowered to
    their number (:func:`check_rule` has already rejected ``m > n - f``).
    """
    return _krum_order(x, f, total)[: _resolve_m(x, f, m)]


@_robust()
def krum(x: Tensor, f: int, total: Total = whole) -> Tensor:
    """Krum (Blanchard et al., 2017): the vector with the lowest Krum score (see :func:`krum_scores`)."""
    return _first_pick(x, _krum_order(x, f, total), f)


def _first_pick(x: Tensor, picks: Tensor, f: int) -> Tensor:
    """Krum's vector from its picks."""
    return x[picks[0]].clone()


def _mean_of_picks(x: Tensor, picks: Tensor, f: int) -> Tensor:
    """Multi-Krum's vector from its picks."""
    return x[picks].mean(dim=0)


@_robust(selects=True)
def multi_krum_select(x: Tensor, f: int, m: int | None = None, total: Total = whole) -> Tensor:
    """Indices of the ``m`` rows :func:`multi_krum` averages (default ``m = n - f``), in the caller's numbering."""
    return _krum_order(x, f, total)[: _resolve_m(x, f, m)]


@_robust()
def multi_krum(x: Tensor, f: int, m: int | None = None, total: Total = whole) -> Tensor:
    """Multi-Krum: the MEAN (not the sum) of the ``m`` rows with the lowest Krum scores; default ``m = n - f``.

    ``m = 1`` is :func:`krum`; ``m = n`` with ``f = 0`` is :func:`mean`.
    """
    return _mean_of_picks(x, _krum_order(x, f, total)[: _resolve_m(x, f, m)], f)


@_robust()
def geometric_median(x: Tensor, f: int = 0, *, nu: float = 0.1, iterations: int = 3, total: Total = whole) -> Tensor:
    """Approximate geometric median by smoothed Weiszfeld iterations (as ByzFL's ``GeometricMedian``).

    ``z <- sum_i w_i x_i / sum_i w_i`` with ``w_i = 1 / max(nu, ||z - x_i||)``, ``iterations`` times, starting at
    ZERO rather than at the mean: from zero a far outlier is far and gets a tiny weight in the very first step,
    whereas the mean is already dragged towards it and the few iterations would start from a spoiled point. ``nu > 0``
    keeps a weight finite when ``z`` lands on a row. ``f`` only forgives dropped non-finite rows.
    """
    _check_positive_number("geometric_median", "nu", nu)
    _check_positive_int("geometric_median", "iterations", iterations)
    acc = x.to(_acc_dtype(x))
    z = torch.zeros_like(acc[0])
    for _ in range(iterations):
        distances = _row_norms(acc - z, total)
        weights = 1.0 / distances.clamp_min(nu)
        z = (weights / weights.sum()) @ acc
    return z.to(x.dtype)


@_robust()
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
    :func:`check_rule`.
    """
    _check_positive_number("centered_clipping", "tau", tau)
    _check_positive_int("centered_clipping", "iterations", iterations)
    acc = x.to(_acc_dtype(x))
    if center is None:
        v = torch.zeros_like(acc[0])
    else:
        if tuple(center.shape) != (x.shape[1],):
            raise ValueError(f"center has shape {tuple(center.shape)}: expected ({x.shape[1]},), one value per column")
        v = center.to(dtype=acc.dtype, device=acc.device)
    for _ in range(iterations):
        diff = acc - v
        norms = _row_norms(diff, total)
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
    dist = _pairwise_sq_dists(x, total)  # computed once; each round re-scores the remaining rows
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


@_robust(selects=True)
def bulyan_select(x: Tensor, f: int, total: Total = whole) -> Tensor:
    """Indices (``(theta,)``, ``theta = n - 2f``) of the rows Bulyan's iterated Krum picks, in picking order and the
    caller's numbering."""
    return _bulyan_pick(x, f, total)


@_robust()
def bulyan(x: Tensor, f: int, total: Total = whole) -> Tensor:
    """Bulyan (El Mhamdi et al., 2018) on top of Krum.

    1. pick ``theta = n - 2f`` rows by iterated Krum: Krum with the same ``f`` on the remaining rows, remove the
       winner, repeat (ties go to the better Krum score on all rows, then to the lower index);
    2. per coordinate, average the ``beta = theta - 2f`` values of the picked rows closest to their coordinate-wise
       median (:func:`median`'s even-n convention; equal distances go to the lower row index).

    Needs ``n >= 4f + 3``.
    """
    return _bulyan_average(x, _bulyan_pick(x, f, total), f)


def _bulyan_average(x: Tensor, picks: Tensor, f: int) -> Tensor:
    """Bulyan's coordinate-wise stage (2.) on the rows its iterated Krum picked."""
    _, beta = _bulyan_sizes(x.shape[0], f)
    # ascending row order, so that equal distances to the median go to the lower original index
    chosen = x[torch.sort(picks).values]
    center = _middle(torch.sort(chosen, dim=0).values)
    closest = torch.sort((chosen - center).abs(), dim=0, stable=True).indices[:beta]
    return torch.gather(chosen, 0, closest).mean(dim=0)


# --- registry and checks --------------------------------------------------------------------------------------------


def _krum_pick(x: Tensor, f: int, total: Total = whole) -> Tensor:
    """Krum's single pick, as a selection: ``krum_select(x, f, m=1)``."""
    return krum_select(x, f, m=1, total=total)


@dataclass(frozen=True)
class RuleSpec:
    """A rule of :data:`RULES` and what the strategy needs to know about it."""

    fn: Callable[..., Tensor]
    """``fn(x, f, **params) -> (d,)``; ``centered_clipping`` also takes ``center``, those with :attr:`totals`
    ``total``."""
    params: tuple[str, ...]
    """The keyword parameters a user may set."""
    select: Callable[..., Tensor] | None = None
    """``select(x, f, **params) -> LongTensor``: the rows the rule picks (Krum, Multi-Krum, Bulyan), else ``None``."""
    from_picks: Callable[[Tensor, Tensor, int], Tensor] | None = None
    """``from_picks(x, select(x, f, ...), f)`` is ``fn(x, f, ...)``: a caller that needs the picks too computes the
    distances once."""
    stateful: bool = False
    """Whether the rule takes the previous result as ``center`` (centered clipping)."""
    robust: bool = True
    """False only for ``mean``, which neither tolerates Byzantine workers nor drops non-finite rows."""
    totals: bool = False
    """Whether ``fn`` and ``select`` sum over every coordinate (distances, norms) and so take ``total``; the others are
    coordinate-wise."""


RULES: dict[str, RuleSpec] = {
    "mean": RuleSpec(mean, (), robust=False),
    "median": RuleSpec(median, ()),
    "trimmed_mean": RuleSpec(trimmed_mean, ()),
    "krum": RuleSpec(krum, (), select=_krum_pick, from_picks=_first_pick, totals=True),
    "multi_krum": RuleSpec(multi_krum, ("m",), select=multi_krum_select, from_picks=_mean_of_picks, totals=True),
    "geometric_median": RuleSpec(geometric_median, ("nu", "iterations"), totals=True),
    "centered_clipping": RuleSpec(centered_clipping, ("tau", "iterations"), stateful=True, totals=True),
    "bulyan": RuleSpec(bulyan, (), select=bulyan_select, from_picks=_bulyan_average, totals=True),
}
"""Every rule by name."""

# (who, bound as text, bound(f)) of the rules that tolerate f Byzantine workers
_TOLERANCE: dict[str, tuple[str, str, Callable[[int], int]]] = {
    "median": ("the coordinate-wise median", "2f+1", lambda f: 2 * f + 1),
    "trimmed_mean": ("the trimmed mean", "2f+1", lambda f: 2 * f + 1),
    "krum": ("Krum", "2f+3", lambda f: 2 * f + 3),
    "multi_krum": ("Multi-Krum", "2f+3", lambda f: 2 * f + 3),
    "geometric_median": ("the geometric median", "2f+1", lambda f: 2 * f + 1),
    "centered_clipping": ("centered clipping", "2f+1", lambda f: 2 * f + 1),
    "bulyan": ("Bulyan", "4f+3", lambda f: 4 * f + 3),
}


def check_known(kind: str, name: str, kwargs: Any, registry: dict[str, Any]) -> str:
    """``name`` is in ``registry`` and ``kwargs`` are among its ``params``; returns ``"<kind>='<name>'"`` for messages.

    Shared by the rules, the pre-aggregators and the attacks (their specs all carry ``params``).
    """
    if name not in registry:
        raise ValueError(f"{kind}={name!r} is invalid: expected one of {list(registry)}")
    owner = f"{kind}={name!r}"
    params = registry[name].params
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        allowed = f"expected some of {list(params)}" if params else "it takes no parameters"
        raise ValueError(f"{owner} got unknown parameters {unknown}: {allowed}")
    return owner


def check_n(owner: str, n: Any) -> None:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"{owner} with n={n!r} is invalid: expected at least 1 worker")


def check_n_f(owner: str, n: Any, f: Any) -> None:
    check_n(owner, n)
    if isinstance(f, bool) or not isinstance(f, numbers.Integral) or f < 0:
        raise ValueError(f"{owner} with f={f!r} is invalid: expected an integer >= 0")


def check_rule(rule: str, n: int, f: int, **kwargs: Any) -> None:
    """Check that ``rule`` with ``kwargs`` can aggregate ``n`` worker vectors of which ``f`` may be Byzantine.

    Tolerance bounds: median, geometric median and centered clipping need ``n > 2f``; the trimmed mean
    ``n >= 2f+1``; Krum and Multi-Krum ``n >= 2f+3`` (and ``1 <= m <= n-f``); Bulyan ``n >= 4f+3``. ``f`` is never
    lowered to make a configuration fit. ``mean`` with ``f > 0`` only warns: it is the unprotected baseline.

    Raises:
        ValueError: unknown rule or parameter, bad parameter value, ``n < 1``, ``f < 0``, or a bound not met (the
            message names the rule, ``n``, ``f`` and the bound).
    """
    owner = check_known("aggregator", rule, kwargs, RULES)
    check_n_f(owner, n, f)

    for name in ("nu", "tau"):
        if name in kwargs:
            _check_positive_number(owner, name, kwargs[name])
    if "iterations" in kwargs:
        _check_positive_int(owner, "iterations", kwargs["iterations"])

    if rule == "mean":
        if f > 0:
            warnings.warn(
                f"{owner} with f={f}: the mean tolerates no Byzantine worker (one bad vector moves it arbitrarily); "
                "it is the unprotected baseline",
                UserWarning,
                stacklevel=2,
            )
        return
    who, text, bound = _TOLERANCE[rule]
    if n < bound(f):
        raise ValueError(f"{owner} with n={n}, f={f} is invalid: {who} needs n >= {text} = {bound(f)}")
    if rule == "multi_krum" and kwargs.get("m") is not None:
        m = kwargs["m"]
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or not 1 <= m <= n - f:
            raise ValueError(f"{owner} with n={n}, f={f} got m={m!r}: expected an integer in [1, n-f] = [1, {n - f}]")
