"""PowerSGD's settings (:class:`PowerSGDConfig`, with torch's defaults), read from a strategy's ``grad_compression``
and ``powersgd`` arguments, checked before any process starts, and refused by the strategies that cannot compress.
The compressor itself is :class:`~lightning_zero.comm.powersgd.PowerSGDCompressor`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

GRAD_COMPRESSIONS = ("powersgd",)
"""The values of ``grad_compression`` besides ``None``."""


@dataclass(frozen=True)
class PowerSGDConfig:
    """PowerSGD's settings; the defaults are those of torch's ``PowerSGDState``.

    Args:
        rank: the approximation rank ``r`` of each compressed matrix (torch's ``matrix_approximation_rank``), >= 1.
        start_iter: synchronised passes all-reduced plainly before compression starts (torch's
            ``start_powerSGD_iter``), >= 0.
        min_compression_rate: a tensor is compressed only when ``(n + m) * r * min_compression_rate < n * m``, >= 0.
        warm_start: reuse each bucket's Q of the last step instead of drawing a random one every step.
        error_feedback: add what compression dropped on the last step back into the gradient.
        seed: seed of the ``numpy.random.RandomState`` behind the random Q's (torch's ``random_seed``), in
            ``[0, 2**32)``; the same on every rank.
        orthogonalization_epsilon: added to each column norm before dividing by it, >= 0.
    """

    rank: int = 1
    start_iter: int = 1000
    min_compression_rate: float = 2.0
    warm_start: bool = True
    error_feedback: bool = True
    seed: int = 0
    orthogonalization_epsilon: float = 0.0

    def __post_init__(self) -> None:
        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def number(value: Any) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        checks = [
            ("rank", integer(self.rank) and self.rank >= 1, "an integer >= 1"),
            ("start_iter", integer(self.start_iter) and self.start_iter >= 0, "an integer >= 0"),
            (
                "min_compression_rate",
                number(self.min_compression_rate) and self.min_compression_rate >= 0,
                "a number >= 0",
            ),
            ("warm_start", isinstance(self.warm_start, bool), "True or False"),
            ("error_feedback", isinstance(self.error_feedback, bool), "True or False"),
            ("seed", integer(self.seed) and 0 <= self.seed < 2**32, "an integer in [0, 2**32)"),
            (
                "orthogonalization_epsilon",
                number(self.orthogonalization_epsilon) and self.orthogonalization_epsilon >= 0,
                "a number >= 0",
            ),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"powersgd {name}={getattr(self, name)!r} is invalid: expected {allowed}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> PowerSGDConfig:
        """The config of a strategy's ``powersgd`` dict (``None``: the defaults); unknown keys raise naming them."""
        options = dict(options or {})
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"powersgd has unknown options {unknown}: expected some of {allowed}")
        return cls(**options)


def compression_config(
    grad_compression: Any, powersgd: Mapping[str, Any] | None, *, reduce_dtype: Any = "auto"
) -> PowerSGDConfig | None:
    """A strategy's ``grad_compression``/``powersgd`` arguments checked together (shared by the Trainer's and
    Fabric's ``ddp_scratch`` and the Hydra schema); ``None`` when there is no compression.

    ``reduce_dtype``: the strategy's parsed setting; PowerSGD communicates in the buckets' dtype, so only ``"auto"``
    (the default) and ``None`` go with it.
    """
    if grad_compression is not None and grad_compression not in GRAD_COMPRESSIONS:
        raise ValueError(
            f"grad_compression={grad_compression!r} is invalid: expected None or one of {GRAD_COMPRESSIONS}"
        )
    if powersgd is not None and not isinstance(powersgd, Mapping):
        raise ValueError(f"powersgd={powersgd!r} is invalid: expected None or a dict of PowerSGD options")
    if grad_compression is None:
        if powersgd:  # an empty dict (the Hydra schema's default) sets nothing
            raise ValueError(
                f"powersgd={dict(powersgd)!r} is set but grad_compression=None: pass grad_compression='powersgd' to"
                " compress, or drop the powersgd options"
            )
        return None
    if reduce_dtype not in ("auto", None):
        raise ValueError(
            f"reduce_dtype={reduce_dtype!r} cannot be combined with grad_compression={grad_compression!r}: PowerSGD"
            " communicates its low-rank factors in the gradient buckets' dtype; leave reduce_dtype='auto' (or None)"
        )
    return PowerSGDConfig.from_options(powersgd)


def refuse_on_zero(strategy_name: str, kwargs: dict[str, Any]) -> None:
    """Pop ``grad_compression``/``powersgd`` from a ZeRO strategy's arguments: ``None`` passes, anything else raises."""
    given = {k: kwargs.pop(k) for k in ("grad_compression", "powersgd") if k in kwargs}
    given = {k: v for k, v in given.items() if v is not None}
    if given:
        settings = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(
            f"{settings} is not supported by {strategy_name}: gradient compression applies to ddp_scratch only"
            " (ZeRO reduces into shards, and its checkpoints have no place for the compressor's per-rank state)"
        )
