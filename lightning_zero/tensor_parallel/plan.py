"""Parallelize a model by module names: :func:`parallelize`, the styles, :data:`GPT_PLAN`, :func:`full_state_dict`,
:func:`shard_state_dict`, :func:`unparallelize`.

Runbook (every rank of the tensor-parallel group runs the same lines)::

    torch.manual_seed(0)
    model = CharGPT(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.0)  # same on all ranks
    parallelize(model, GPT_PLAN, group=tp_group)   # in place: this rank's slices, n_head -> n_head / N
    logits = model(x)                              # (batch, seq, V/N): this rank's slice of the vocabulary
    loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), y.flatten(), tp_group)
    loss.backward()
    optimizer.step()                               # an elementwise optimizer (SGD, Adam, AdamW) as is
    state = full_state_dict(model)                 # the keys and full shapes of the model before parallelize
    local = shard_state_dict(model, state)         # a full state dict (a checkpoint) cut into this rank's slices
    model.load_state_dict(local)
    unparallelize(model, GPT_PLAN, group=tp_group) # the full layers back, slices gathered, n_head multiplied back

[Note: parallelize plan] As torch's ``parallelize_module(module, mesh, plan)`` takes one, a plan maps module
names to styles. A key is a dotted name whose atoms may hold ``fnmatch`` wildcards, matched atom by atom against
the names of ``module.named_modules()`` (``"blocks.*.qkv"`` matches ``blocks.0.qkv`` but not ``blocks.0.mlp.qkv``).
A style either replaces the module (:class:`ColwiseParallel`, :class:`RowwiseParallel`, :class:`VocabParallel`: a
layer of :mod:`lightning_zero.tensor_parallel.layers` built from this rank's slice of its weights) or changes it in
place (:class:`HeadParallel`: divides a head count by the group size, so an attention whose projections are sharded
by heads runs its local heads with an unchanged ``forward``; the ``forward`` must derive every other width from the
tensors, as ``lightning_zero.demo.model.Block`` does). Modules no key matches stay replicated: each rank holds and
updates the same copy, and their gradients agree without communication because everything they see is replicated.

Everything is checked before anything changes, so a refused plan leaves the model as it was: every key matches at
least one module, no module is matched twice, each style gets its module type, and every size it splits divides by
the group size (times ``chunks``). The errors name the key, the module and the numbers. Apply a plan once: a second
:class:`HeadParallel` would divide the head count again.

Dropout inside a parallel region (attention dropout over local heads) draws independent masks per rank, and dropout
on a replicated activation must draw the same mask on every rank (Megatron's RNG tracker): neither is arranged
here, so the parity with a single-process model holds for ``dropout=0``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any, ClassVar

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_zero.comm import collectives as comm
from lightning_zero.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelModule,
    VocabParallelEmbedding,
)
from lightning_zero.tensor_parallel.sharding import divide, shard, unshard


class Style(ABC):
    """How :func:`parallelize` changes one module ([Note: parallelize plan]).

    Attributes:
        module_type: the type of module the style applies to.
    """

    module_type: ClassVar[type[nn.Module]]

    @abstractmethod
    def check(self, module: nn.Module, size: int) -> None:
        """Refuse a ``module`` this style cannot split over ``size`` ranks (``ValueError`` with the numbers)."""

    @abstractmethod
    def apply(self, module: nn.Module, group: Any) -> nn.Module:
        """Parallelize a checked ``module`` over ``group``; return the module to put in its place (``module`` itself
        when changed in place)."""

    def revert(self, module: nn.Module, group: Any) -> nn.Module:
        """Undo :meth:`apply` on the module it returned; return the module to put in its place. By default a
        tensor-parallel layer's full module, its slices gathered (a collective over ``group``)."""
        return module.unsharded() if isinstance(module, TensorParallelModule) else module


@dataclass(frozen=True)
class ColwiseParallel(Style):
    """An ``nn.Linear`` becomes a :class:`~lightning_zero.tensor_parallel.layers.ColumnParallelLinear`.

    Attributes:
        gather_output: all-gather the output to the full width (default: leave it sharded for a row-parallel layer
            or the vocab-parallel cross entropy).
        chunks: the output is this many blocks, each split separately (3: a fused q/k/v projection).
    """

    gather_output: bool = False
    chunks: int = 1
    module_type: ClassVar[type[nn.Module]] = nn.Linear

    def check(self, module: nn.Module, size: int) -> None:
        divide(module.out_features, size, "out_features", self.chunks)

    def apply(self, module: nn.Module, group: Any) -> nn.Module:
        return ColumnParallelLinear.from_module(module, group, gather_output=self.gather_output, chunks=self.chunks)


