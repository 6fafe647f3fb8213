"""Coordinate-wise order statistics: the median and the trimmed mean, and the comparator networks that select
a column's middle values without sorting the whole stack.

For the usual few rows, Batcher's odd-even merge sort (:func:`sorting_network`), pruned to the positions a rule keeps
(:func:`selection_network`), runs as elementwise min/max over blocks of columns; above
:data:`SORTING_NETWORK_MAX_ROWS` rows ``torch.sort`` does. The conventions are those of
:mod:`lightning_zero.robust.aggregators`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_zero.robust.stack import COLUMN_BLOCK, robust_rule, sum_into


def middle(sorted_values: Tensor | list[Tensor]) -> Tensor:
    """Median of values sorted along dim 0 (a tensor, or its rows): the middle one, or the average of the two middle
    ones for even n."""
    n = len(sorted_values)
    lo, hi = sorted_values[(n - 1) // 2], sorted_values[n // 2]
    # 0.5*lo + 0.5*hi rather than (lo+hi)/2: the sum can overflow in fp16; halving is exact, so equal rows stay exact
    return lo * 0.5 + hi * 0.5


def _half_sum(middle: list[Tensor], out: Tensor) -> None:
    """:func:`middle` of the one or two middle values of columns, in any order, into ``out``: ``0.5 * a + 0.5 * b``
    as there (halving is exact, so the order of ``a`` and ``b`` does not matter)."""
    torch.mul(middle[0], 0.5, out=out).add_(middle[-1], alpha=0.5)


SORTING_NETWORK_MAX_ROWS = 64
"""Up to this many rows, :func:`_sorted_columns` selects with a comparator network, else sorts with ``torch.sort``."""


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

    Column block by column block (:data:`~lightning_zero.robust.stack.COLUMN_BLOCK`), so the transient memory is ``n
    + 2`` blocks, not a sorted copy of ``x`` and its int64 indices as ``torch.sort(x, dim=0)`` makes. Up to
    :data:`SORTING_NETWORK_MAX_ROWS` rows the block goes through :func:`selection_network` with elementwise min/max
    into reused block buffers (the median of 8 rows of 13.7M columns: 131 ms on one CPU thread, ``torch.sort`` along
    dim 0 1569 ms); the values are the same, finite inputs assumed (a NaN would spread through min/max: the robust
    rules drop non-finite rows first).
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


@robust_rule()
def median(x: Tensor, f: int = 0) -> Tensor:
    """Coordinate-wise median.

    For an even number of rows it is the average of the two middle values (numpy's convention, and
    ``torch.quantile(q=0.5)``'s), not ``torch.median``'s lower one: the average is symmetric,
    ``median(-x) == -median(x)``, and does not favour the smaller side. ``f`` only sets how many dropped non-finite
    rows are forgiven; the median itself has no parameter.
    """
    n = x.shape[0]
    return _sorted_columns(x, (n - 1) // 2, n // 2 + 1, _half_sum)


@robust_rule()
def trimmed_mean(x: Tensor, f: int) -> Tensor:
    """Coordinate-wise trimmed mean: per coordinate drop the ``f`` largest and ``f`` smallest values, average the rest.

    ``f = 0`` is exactly :func:`~lightning_zero.robust.aggregators.mean` (of the finite rows). Needs ``n >= 2f + 1``.
    """
    n = x.shape[0]
    if f == 0:
        return x.mean(dim=0)
    if n - 2 * f < 1:
        raise ValueError(f"trimmed_mean with n={n}, f={f} has nothing left: it needs n >= 2f+1 = {2 * f + 1}")
    return _sorted_columns(x, f, n - f, lambda rows, out: sum_into(rows, out).div_(n - 2 * f))
