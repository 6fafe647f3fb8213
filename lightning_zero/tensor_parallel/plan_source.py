"""Where ``tensor_parallel_scratch``'s plan comes from: the strategy's ``plan`` setting or the LightningModule's own.

The plan (:mod:`lightning_zero.tensor_parallel.plan`: module-name patterns to styles) comes from, in order:

1. the ``plan`` setting: a mapping, or the import path of one (``"lightning_zero.tensor_parallel.GPT_PLAN"``, for a
   Hydra config; :func:`resolve_plan`), its keys relative to the submodule ``plan_root`` names (``plan_root="net"``:
   the key ``"wte"`` is the LightningModule's ``net.wte``; default ``""``: the LightningModule itself);
2. else the LightningModule's ``tensor_parallel_plan`` (:data:`PLAN_ATTRIBUTE`), a mapping or a method returning one,
   its keys relative to the LightningModule (``{"net.head": ColwiseParallel(gather_output=True), ...}``);
3. else :func:`module_plan` refuses the run naming both.
"""

from __future__ import annotations

import pydoc
from collections.abc import Mapping

from torch import nn

from lightning_zero.tensor_parallel.plan import Style

PLAN_ATTRIBUTE = "tensor_parallel_plan"
"""The LightningModule attribute (a plan, or a method returning one) used when the strategy has no ``plan``."""


def resolve_plan(plan: Mapping[str, Style] | str) -> dict[str, Style]:
    """A plan, or the import path of one (``pydoc.locate``)."""
    resolved = pydoc.locate(plan) if isinstance(plan, str) else plan
    if not isinstance(resolved, Mapping):
        found = f" (it names {type(resolved).__name__})" if isinstance(plan, str) else ""
        raise ValueError(
            f"plan={plan!r} is invalid: expected a mapping of module names to styles, or the import path of one{found}"
        )
    return dict(resolved)  # a copy the strategy owns (and can pickle: GPT_PLAN is a read-only proxy)


def module_plan(module: nn.Module, plan: Mapping[str, Style] | None, plan_root: str) -> dict[str, Style]:
    """The plan for ``module``, its keys relative to it: ``plan`` (resolved, its keys relative to ``plan_root``),
    else the module's :data:`PLAN_ATTRIBUTE`."""
    if plan is not None:
        return {f"{plan_root}.{key}" if plan_root else key: s for key, s in plan.items()}
    own = getattr(module, PLAN_ATTRIBUTE, None)
    own = own() if callable(own) else own
    if own is None:
        raise ValueError(
            f"tensor_parallel_scratch needs a plan: pass TensorParallelStrategy(plan=..., plan_root=...) (e.g."
            f" plan='lightning_zero.tensor_parallel.GPT_PLAN', plan_root='net'), or give"
            f" {type(module).__name__} a `{PLAN_ATTRIBUTE}` (a mapping or a method returning one)"
        )
    if not isinstance(own, Mapping):
        raise TypeError(f"{type(module).__name__}.{PLAN_ATTRIBUTE} is {type(own).__name__}: expected a mapping")
    return dict(own)
