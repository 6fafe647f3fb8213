"""Where a pipeline's weights live: this stage's layers real, the other stages' meta-device placeholders.

[Note: stage placeholders] Every rank keeps the whole module tree, so parameter names, the optimizer's parameter
order (its state is keyed by position) and the checkpoint layout are those of the unsplit model on every rank; but
the parameters and buffers of the layers another stage holds live on the meta device (no memory). The optimizer
skips them (their gradient stays ``None``), and the checkpoint functions here read and write only the real ones.
Whole weights come back on every rank with :func:`gather_layers` (one broadcast per tensor, from its stage's rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as comm


def relocate(p: nn.Parameter, device: torch.device | str) -> None:
    """Give ``p`` new, uninitialised storage on ``device`` (``"meta"``: none), keeping the ``Parameter`` object, so
    the optimizer's and the module's references hold."""
    torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device), p.requires_grad))


def to_meta(module: nn.Module) -> None:
    """Replace ``module``'s parameters and buffers by meta-device placeholders."""
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and not p.is_meta:
                relocate(p, "meta")
        for name, b in m._buffers.items():
            if b is not None and not b.is_meta:
                m._buffers[name] = b.to("meta")


def move_real(module: nn.Module, device: torch.device | str) -> None:
    """``module.to(device)`` for its real tensors (``.to`` cannot copy out of a meta tensor)."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


def real_keys(module: nn.Module) -> set[str]:
    """The ``state_dict`` keys of ``module`` whose tensors are not placeholders."""
    return {k for k, v in module.state_dict(keep_vars=True).items() if not (isinstance(v, Tensor) and v.is_meta)}


def gather_layers(
    layers: nn.Sequential, slices: Sequence[range], ranks: Sequence[int], device: torch.device, group: Any = None
) -> None:
    """Give every rank of a pipeline every stage's layers for real: each tensor broadcast from the (global) rank of
    its stage, ``ranks[stage]``, within ``group``."""
    for stage, indices in enumerate(slices):
        for i in indices:
            layer = layers[i]
            for m in layer.modules():
                for p in m._parameters.values():
                    if p is not None and p.is_meta:
                        relocate(p, device)
                for name, b in m._buffers.items():
                    if b is not None and b.is_meta:
                        m._buffers[name] = torch.empty_like(b, device=device)
            for tensor in (*layer.parameters(), *layer.buffers()):
                comm.broadcast(tensor.data, ranks[stage], group=group, tag="pipeline/gather")


def owned_positions(optimizer: torch.optim.Optimizer) -> set[int]:
    """The optimizer-state keys (positions over all param groups) of this rank's real parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {i for i, p in enumerate(params) if not p.is_meta}


def merge_optimizer_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One optimizer ``state_dict`` from every stage's (each holds the state of its own parameters)."""
    merged = dict(states[0])
    merged["state"] = {k: v for state in states for k, v in state["state"].items()}
    return merged


def select_optimizer_state(state: dict[str, Any], positions: set[int]) -> dict[str, Any]:
    """``state`` restricted to the parameters at ``positions`` (a stage's own)."""
    return {**state, "state": {k: v for k, v in state["state"].items() if k in positions}}