@dataclass(frozen=True)
class RowwiseParallel(Style):
    """An ``nn.Linear`` becomes a :class:`~lightning_zero.tensor_parallel.layers.RowParallelLinear`.

    Attributes:
        input_is_parallel: the input is this rank's slice of the features (default: the output of a column-parallel
            layer); ``False``: the full activation, of which it keeps its slice.
    """

    input_is_parallel: bool = True
    module_type: ClassVar[type[nn.Module]] = nn.Linear

    def check(self, module: nn.Module, size: int) -> None:
        divide(module.in_features, size, "in_features")

    def apply(self, module: nn.Module, group: Any) -> nn.Module:
        return RowParallelLinear.from_module(module, group, input_is_parallel=self.input_is_parallel)


@dataclass(frozen=True)
class VocabParallel(Style):
    """An ``nn.Embedding`` becomes a :class:`~lightning_zero.tensor_parallel.layers.VocabParallelEmbedding`."""

    module_type: ClassVar[type[nn.Module]] = nn.Embedding

    def check(self, module: nn.Module, size: int) -> None:
        divide(module.num_embeddings, size, "num_embeddings")

    def apply(self, module: nn.Module, group: Any) -> nn.Module:
        return VocabParallelEmbedding.from_module(module, group)


@dataclass(frozen=True)
class HeadParallel(Style):
    """Divide a module's head count by the group size, in place: its attention then runs this rank's heads.

    Pair it with the plan of the module's projections (q/k/v column-parallel with ``chunks=3``, the output projection
    row-parallel), which give each rank the weights of heads ``[r*H/N, (r+1)*H/N)``.

    Attributes:
        attribute: the name of the module's integer head count.
    """

    attribute: str = "n_head"
    module_type: ClassVar[type[nn.Module]] = nn.Module

    def check(self, module: nn.Module, size: int) -> None:
        value = getattr(module, self.attribute, None)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer attribute {self.attribute!r}, got {value!r}")
        divide(value, size, self.attribute)

    def apply(self, module: nn.Module, group: Any) -> nn.Module:
        setattr(module, self.attribute, getattr(module, self.attribute) // comm.world_size(group))
        return module

    def revert(self, module: nn.Module, group: Any) -> nn.Module:
        setattr(module, self.attribute, getattr(module, self.attribute) * comm.world_size(group))
        return module


GPT_PLAN: Mapping[str, Style] = MappingProxyType(
    {
        "wte": VocabParallel(),
        "blocks.*": HeadParallel("n_head"),
        "blocks.*.qkv": ColwiseParallel(chunks=3),
        "blocks.*.proj": RowwiseParallel(),
        "blocks.*.mlp.0": ColwiseParallel(),
        "blocks.*.mlp.2": RowwiseParallel(),
        "head": ColwiseParallel(),  # vocab-sharded logits, for vocab_parallel_cross_entropy
    }
)
"""The plan of ``lightning_zero.demo.model.CharGPT``: Megatron-LM's layout. The position embedding and the
LayerNorms stay replicated."""


def _matches(key: str, name: str) -> bool:
    atoms, parts = key.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatchcase(part, atom) for atom, part in zip(atoms, parts))


def parallelize(module: nn.Module, plan: Mapping[str, Style], group: Any = None) -> nn.Module:
    """Apply ``plan`` to ``module``'s submodules, in place ([Note: parallelize plan]).

    Args:
        module: the full model, with the same weights on every rank of ``group`` (e.g. built from one seed).
        plan: module name patterns (``*`` wildcards per dotted atom) to styles.
        group: the tensor-parallel process group; ``None`` is the world.

    Returns:
        ``module``.

    Raises:
        ValueError: a key matches no module, a module is matched by two keys, or a size does not divide by the group
            size; nothing is changed.
        TypeError: a plan value is not a :class:`Style`, or a style meets a module of another type; nothing is
            changed.
    """
    modules = {name: sub for name, sub in module.named_modules() if name}
    targets = _targets(module, modules, plan)
    size = comm.world_size(group)
    for name, (key, style) in targets.items():
        where = f"plan key {key!r}, module {name!r} ({type(modules[name]).__name__})"
        if not isinstance(modules[name], style.module_type):
            raise TypeError(f"{where}: {type(style).__name__} applies to {style.module_type.__name__} modules only")
        try:
            style.check(modules[name], size)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    for name, (_, style) in targets.items():
        _replace(module, name, modules[name], style.apply(modules[name], group))
    return module


