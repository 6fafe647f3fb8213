"""Pure pre-aggregators: ``(n, d)`` worker vectors in, ``(n', d)`` out, composed in front of any robust rule.

Nothing here touches torch.distributed or Lightning (tests: ``tests/robust/test_preaggregators.py``, cross-checked
against ByzFL in ``tests/robust/test_byzfl_crosscheck.py``).

Runbook::

    n, f = check_pre_aggregator("bucketing", 8, 2, s=2)   # -> (4, 2): what the next stage sees
    stack = nnm(stack, f)                                 # (n, d) -> (n, d)
    stack = bucketing(stack, 2, generator=gen)            # (n, d) -> (ceil(n / 2), d)
    vector = RULES["trimmed_mean"].fn(stack, f)

These functions do NOT drop non-finite rows themselves: the caller drops them (and lowers ``f``) with
:func:`~lightning_zero.robust.stack.drop_nonfinite` before the first pre-aggregator, because a NaN row mixed
into others (``nnm``, ``bucketing``) would spoil honest rows. ``x`` is never modified; the result has its dtype and
device; distances and norms are accumulated in at least float32. ``nnm`` and ``clip`` take ``total`` to run on a column
shard (see :mod:`~lightning_zero.robust.aggregators`); ``bucketing`` is coordinate-wise.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_zero.robust.stack import (
    Total,
    acc_dtype,
    check_f,
    check_known,
    check_n_f,
    check_stack,
    pairwise_sq_dists,
    row_norms,
    whole,
)


def _check_s(owner: str, s: Any) -> None:
    if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1:
        raise ValueError(f"{owner} got s={s!r}: expected an integer bucket size >= 1")


def _check_c(owner: str, c: Any) -> None:
    if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c) or c <= 0:
        raise ValueError(f"{owner} got c={c!r}: expected a finite norm bound > 0")


def nnm(x: Tensor, f: int, total: Total = whole) -> Tensor:
    """Nearest-neighbour mixing (Allouah et al., 2023): each row becomes the mean of its ``n - f`` nearest rows.

    A row counts as its own neighbour (distance 0); equal distances go to the lower row index. Distances are exact
    squared Euclidean ones (see :func:`~lightning_zero.robust.distance_rules.krum_scores`). ``f = 0`` turns every row
    into the overall mean. Needs ``n > 2f`` (:func:`check_pre_aggregator`).
    """
    check_stack(x)
    check_f(f)
    n = x.shape[0]
    k = n - f
    if k < 1:
        raise ValueError(f"nnm with n={n}, f={f} has no neighbour to mix: it needs n >= 2f+1 = {2 * f + 1}")
    neighbours = torch.sort(pairwise_sq_dists(x, total), dim=1, stable=True).indices[:, :k]
    # a (n, n) mixing matrix rather than x[neighbours].mean(1): that would materialise n * k copies of d
    acc = acc_dtype(x)
    mixing = torch.zeros(n, n, dtype=acc, device=x.device)
    mixing.scatter_(1, neighbours, 1.0 / k)
    return (mixing @ x.to(acc)).to(x.dtype)


def bucketing(x: Tensor, s: int, *, generator: torch.Generator) -> Tensor:
    """Bucketing (Karimireddy et al., 2022): shuffle the rows, then average consecutive groups of ``s``.

    The permutation comes from ``generator`` only (every rank advancing the same generator gets the same buckets).
    Returns ``ceil(n / s)`` rows; the last bucket holds the ``n mod s`` leftover rows when ``s`` does not divide ``n``.
    ``s = 1`` only permutes the rows. Each Byzantine row spoils at most one bucket, so the next stage still sees at
    most ``f`` bad rows, among fewer and less noisy ones.
    """
    check_stack(x)
    _check_s("bucketing", s)
    n, d = x.shape
    perm = torch.randperm(n, generator=generator, device=generator.device).to(x.device)
    shuffled = x[perm]
    full = n // s
    out = shuffled[: full * s].reshape(full, s, d).mean(dim=1)
    if full * s < n:
        out = torch.cat([out, shuffled[full * s :].mean(dim=0, keepdim=True)])
    return out


def clip(x: Tensor, c: float, total: Total = whole) -> Tensor:
    """Scale every row with norm above ``c`` down to norm ``c``; rows with norm ``<= c`` are returned unchanged."""
    check_stack(x)
    _check_c("clip", c)
    norms = row_norms(x.to(acc_dtype(x)), total)
    scale = torch.where(norms > c, c / norms, torch.ones_like(norms))
    return x * scale.to(x.dtype)[:, None]


@dataclass(frozen=True)
class PreSpec:
    """A pre-aggregator of :data:`PRE_AGGREGATORS`."""

    fn: Callable[..., Tensor]
    """``nnm(x, f)``, ``bucketing(x, s=..., generator=...)``, ``clip(x, c=...)``."""
    params: tuple[str, ...]
    """The keyword parameters a user may set."""
    preserves_rows: bool
    """Whether output row ``i`` still stands for worker ``i`` (so a selection rule's picks name workers)."""
    needs_generator: bool
    """Whether ``fn`` takes a ``generator`` keyword."""
    needs_f: bool = False
    """Whether ``fn`` takes ``f`` (after the non-finite filter) as its second argument."""
    totals: bool = False
    """Whether ``fn`` sums over every coordinate and so takes ``total``."""


PRE_AGGREGATORS: dict[str, PreSpec] = {
    "nnm": PreSpec(nnm, (), preserves_rows=True, needs_generator=False, needs_f=True, totals=True),
    "bucketing": PreSpec(bucketing, ("s",), preserves_rows=False, needs_generator=True),
    "clip": PreSpec(clip, ("c",), preserves_rows=True, needs_generator=False, totals=True),
}
"""Every pre-aggregator by name."""


def check_pre_aggregator(name: str, n: int, f: int, **kwargs: Any) -> tuple[int, int]:
    """Check a pre-aggregator on ``n`` rows of which ``f`` may be Byzantine; return the ``(n, f)`` the next stage sees.

    ``nnm`` needs ``n > 2f`` and keeps ``(n, f)``; ``bucketing`` needs an integer ``s >= 1`` and hands on
    ``(ceil(n / s), f)`` (each Byzantine row spoils at most one bucket); ``clip`` needs ``c > 0`` and keeps ``(n, f)``.

    Raises:
        ValueError: unknown name or parameter, a missing or bad parameter, ``n < 1``, ``f < 0``, or a bound not met.
    """
    owner = check_known("pre_aggregator", name, kwargs, PRE_AGGREGATORS)
    check_n_f(owner, n, f)
    if name == "nnm":
        if n < 2 * f + 1:
            raise ValueError(f"{owner} with n={n}, f={f} is invalid: NNM needs n >= 2f+1 = {2 * f + 1}")
        return n, f
    if name == "bucketing":
        if "s" not in kwargs:
            raise ValueError(
                f"{owner} needs s, the bucket size (an integer >= 1), e.g. {{'name': 'bucketing', 's': 2}}"
            )
        _check_s(owner, kwargs["s"])
        return math.ceil(n / kwargs["s"]), f
    if "c" not in kwargs:
        raise ValueError(f"{owner} needs c, the norm bound (> 0), e.g. {{'name': 'clip', 'c': 1.0}}")
    _check_c(owner, kwargs["c"])
    return n, f
