"""Attack SIMULATION, for evaluating robust rules: what Byzantine workers would send, computed from the honest ones.

This is not a defence and not something a real deployment runs: the strategy uses it to replace the vectors of
workers *designated* Byzantine (for experiments), so that a rule can be measured under attack. Omniscient attacks
(``alie``, ``ipm``, ``mimic``) see the honest vectors of the current step, as in the literature. Nothing here touches
torch.distributed or Lightning (tests: ``tests/robust/test_attacks.py``).

Runbook::

    check_attack("alie", n=8, byzantine=[6, 7], z=1.0)
    attacked = apply_attack("alie", stack, [6, 7], z=1.0)          # rows 6 and 7 replaced, the others untouched
    attacked = apply_attack("gaussian", stack, [6, 7], generator=gen, std=5.0)
    labels = flip_labels(labels, num_classes=10)                   # label_flip acts on the data, not on vectors

Notation: ``h`` is the mean of the honest rows (those not in ``byzantine``), ``sigma`` their coordinate-wise SAMPLE
standard deviation (``correction=1``, as ``torch.std``'s default in the reference ALIE implementations and ByzFL's
``ALittleIsEnough``; 0 when a single honest row is left).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import torch
from torch import Tensor

from lightning_zero.robust.stack import acc_dtype, check_known, check_n, check_stack, mean_of_rows

Columns = tuple[tuple[tuple[int, int], ...], int]
"""``(ranges, width)``: the columns of ``width``-wide vectors a column shard holds."""


def alie_textbook_z(n: int, f: int) -> float:
    """The ``z`` of "A Little Is Enough" (Baruch et al., 2019): ``Phi^-1((n - f - s) / (n - f))`` with
    ``s = floor(n/2 + 1) - f`` (the honest "supporters" the attackers need).

    Note it is 0.0 for n=8, f=2: there the textbook ``z`` puts the Byzantine rows on the honest mean, which is no
    attack at all. That is why :func:`apply_attack` requires ``z`` explicitly rather than defaulting to this.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n={n!r} is invalid: expected at least 1 worker")
    if isinstance(f, bool) or not isinstance(f, numbers.Integral) or not 0 <= f < n:
        raise ValueError(f"f={f!r} is invalid for n={n}: expected an integer in [0, n-1] = [0, {n - 1}]")
    s = math.floor(n / 2 + 1) - f
    p = (n - f - s) / (n - f)
    if not 0.0 < p < 1.0:
        raise ValueError(
            f"alie_textbook_z(n={n}, f={f}) is undefined: s=floor(n/2+1)-f={s} gives the quantile (n-f-s)/(n-f)={p}, "
            "outside (0, 1)"
        )
    return NormalDist().inv_cdf(p)


def flip_labels(y: Tensor, num_classes: int) -> Tensor:
    """The ``label_flip`` attack on the data: class ``c`` becomes ``num_classes - 1 - c`` (a new tensor)."""
    _check_num_classes("flip_labels", num_classes)
    if y.numel() > 0 and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(
            f"flip_labels got labels in [{int(y.min())}, {int(y.max())}]: expected classes in "
            f"[0, num_classes-1] = [0, {num_classes - 1}]"
        )
    return num_classes - 1 - y


# --- the attacks: fn(x, byzantine, honest, generator, **params) -> (len(byzantine), d) ---------------------------


def _honest_std(x: Tensor, honest: list[int]) -> Tensor:
    if len(honest) < 2:  # one sample has no spread to hide in
        return torch.zeros_like(x[0])
    return x[honest].std(dim=0, correction=1)


def _sign_flip(x: Tensor, byzantine: list[int], honest: list[int], generator: Any, scale: float = 1.0) -> Tensor:
    return -scale * x[byzantine]


