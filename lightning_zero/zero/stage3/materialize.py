"""Filling ZeRO-3 shards from a module: real parameters from rank 0, meta-device ones built piece by piece.

[Note: model construction] ``configure_model`` runs under ``ZeroStrategy.model_sharded_context()``, first on the meta
device (shapes only, no memory, no random numbers). Then, by ``model_init``:

- ``"full"``: the module tree is put back as it was before ``configure_model`` (:class:`ModuleSnapshot`), the RNG too,
  and ``configure_model`` runs again for real, on the device Lightning's ``ddp`` builds on. The weights are exactly
  those of a normal build, whatever initialisation the model does (a parent's ``self.apply(_init_weights)``,
  ``nn.Transformer``'s xavier init, tied weights), and the RNG continues from the same state (dropout masks equal
  ``ddp``'s). ZeRO-3 then shards the real parameters.
- ``"meta"``: the meta modules are built one by one ([Note: meta initialisation]); no rank ever holds the model.
- ``"auto"`` (default): ``"full"`` when every local process's copy fits comfortably (:func:`fits_in_memory`), else
  ``"meta"`` with a warning naming the modules whose own init code is not replayed (:func:`unreplayed_init`).

[Note: meta initialisation] Each module that owns meta tensors is built on its own, in pre-order (the order in which
a normal build initialises leaf modules): its tensors are allocated, its ``reset_parameters()`` runs, each rank copies
its pieces into its shards and drops the rest before the next module. So no rank ever holds more than its shards plus
one module's parameters.

The random numbers come from the RNG state captured when ``configure_model`` ended, taken from rank 0: the weights
equal those of a non-sharded build from the same seed, on every rank alike, *for the parts a normal build initialises
through* ``reset_parameters()``. A module whose parameter was built already (the LM head tied to the token embedding)
still runs its reset, on scratch stand-ins, because the normal build drew those numbers too. Initialisation that is
not ``reset_parameters()`` (a custom ``_init_weights`` applied after construction) is not replayed.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as comm

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
            comm.broadcast(tensor.data, comm.global_rank(0, group), group=group, tag="init")
        if isinstance(tensor, nn.Parameter):
            load_param(tensor)


def rng_state(device: torch.device) -> dict[str, Tensor]:
    """The random state a meta-device build replays from: the CPU's, and ``device``'s when it is a GPU."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


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
    # No fork_rng: the RNG goes on from where the replay leaves it, as it goes on after a normal build's init.
    state = dict(rng_state or {"cpu": torch.get_rng_state()})
    if device.type == "cuda" and "cuda" not in state:
        state["cuda"] = torch.cuda.get_rng_state(device)
    if comm.is_initialized():
        state = comm.broadcast_object(state, comm.global_rank(0, group), group=group, tag="init")
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda":
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
    for meta in m._parameters.values():
        if meta is not None and meta.is_meta:  # swap: keeps the Parameter object (optimizer, ties) alive
            torch.utils.swap_tensors(meta, nn.Parameter(torch.empty_like(meta, device=device), meta.requires_grad))
    for k, b in m._buffers.items():
        if b is not None and b.is_meta:
            m._buffers[k] = torch.empty_like(b, device=device)
    with torch.no_grad():
        reset()
    for k, param in m._parameters.items():
        if param is not None and k not in built:
            load_param(param)
    m._parameters.update(built)


# ---------------------------------------------------------------- "full" construction ([Note: model construction])
MODEL_INIT_MODES = ("auto", "full", "meta")
MEMORY_SHARE = 4
"""``"auto"`` builds the whole model when all local copies take at most 1/MEMORY_SHARE of the available memory."""


class ModuleSnapshot:
    """The structure of every module of a tree (its attributes, children, parameters and buffers), to be put back
    after a trial construction on the meta device."""

    def __init__(self, module: nn.Module) -> None:
        self._saved = [
            (m, dict(m.__dict__), dict(m._modules), dict(m._parameters), dict(m._buffers)) for m in module.modules()
        ]

    def restore(self) -> None:
        for m, attributes, modules, parameters, buffers in self._saved:
            m.__dict__.clear()
            m.__dict__.update(attributes)
            m._modules, m._parameters, m._buffers = dict(modules), dict(parameters), dict(buffers)


def meta_nbytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers that live on the meta device (each tensor once)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers()) if t.is_meta}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def available_bytes(device: torch.device) -> int:
    """Free memory of ``device``: CUDA's free memory, or the host's ``MemAvailable``."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fits_in_memory(nbytes: int, device: torch.device, copies: int) -> bool:
    """Whether ``copies`` copies of ``nbytes`` take at most 1/:data:`MEMORY_SHARE` of ``device``'s free memory."""
    return nbytes * copies * MEMORY_SHARE <= available_bytes(device)


def unreplayed_init(module: nn.Module) -> list[str]:
    """Modules with meta tensors below them whose own construction code a meta build does not replay: classes
    defined outside ``torch.nn`` (their ``__init__`` may initialise children, e.g. ``self.apply(_init_weights)``)
    and modules with a private ``_reset_parameters`` (``nn.Transformer``, ``nn.MultiheadAttention``)."""
    found = []
    for name, m in module.named_modules():
        if not name or not any(t.is_meta for t in (*m.parameters(), *m.buffers())):
            continue  # the root (the LightningModule) was built before configure_model created its meta children
        user_class = not type(m).__module__.startswith("torch.") and type(m).__init__ is not nn.Module.__init__
        if hasattr(m, "_reset_parameters") or (user_class and not hasattr(m, "reset_parameters")):
            found.append(f"{name} ({type(m).__name__})")
    return found
