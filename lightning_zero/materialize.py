"""Filling ZeRO-3 shards from a module: real parameters from rank 0, meta-device ones built piece by piece.

[Note: meta initialisation] A model built under ``ZeroStrategy.model_sharded_context()`` (Lightning's
``configure_model``) lives on the meta device: shapes only. Each module that owns meta tensors is then built on its
own, in pre-order (the order in which a normal build initialises leaf modules): its tensors are allocated, its
``reset_parameters()`` runs, each rank copies its pieces into its shards and drops the rest before the next module.
So no rank ever holds more than its shards plus one module's parameters.

The random numbers come from the RNG state captured when ``configure_model`` ended (meta-device construction draws
none), taken from rank 0, inside ``torch.random.fork_rng``: the weights equal those of a non-sharded build from the
same seed, on every rank alike, and the global RNG is left as it was. A module whose parameter was built already (the
LM head tied to the token embedding) still runs its reset, on scratch stand-ins, because the normal build drew those
numbers too. Initialisation that is not ``reset_parameters()`` (a custom ``_init_weights`` applied after
construction) is not replayed: give such modules a ``reset_parameters``, as with FSDP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero import collectives as comm

LoadParam = Callable[[nn.Parameter], None]
"""Copies this rank's pieces of a (real, full) parameter into its shard and makes it a placeholder."""


def _direct_tensors(m: nn.Module) -> list[Tensor]:
    return [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]


def load_real_tensors(module: nn.Module, load_param: LoadParam, device: torch.device, group: Any = None) -> None:
    """Move real (non-meta) parameters and buffers to ``device`` with rank 0's values; shard the parameters."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_meta:
            continue
        tensor.data = tensor.data.to(device)
        if comm.is_initialized():
            comm.broadcast(tensor.data, 0, group=group, tag="init")
        if isinstance(tensor, nn.Parameter):
            load_param(tensor)


def build_meta_modules(
    module: nn.Module,
    load_param: LoadParam,
    device: torch.device,
    rng_state: Mapping[str, Tensor] | None = None,
    group: Any = None,
) -> None:
    """Build every meta-device tensor of ``module`` (see [Note: meta initialisation])."""
    meta_modules = [(name, m) for name, m in module.named_modules() if any(t.is_meta for t in _direct_tensors(m))]
    if not meta_modules:
        return
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        state = dict(rng_state or {"cpu": torch.get_rng_state()})
        if cuda and "cuda" not in state:
            state["cuda"] = torch.cuda.get_rng_state(device)
        if comm.is_initialized():
            state = comm.broadcast_object(state, 0, group=group, tag="init")
        torch.set_rng_state(state["cpu"])
        if cuda:
            torch.cuda.set_rng_state(state["cuda"], device)
        for name, m in meta_modules:
            _build(name, m, load_param, device)


def _build(name: str, m: nn.Module, load_param: LoadParam, device: torch.device) -> None:
    reset = getattr(m, "reset_parameters", None)
    if reset is None:
        raise TypeError(
            f"module {name or '<root>'!r} ({type(m).__name__}) has tensors on the meta device but no"
            " reset_parameters() to initialise them: add one, or build it outside configure_model"
        )
    built = {k: p for k, p in m._parameters.items() if p is not None and not p.is_meta}
    for k, p in built.items():  # scratch stand-ins; the real ones come back below
        m._parameters[k] = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
    for p in m._parameters.values():
        if p is not None and p.is_meta:  # swap: keeps the Parameter object (optimizer, ties) alive
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device), p.requires_grad))
    for k, b in m._buffers.items():
        if b is not None and b.is_meta:
            m._buffers[k] = torch.empty_like(b, device=device)
    with torch.no_grad():
        reset()
    for k, p in m._parameters.items():
        if p is not None and k not in built:
            load_param(p)
    m._parameters.update(built)
