"""Fabric's ``state`` dict and the checkpoint layout the Trainer and Fabric front ends share.

``fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 3})`` writes the
layout of [Note: checkpoint layout] in ``lightning_zero/zero/checkpointing.py``: the module the strategy set up under
``"state_dict"``, the optimizers under ``"optimizer_states"`` and the ``LRScheduler`` objects under
``"lr_schedulers"`` (lists, in the order of ``state``), every other entry under its own key, and the Lightning version
that the Trainer reads before it restores a checkpoint. ``fabric.load`` maps them
back into the objects of ``state`` whatever their keys, so a checkpoint of ``trainer.save_checkpoint`` loads into a
Fabric loop, and a file in Fabric's own layout (written by Fabric's ``ddp``: each entry under its own key) loads too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightning_zero.zero.checkpointing import MODEL, OPTIMIZERS, SCHEDULERS

VERSION = "pytorch-lightning_version"


@dataclass
class Roles:
    """Which keys of a Fabric ``state`` hold the model, the optimizers and the schedulers."""

    model: str | None = None
    optimizers: list[str] = field(default_factory=list)
    schedulers: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, state: Mapping[str, Any], module: nn.Module | None) -> Roles:
        roles = cls()
        for key, obj in state.items():
            if key in (MODEL, OPTIMIZERS, SCHEDULERS):
                raise ValueError(
                    f"the state key {key!r} is reserved by the checkpoint layout (it holds the model, optimizers or"
                    " schedulers of every strategy of lightning_zero): rename that entry"
                )
            if module is not None and obj is module:
                roles.model = key
            elif isinstance(obj, Optimizer):
                roles.optimizers.append(key)
            elif isinstance(obj, LRScheduler):
                roles.schedulers.append(key)
        return roles


def to_layout(converted: dict[str, Any], roles: Roles) -> dict[str, Any]:
    """The state, its objects converted to state dicts by Fabric, in the shared layout."""
    checkpoint = dict(converted)
    if roles.model is not None:
        checkpoint[MODEL] = checkpoint.pop(roles.model)
    checkpoint[OPTIMIZERS] = [checkpoint.pop(key) for key in roles.optimizers]
    checkpoint[SCHEDULERS] = [checkpoint.pop(key) for key in roles.schedulers]
    checkpoint.setdefault(VERSION, lightning.__version__)  # the Trainer migrates checkpoints by this entry
    return checkpoint


def from_fabric_layout(checkpoint: dict[str, Any], roles: Roles) -> dict[str, Any]:
    """A file in Fabric's own layout, each entry under the state's key, in the shared layout (unchanged if it is)."""
    if MODEL in checkpoint or OPTIMIZERS in checkpoint:
        return checkpoint
    checkpoint = dict(checkpoint)
    if roles.model is not None and roles.model in checkpoint:
        checkpoint[MODEL] = checkpoint.pop(roles.model)
    checkpoint[OPTIMIZERS] = [checkpoint.pop(key) for key in roles.optimizers if key in checkpoint]
    checkpoint[SCHEDULERS] = [checkpoint.pop(key) for key in roles.schedulers if key in checkpoint]
    return checkpoint


def check_keys(state: Mapping[str, Any], checkpoint: Mapping[str, Any], roles: Roles, path: Any) -> None:
    """``strict`` loading: every key of ``state`` has something in ``checkpoint``."""
    optimizers, schedulers = len(checkpoint.get(OPTIMIZERS, [])), len(checkpoint.get(SCHEDULERS, []))
    missing = []
    for key in state:
        if key == roles.model:
            found = MODEL in checkpoint
        elif key in roles.optimizers:
            found = roles.optimizers.index(key) < optimizers
        elif key in roles.schedulers:
            found = roles.schedulers.index(key) < schedulers
        else:
            found = key in checkpoint
        if not found:
            missing.append(key)
    if missing:
        raise KeyError(f"the checkpoint {path} has nothing for the state's {missing}: pass strict=False to skip them")


def restore_others(state: dict[str, Any], checkpoint: dict[str, Any], roles: Roles) -> dict[str, Any]:
    """Schedulers and the other entries of ``state`` from ``checkpoint`` (the model and optimizers are loaded by
    the strategy); returns what is left of the checkpoint."""
    remainder = dict(checkpoint)
    remainder.pop(MODEL, None)
    remainder.pop(OPTIMIZERS, None)
    remainder.pop(VERSION, None)
    for key, scheduler_state in zip(roles.schedulers, remainder.pop(SCHEDULERS, [])):
        state[key].load_state_dict(scheduler_state)
    for key, obj in list(state.items()):
        if key == roles.model or key in roles.optimizers or key in roles.schedulers or key not in remainder:
            continue
        if isinstance(obj, _Stateful):
            obj.load_state_dict(remainder.pop(key))
        else:
            state[key] = remainder.pop(key)
    return remainder
