"""Parameters whose ``requires_grad`` changes during a fit: noticed before each training step.

A gradient engine is built at setup over the parameters trainable then: its buckets, shards or aggregation rows
cover those and no others. A callback such as ``BackboneFinetuning`` (or the user) may unfreeze or freeze parameters
later; the strategy compares the trainable set against the one recorded at setup before each training step and
either follows the change (``ddp_scratch`` rebuilds its buckets) or refuses it with :func:`refusal`.
"""

from __future__ import annotations

from torch import nn


def trainable_ids(module: nn.Module | None) -> set[int]:
    """The ids of ``module``'s parameters that require a gradient now (none without a module)."""
    return {id(p) for p in module.parameters() if p.requires_grad} if module is not None else set()


def changed(module: nn.Module | None, recorded: set[int] | None) -> list[str]:
    """The names of ``module``'s parameters whose ``requires_grad`` differs from ``recorded`` (nothing recorded: [])."""
    if module is None or recorded is None:
        return []
    return [n for n, p in module.named_parameters() if p.requires_grad != (id(p) in recorded)]


def refusal(strategy_name: str, names: list[str]) -> RuntimeError:
    """The error of a strategy that follows only the parameters trainable at setup."""
    return RuntimeError(
        f"{strategy_name}: the parameters {names} changed requires_grad after the fit started (e.g."
        " BackboneFinetuning unfreezing a backbone), but this strategy shards or aggregates the gradients and"
        " optimizer state of the parameters that were trainable at setup only. Declare them trainable from the"
        " start (requires_grad=True, in their own optimizer param group with lr=0 until they should train), or"
        " use ddp_scratch, which follows such changes."
    )