def _gaussian(
    x: Tensor,
    byzantine: list[int],
    honest: list[int],
    generator: Any,
    std: float = 1.0,
    columns: Columns | None = None,
) -> Tensor:
    if generator is None:
        raise ValueError("attack='gaussian' needs a torch.Generator: randomness comes only from an explicit generator")
    # On a column shard every rank draws the whole vectors and keeps its columns: the same draws in any layout.
    ranges, width = columns if columns is not None else (((0, x.shape[1]),), x.shape[1])
    draw = torch.randn((len(byzantine), width), generator=generator, dtype=acc_dtype(x), device=generator.device)
    kept = torch.cat([draw[:, lo:hi] for lo, hi in ranges], dim=1) if ranges else draw[:, :0]
    return (std * kept).to(dtype=x.dtype, device=x.device)


def alie_row(x: Tensor, honest: list[int], z: float) -> Tensor:
    """The row "A Little Is Enough" commits: the mean of ``x``'s ``honest`` rows minus ``z`` times their sample
    deviation per coordinate (none with one row). The simulated ``alie`` attack and the colluding ranks of
    ``byzantine_rank_behaviour="alie"`` (``lightning_zero/byzantine/behaviours.py``) both send it."""
    return mean_of_rows(x, honest) - z * _honest_std(x, honest)


def _alie(x: Tensor, byzantine: list[int], honest: list[int], generator: Any, z: float) -> Tensor:
    return alie_row(x, honest, z).expand(len(byzantine), -1)


def _ipm(x: Tensor, byzantine: list[int], honest: list[int], generator: Any, eps: float = 0.1) -> Tensor:
    return (-eps * mean_of_rows(x, honest)).expand(len(byzantine), -1)


def _mimic(x: Tensor, byzantine: list[int], honest: list[int], generator: Any, target: int | None = None) -> Tensor:
    return x[honest[0] if target is None else target].expand(len(byzantine), -1)


def _nan(x: Tensor, byzantine: list[int], honest: list[int], generator: Any) -> Tensor:
    return torch.full((len(byzantine), x.shape[1]), math.nan, dtype=x.dtype, device=x.device)


def _inf(x: Tensor, byzantine: list[int], honest: list[int], generator: Any) -> Tensor:
    return torch.full((len(byzantine), x.shape[1]), math.inf, dtype=x.dtype, device=x.device)


def _label_flip(x: Tensor, byzantine: list[int], honest: list[int], generator: Any, num_classes: int) -> Tensor:
    return x[byzantine]  # the attack already happened on the data (flip_labels): the vectors stay what they are


@dataclass(frozen=True)
class AttackSpec:
    """An attack of :data:`ATTACKS`."""

    fn: Callable[..., Tensor]
    """``fn(x, byzantine, honest, generator, **params) -> (len(byzantine), d)``; use :func:`apply_attack`."""
    params: tuple[str, ...]
    """The keyword parameters a user may set."""
    data_level: bool = False
    """Whether the attack acts on the training data (``label_flip``: see :func:`flip_labels`), not on the vectors."""
    draws: bool = False
    """Whether ``fn`` draws random vectors, and so takes ``columns`` to draw the same ones on a column shard."""


ATTACKS: dict[str, AttackSpec] = {
    "sign_flip": AttackSpec(_sign_flip, ("scale",)),
    "gaussian": AttackSpec(_gaussian, ("std",), draws=True),
    "alie": AttackSpec(_alie, ("z",)),
    "ipm": AttackSpec(_ipm, ("eps",)),
    "mimic": AttackSpec(_mimic, ("target",)),
    "nan": AttackSpec(_nan, ()),
    "inf": AttackSpec(_inf, ()),
    "label_flip": AttackSpec(_label_flip, ("num_classes",), data_level=True),
}
"""Every simulated attack by name:

* ``sign_flip(scale=1.0)``: each Byzantine row sends ``-scale`` times its own honest vector;
* ``gaussian(std=1.0)``: rows drawn from ``N(0, std^2)`` (needs a generator);
* ``alie(z)``: ``h - z * sigma`` (Baruch et al., 2019); ``z`` is required, see :func:`alie_textbook_z`;
* ``ipm(eps=0.1)``: ``-eps * h``, inner-product manipulation (Xie et al., 2020);
* ``mimic(target=None)``: a copy of honest row ``target`` (default: the lowest-index honest row);
* ``nan``, ``inf``: rows of NaN / +Inf (a crashed or overflowing worker);
* ``label_flip(num_classes)``: data-level, vectors unchanged; the data loader applies :func:`flip_labels`.
"""


