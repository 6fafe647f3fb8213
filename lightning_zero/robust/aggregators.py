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
  :func:`~lightning_zero.robust.stack.drop_nonfinite` and lowers ``f`` by as many, and selection rules report rows
  in the *original* numbering.
  :func:`mean` is the unprotected baseline and does not filter: one NaN row poisons it, which is the point.
* Rules that need sums over all coordinates (distances, norms) take ``total``, which turns sums over the coordinates
  held here into sums over every coordinate; the default, :func:`~lightning_zero.robust.stack.whole`, is for a stack
  that holds them all. A rank holding a column shard passes one that adds every shard's partial sums
  (:class:`~lightning_zero.robust.shards.ColumnShard`, [Note: sharded aggregation]): everything else the rules do is
  coordinate-wise, so the same functions aggregate a shard.
* Where they live: the shared stack helpers in :mod:`~lightning_zero.robust.stack`, the coordinate-wise order
  statistics in :mod:`~lightning_zero.robust.order_statistics`, the distance- and norm-based rules in
  :mod:`~lightning_zero.robust.distance_rules`; here, :func:`mean`, the registry :data:`RULES` and
  :func:`check_rule`.
* The rules do not enforce the tolerance bounds (``n > 2f``, ``n >= 2f+3``, ``n >= 4f+3``): :func:`check_rule`
  does, once, before training, and never lowers ``f`` silently.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_zero.robust.distance_rules import (
    bulyan,
    bulyan_from_picks,
    bulyan_select,
    centered_clipping,
    geometric_median,
    krum,
    krum_from_picks,
    krum_pick,
    multi_krum,
    multi_krum_from_picks,
    multi_krum_select,
)
from lightning_zero.robust.order_statistics import median, trimmed_mean
from lightning_zero.robust.stack import check_known, check_n_f, check_positive_int, check_positive_number, check_stack


def mean(x: Tensor, f: int = 0) -> Tensor:
    """The plain average: the non-robust baseline.

    It tolerates no Byzantine worker and does *not* drop non-finite rows: a single NaN row makes the result NaN.
    ``f`` is accepted for a uniform signature and ignored (:func:`check_rule` warns when it is > 0).
    """
    check_stack(x)
    return x.mean(dim=0)


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
    "krum": RuleSpec(krum, (), select=krum_pick, from_picks=krum_from_picks, totals=True),
    "multi_krum": RuleSpec(multi_krum, ("m",), select=multi_krum_select, from_picks=multi_krum_from_picks, totals=True),
    "geometric_median": RuleSpec(geometric_median, ("nu", "iterations"), totals=True),
    "centered_clipping": RuleSpec(centered_clipping, ("tau", "iterations"), stateful=True, totals=True),
    "bulyan": RuleSpec(bulyan, (), select=bulyan_select, from_picks=bulyan_from_picks, totals=True),
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
            check_positive_number(owner, name, kwargs[name])
    if "iterations" in kwargs:
        check_positive_int(owner, "iterations", kwargs["iterations"])

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
