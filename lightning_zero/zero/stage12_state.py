"""State dicts of a ZeRO-1/2 engine (:class:`~lightning_zero.zero.stage12.ShardedOptimizer`), sharded or full.

[Note: sharded optimizer state] Per group, each per-element state (AdamW's moments, SGD's momentum, the fp32
``"master"`` under mixed precision) is one DTensor over the *unpadded* flat group, sharded on dim 0 exactly as the
flat layout is (torch.chunk sizes: ceil(numel / N) per rank). Scalars (e.g. ``step``) are plain replicated tensors.
DCP saves each rank's chunk and, on load, reads the chunks overlapping the new owner's range: resharding to any world
size.

[Note: full optimizer state] The format of the *unsharded* optimizer: ``{"state": {i: {key: tensor shaped like param
i}}, "param_groups": [{..., "params": [i, ...]}]}`` numbered as the user's original param groups, so it loads into a
plain optimizer built by the same ``configure_optimizers`` and reshards to any world size. It is built on the shard
group's first rank (its *root*: rank 0 unless the group is a part of the world) only, one parameter at a time: each
parameter's pieces are reduced into the root (every other rank contributes zeros where it owns nothing) and copied to
the CPU as they arrive, so no rank holds more than one parameter beyond its own state; the root also holds the growing
CPU state dict. Shard groups that hold different parameters (the tensor-parallel slices under
``tensor_parallel_scratch``) each build their own on their root; under hybrid sharding the other shard groups hold the
same shards as rank 0's and skip it. Loading one copies each rank's pieces straight into its shards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_zero.comm import collectives as comm
from lightning_zero.zero.flat_group import FlatGroup, OptimizerShards
from lightning_zero.zero.optimizer_checks import check_group_count, hyperparameters


def _with_master(engine: OptimizerShards, g: FlatGroup) -> dict[str, Any]:
    """The optimizer state of ``g``'s shard, plus the master values when they are kept apart."""
    state = dict(engine.optimizer.state.get(g.shard, {}))
    if g.has_master:
        state["master"] = g.shard.detach()
    return state


def _elementwise(g: FlatGroup, value: object) -> bool:
    """Whether an optimizer state value has one element per shard element (moments), not a scalar (step)."""
    return isinstance(value, Tensor) and value.shape == g.shard.shape


def _load_shards(engine: OptimizerShards, sharded_state: dict[int, dict], param_groups: list[dict]) -> None:
    """Load per-group shard state with the saved hyper-parameters into the rebuilt optimizer; master values go into
    the shards (the module's parameters follow in ``ShardedOptimizer.sync_after_load``)."""
    for index, entry in sharded_state.items():
        master = entry.pop("master", None)
        if master is not None:
            engine.groups[index].shard.data.copy_(master)
            engine.on_masters_loaded()
    engine.optimizer.load_state_dict(
        {"state": sharded_state, "param_groups": [{**hp, "params": [i]} for i, hp in enumerate(param_groups)]}
    )


# ---------------------------------------------------------------- sharded
def _to_dtensor(engine: OptimizerShards, g: FlatGroup, shard_tensor: Tensor) -> DTensor:
    group = engine.group or dist.group.WORLD
    assert group is not None  # DCP runs with the process group initialised
    mesh = DeviceMesh.from_group(group, g.flat.device.type)
    real = max(0, min(g.end, g.layout.numel) - g.start)  # padding is not part of the saved tensor
    local = shard_tensor.narrow(0, 0, real)
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size((g.layout.numel,)), stride=(1,)
    )


def sharded_state_dict(engine: OptimizerShards) -> dict[str, Any]:
    """``{"state": {"group<i>": {key: DTensor | scalar}}, "param_groups": [hyper-parameters]}``."""
    state = {}
    for g in engine.groups:
        entry = {}
        for key, value in _with_master(engine, g).items():
            entry[key] = _to_dtensor(engine, g, value.detach()) if _elementwise(g, value) else value
        state[f"group{g.index}"] = entry
    return {"state": state, "param_groups": hyperparameters(engine.optimizer.param_groups)}


def sharded_template(engine: OptimizerShards, metadata: Metadata, prefix: str) -> dict[str, Any]:
    """Tensors for DCP to load ``prefix``'s optimizer state into, shaped from the checkpoint's index."""
    state: dict[str, dict] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if not fqn.startswith(f"{prefix}.state.group"):
            continue
        group_key, key = fqn[len(f"{prefix}.state.") :].split(".", 1)
        g = engine.groups[int(group_key.removeprefix("group"))]
        entry = state.setdefault(group_key, {})
        if not isinstance(item, TensorStorageMetadata):
            entry[key] = None
        elif tuple(item.size) == (g.layout.numel,):
            entry[key] = _to_dtensor(engine, g, torch.zeros_like(g.shard, dtype=item.properties.dtype))
        else:
            entry[key] = torch.empty(item.size, dtype=item.properties.dtype, device=g.flat.device)
    return {"state": state}