def _check_num_classes(owner: str, num_classes: Any) -> None:
    if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral) or num_classes < 2:
        raise ValueError(f"{owner} got num_classes={num_classes!r}: expected an integer >= 2")


def _check_real(owner: str, name: str, value: Any, *, positive: bool) -> None:
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        raise ValueError(f"{owner} got {name}={value!r}: expected a finite number{' > 0' if positive else ''}")


def check_attack(name: str, n: int, byzantine: Sequence[int], **kwargs: Any) -> None:
    """Check an attack to simulate on ``n`` workers of which those in ``byzantine`` are Byzantine.

    Raises:
        ValueError: unknown attack or parameter; ``byzantine`` indices not unique, outside ``[0, n)`` or not leaving an
            honest worker; a missing required parameter (``alie``'s ``z``, ``label_flip``'s ``num_classes``) or a bad
            value (``scale``, ``std``, ``eps`` > 0; ``target`` an honest index).
    """
    owner = check_known("attack", name, kwargs, ATTACKS)
    check_n(owner, n)
    indices = list(byzantine)
    bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < n]
    if bad:
        raise ValueError(f"{owner} got byzantine workers {bad} outside [0, n-1] = [0, {n - 1}]")
    if len(set(indices)) != len(indices):
        raise ValueError(f"{owner} got repeated byzantine workers {indices}: expected unique indices")
    if len(indices) >= n:
        raise ValueError(
            f"{owner} with n={n} and {len(indices)} byzantine workers is invalid: at least one worker must be honest"
        )

    for param in ("scale", "std", "eps"):
        if param in kwargs:
            _check_real(owner, param, kwargs[param], positive=True)
    if name == "alie":
        if "z" not in kwargs:
            raise ValueError(
                f"{owner} needs z (how many honest standard deviations to shift by): no default, because "
                "alie_textbook_z(n, f) is 0.0 (no attack) at common sizes such as n=8, f=2"
            )
        _check_real(owner, "z", kwargs["z"], positive=False)
    if name == "label_flip":
        if "num_classes" not in kwargs:
            raise ValueError(f"{owner} needs num_classes (an integer >= 2)")
        _check_num_classes(owner, kwargs["num_classes"])
    if name == "mimic" and kwargs.get("target") is not None:
        target = kwargs["target"]
        honest = sorted(set(range(n)) - set(indices))
        if isinstance(target, bool) or not isinstance(target, numbers.Integral) or target not in honest:
            raise ValueError(f"{owner} got target={target!r}: expected an honest worker, one of {honest}")


def apply_attack(
    name: str,
    x: Tensor,
    byzantine: Sequence[int],
    *,
    generator: torch.Generator | None = None,
    columns: Columns | None = None,
    **kwargs: Any,
) -> Tensor:
    """Simulate attack ``name``: a new ``(n, d)`` tensor whose ``byzantine`` rows are replaced.

    The other rows are the honest vectors, unchanged; ``x`` itself is not modified. Parameters are checked with
    :func:`check_attack` first.

    Args:
        name: a key of :data:`ATTACKS`.
        x: ``(n, d)`` vectors, as the workers computed them honestly.
        byzantine: the rows to replace.
        generator: the only source of randomness (``gaussian`` needs one).
        columns: ``(ranges, width)`` when ``x`` holds the columns ``ranges`` (``(start, end)`` pairs, in ``x``'s order)
            of ``width``-wide vectors (a column shard): the coordinate-wise attacks need nothing more, ``gaussian``
            draws whole vectors and keeps these columns.
        kwargs: the attack's parameters.
    """
    check_stack(x)
    check_attack(name, x.shape[0], byzantine, **kwargs)
    out = x.clone()
    rows = list(byzantine)
    if not rows:
        return out
    chosen = set(rows)
    honest = [i for i in range(x.shape[0]) if i not in chosen]
    spec = ATTACKS[name]
    if spec.draws and columns is not None:
        kwargs = {**kwargs, "columns": columns}
    out[rows] = spec.fn(x, rows, honest, generator, **kwargs).to(x.dtype)
    return out
