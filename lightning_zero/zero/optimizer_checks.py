"""What both ZeRO engines (stages 1/2 and stage 3) check and do to the user's optimizers before sharding them:
every trainable parameter in exactly one param group, state made before sharding set aside to be sharded with it,
the settings of the gradient reduction, and the checks of a loaded state against the model's param groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GRAD_SYNC_MODES = ("boundary", "microbatch")
GRAD_REDUCTIONS = ("auto", "all_reduce", "reduce_scatter")


def check_in_optimizer(missing: list[str]) -> None:
    """Raise if trainable parameters (``missing``, by name) are in no optimizer param group."""
    if missing:
        raise ValueError(
            f"trainable parameters {missing} are in no optimizer param group: ZeRO shards the optimizers, so add"
            " them to a group or freeze them (requires_grad=False); under Fabric, set up all of the model's"
            " optimizers together: fabric.setup(model, optimizer_1, optimizer_2)"
        )


def check_disjoint(repeated: list[str]) -> None:
    """Raise if parameters (``repeated``, by name) are in more than one param group or optimizer."""
    if repeated:
        raise ValueError(
            f"parameters {repeated} are in more than one param group or optimizer: ZeRO shards each parameter's"
            " optimizer state once, so give each parameter to one optimizer"
        )


def index_of(optimizers: Sequence[torch.optim.Optimizer], optimizer: torch.optim.Optimizer) -> int:
    """``optimizer``'s position among the ``optimizers`` a ZeRO engine shards (by identity)."""
    k = next((k for k, opt in enumerate(optimizers) if opt is optimizer), None)
    if k is None:
        raise ValueError(f"{type(optimizer).__name__} is not an optimizer this ZeRO engine shards")
    return k


def set_aside_state(optimizer: torch.optim.Optimizer) -> dict | None:
    """[Note: state made before sharding] An optimizer may hold state before ZeRO rebuilds it over the shards:
    Adagrad makes its sums in its constructor, and a user may hand over one that has stepped. Returns its full state
    dict (``None`` if it holds none) and empties its state; the engine loads that back into the shards, as from a full
    checkpoint, so the first step starts from it as under ``ddp``."""
    if not optimizer.state:
        return None
    initial = optimizer.state_dict()
    optimizer.state.clear()
    return initial


def hyperparameters(param_groups: list[dict]) -> list[dict]:
    """Each param group without its ``params``."""
    return [{k: v for k, v in group.items() if k != "params"} for group in param_groups]


def check_group_count(saved: int, expected: int) -> None:
    if saved != expected:
        raise ValueError(f"optimizer state has {saved} param groups: expected {expected} as in the model")


def check_grad_reduction(grad_reduction: str, stage: int, grad_sync: str | None) -> None:
    """Raise unless ``grad_reduction`` is one of :data:`GRAD_REDUCTIONS` and applies to ``stage`` with ``grad_sync``
    (``None``: the stage's default) ([Note: gradient reduction] in ``lightning_zero/zero/stage12_reduction.py``)."""
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction={grad_reduction!r} is invalid: expected one of {GRAD_REDUCTIONS}")
    if stage == 3 and grad_reduction != "auto":
        raise ValueError(
            f"grad_reduction={grad_reduction!r} applies to stages 1 and 2 only: stage=3 always reduce-scatters"
        )
    if grad_reduction == "reduce_scatter" and stage == 1 and grad_sync in (None, "boundary"):
        raise ValueError(
            "grad_reduction='reduce_scatter' needs stage=2, or grad_sync='microbatch' with stage=1: stage 1's"
            " 'boundary' mode keeps the full averaged gradient on every rank"
        )