def load_sharded_state_dict(engine: OptimizerShards, loaded: dict, param_groups: list[dict]) -> None:
    """Load what DCP filled into :func:`sharded_template`, with the saved hyper-parameters."""
    check_group_count(len(param_groups), len(engine.groups))
    sharded_state = {}
    for g in engine.groups:
        entry = {}
        for key, value in loaded["state"].get(f"group{g.index}", {}).items():
            if isinstance(value, DTensor):
                shard = torch.zeros_like(g.shard, dtype=value.dtype)
                local = value.to_local()
                shard.narrow(0, 0, local.numel()).copy_(local)
                value = shard
            entry[key] = value
        if entry:
            sharded_state[g.index] = entry
    _load_shards(engine, sharded_state, param_groups)


# ---------------------------------------------------------------- full
def _numbering(engine: OptimizerShards) -> list[list[int]]:
    numbers, next_number = [], 0
    for g in engine.groups:
        numbers.append(list(range(next_number, next_number + len(g.original_params))))
        next_number += len(g.original_params)
    return numbers


def _root(engine: OptimizerShards) -> int | None:
    """The global rank the full state is built on ([Note: full optimizer state]): the shard group's first rank, or
    ``None`` where the shard group skips it (hybrid sharding, every group but rank 0's)."""
    root = comm.global_rank(0, engine.group)
    return None if engine.replicate_group is not None and root != 0 else root


def _reduce_to_root(engine: OptimizerShards, g: FlatGroup, shard_tensor: Tensor, i: int) -> Tensor | None:
    """Parameter ``i`` of ``g`` in full, from every rank's pieces of ``shard_tensor``: on the CPU of the root,
    ``None`` elsewhere (collective over the shard group)."""
    root = _root(engine)
    if root is None:
        return None
    p, offset = g.params[i], g.layout.offsets[i]
    full = torch.zeros(p.numel(), dtype=shard_tensor.dtype, device=shard_tensor.device)
    lo, hi = g.layout.owned(engine.rank, offset, offset + p.numel())
    if lo < hi:
        full.narrow(0, lo - offset, hi - lo).copy_(shard_tensor.narrow(0, lo - g.start, hi - lo))
    comm.reduce(full, dst=root, group=engine.group, tag="state_dict")
    return full.view_as(p).to("cpu", copy=True) if comm.rank() == root else None


def full_state_dict(engine: OptimizerShards) -> dict[str, Any]:
    """The unsharded optimizer's state dict on the shard group's root, rank 0 unless the group is a part of the world
    ([Note: full optimizer state]; ``"state"`` is empty elsewhere); collective."""
    state: dict[int, dict] = {}
    groups = []
    for g, numbers, hyper in zip(engine.groups, _numbering(engine), hyperparameters(engine.optimizer.param_groups)):
        groups.append({**hyper, "params": numbers})
        shard_state = _with_master(engine, g)
        scalars = {k: v for k, v in shard_state.items() if not _elementwise(g, v)}  # e.g. Adam's step, equal everywhere
        elementwise = {k: v.detach() for k, v in shard_state.items() if _elementwise(g, v)}
        if not shard_state:
            continue
        index_of = {id(p): i for i, p in enumerate(g.params)}
        for number, p in zip(numbers, g.original_params):
            if id(p) in index_of:
                per_param = {k: _reduce_to_root(engine, g, v, index_of[id(p)]) for k, v in elementwise.items()}
                # A copy of the scalars per parameter: a plain optimizer that loads this increments each
                # parameter's ``step`` in place, so one tensor shared by a group would count once per parameter.
                copies = {k: v.clone() if isinstance(v, Tensor) else v for k, v in scalars.items()}
                state[number] = {**copies, **per_param}
    return {"state": state if comm.rank() == _root(engine) else {}, "param_groups": groups}


def load_full_state_dict(engine: OptimizerShards, state_dict: dict) -> None:
    """Load a :func:`full_state_dict` (from any world size): each rank copies its pieces into shard-sized tensors."""
    saved_groups = state_dict["param_groups"]
    check_group_count(len(saved_groups), len(engine.groups))
    sharded_state: dict[int, dict] = {}
    for index, (g, saved_group) in enumerate(zip(engine.groups, saved_groups)):
        if len(saved_group["params"]) != len(g.original_params):
            raise ValueError(
                f"optimizer state param group {index} has {len(saved_group['params'])} parameters: expected"
                f" {len(g.original_params)}"
            )
        number_of = {id(p): n for n, p in zip(saved_group["params"], g.original_params)}
        states = [state_dict["state"].get(number_of[id(p)], {}) for p in g.params]
        if not any(states):
            continue
        for p, state, name in zip(g.params, states, g.names):
            for key, value in state.items():
                if isinstance(value, Tensor) and value.ndim > 0 and value.shape != p.shape:
                    raise ValueError(
                        f"optimizer state {key!r} of {name!r} has shape {tuple(value.shape)}: expected"
                        f" {tuple(p.shape)} (size mismatch)"
                    )
        shard_state: dict[str, Any] = {}
        for key, first in states[0].items():
            if not (isinstance(first, Tensor) and first.shape == g.params[0].shape and first.ndim > 0):
                shard_state[key] = first
                continue
            shard = torch.zeros_like(g.shard, dtype=first.dtype)
            for i, in_param, in_shard, length in g.layout.param_pieces(engine.rank):
                piece = states[i][key].reshape(-1).narrow(0, in_param, length)
                shard.narrow(0, in_shard, length).copy_(piece)
            shard_state[key] = shard
        sharded_state[index] = shard_state
    _load_shards(engine, sharded_state, hyperparameters(saved_groups))
