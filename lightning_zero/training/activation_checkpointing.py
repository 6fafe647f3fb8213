"""Activation checkpointing by module class: the ``activation_checkpointing_policy`` of every strategy.

Runbook::

    Trainer(strategy=ZeroStrategy(stage=3, auto_wrap_policy={Block}, activation_checkpointing_policy={Block}))

Each module of a policy class runs its forward under non-reentrant ``torch.utils.checkpoint.checkpoint``: only its
inputs are kept for backward, and its forward runs again when backward reaches it. The module is not wrapped: its
instance ``forward`` is replaced (and restored after the fit), so parameter names, state-dict keys and the strategies'
hooks stay as they are. That matters under ZeRO-3: the forward hooks of a unit are those of ``Module.__call__``, and
the recompute calls the original ``forward`` directly, so when the policy class is the unit class (the usual choice)
the recompute runs inside the unit's backward, with the unit already gathered for it, and gathers nothing. Units
*nested* in a checkpointed module are gathered again by the recompute and freed after it (part of every rank's
gather sequence, so the gather-order check sees the same plan on every rank).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zero.training.module_classes import module_classes

_ORIGINAL = "_lightning_zero_forward"
"""Where a checkpointed module keeps its own forward (the instance attribute ``forward`` shadows the class's)."""


def check_policy(policy: Any) -> set[type] | None:
    """``None`` or a non-empty set of ``nn.Module`` subclasses (or their import paths); anything else raises naming
    the setting."""
    return module_classes("activation_checkpointing_policy", policy)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved for backward anyway
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply(module: nn.Module, policy: set[type]) -> list[nn.Module]:
    """Checkpoint every submodule of ``module`` (itself included) that is an instance of a ``policy`` class; return
    them. A module already checkpointed is left as it is."""
    chosen = [m for m in module.modules() if isinstance(m, tuple(policy)) and not hasattr(m, _ORIGINAL)]
    for m in chosen:
        setattr(m, _ORIGINAL, m.forward)
        m.forward = _checkpointed(m.forward)
    return chosen


def revert(modules: list[nn.Module]) -> None:
    """Undo :func:`apply`."""
    for m in modules:
        if hasattr(m, _ORIGINAL):
            del m.forward
            delattr(m, _ORIGINAL)