def unparallelize(module: nn.Module, plan: Mapping[str, Style], group: Any = None) -> nn.Module:
    """Undo :func:`parallelize` (with the same ``plan`` and ``group``), in place: every parallel layer becomes the full
    module again with every rank's slices gathered back, and :class:`HeadParallel` multiplies its head count back. A
    collective over ``group``; the full layers' parameters are new ``nn.Parameter`` objects (an optimizer built over
    the parallel ones still holds those).

    Returns:
        ``module``.
    """
    modules = {name: sub for name, sub in module.named_modules() if name}
    for name, (_, style) in _targets(module, modules, plan).items():
        _replace(module, name, modules[name], style.revert(modules[name], group))
    return module


def _replace(module: nn.Module, name: str, old: nn.Module, new: nn.Module) -> None:
    if new is not old:
        parent, _, attribute = name.rpartition(".")
        setattr(module.get_submodule(parent), attribute, new)


def _targets(
    module: nn.Module, modules: Mapping[str, nn.Module], plan: Mapping[str, Style]
) -> dict[str, tuple[str, Style]]:
    """The submodule name each plan key matches, with its key and style ([Note: parallelize plan])."""
    targets: dict[str, tuple[str, Style]] = {}
    for key, style in plan.items():
        if not isinstance(style, Style):
            raise TypeError(f"plan key {key!r} maps to {style!r}: expected a Style such as ColwiseParallel()")
        matched = [name for name in modules if _matches(key, name)]
        if not matched:
            examples = ", ".join(repr(name) for name in list(modules)[:6])
            raise ValueError(f"plan key {key!r} matches no module of {type(module).__name__} (names: {examples}, ...)")
        for name in matched:
            if name in targets:
                raise ValueError(f"module {name!r} is matched by plan keys {targets[name][0]!r} and {key!r}")
            targets[name] = (key, style)
    return targets


def sharded_entries(module: nn.Module) -> dict[str, tuple[TensorParallelModule, int]]:
    """The state-dict keys of ``module``'s tensor-parallel slices, each with its layer and the dimension it is split
    along (in module order, the same on every rank); every other entry of the state dict is replicated."""
    entries = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, TensorParallelModule):
            for name, dim in sub.shard_dims.items():
                if getattr(sub, name) is not None:  # a layer without bias has no "bias"
                    entries[f"{prefix}.{name}" if prefix else name] = (sub, dim)
    return entries


def full_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """``module.state_dict()`` with every tensor-parallel slice gathered back: the keys and the full shapes of the
    model before :func:`parallelize`, on every rank.

    A collective: every rank of each parallel layer's group calls it (the layers in the same order everywhere).
    """
    state = module.state_dict()
    for key, (layer, dim) in sharded_entries(module).items():
        state[key] = unshard(state[key], dim, layer.group, layer.chunks)
    return state


def shard_state_dict(module: nn.Module, full: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of :func:`full_state_dict`: ``full`` (the state dict of the model before :func:`parallelize`, the
    same on every rank) with this rank's slice of each entry ``module`` holds sharded, for ``module.load_state_dict``.
    An entry that is a DTensor (read from a sharded checkpoint, [Note: tensor-parallel DTensors] in
    ``lightning_zero/tensor_parallel/checkpoint.py``) is this rank's slice already. No communication; other entries
    are passed through as they are (``load_state_dict`` judges them)."""
    state = dict(full)
    for key, (layer, dim) in sharded_entries(module).items():
        if key in state:
            state[key] = slice_of(state[key], layer, dim)
    return state


def slice_of(value: Tensor, layer: TensorParallelModule, dim: int) -> Tensor:
    """This rank's slice of an entry of ``layer`` split along ``dim``: of the full tensor, or of a DTensor read from a
    sharded checkpoint (its local piece)."""
    if isinstance(value, DTensor):
        return value.to_local().flatten(dim, dim + 1) if layer.chunks > 1 else value.to_local()
    return shard(value, dim, layer.group, layer.chunks)
