"""State dicts of a ZeRO-3 engine (:class:`~lightning_zero.zero.stage3.engine.ShardedParams`), full or sharded.

[Note: stage-3 state dict layout] Both kinds are *per parameter*, keyed as the unsharded model and optimizer are, so
neither depends on units, segments, padding or the world size:

- model: ``module.state_dict()`` keys. Full: plain tensors (rank 0). Sharded: each parameter a ``DTensor`` sharded on
  dim 0 (``torch.chunk`` pieces, as FSDP2 saves), buffers plain (replicated, written once by DCP).
- optimizer, full: the unsharded optimizer's own format (states numbered as the user's param groups list their
  parameters; loads with a plain ``optimizer.load_state_dict``). Sharded: ``{"state": {param name: {key: DTensor or
  scalar}}}`` with the hyper-parameters returned apart (they go to ``meta.pt``).

So a sharded checkpoint directory holds ``model`` / ``optimizer_0`` like Lightning's FSDP strategy, and
``python -m lightning.pytorch.utilities.consolidate_checkpoint`` turns it into a plain checkpoint. Converting walks
one segment at a time (one all-gather of its flat), so no rank holds more than one segment of full values beyond
its own pieces; a full state dict is kept by rank 0 only, copied to the CPU as each segment arrives. Loading goes
back through ``DTensor.full_tensor()`` one parameter at a time, then each rank keeps its flat-shard pieces:
resharding to any world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_zero.comm import collectives as comm
from lightning_zero.zero.optimizer_checks import check_group_count, hyperparameters
from lightning_zero.zero.stage3.segments import Segment
from lightning_zero.zero.stage3.view import EngineView


def _mesh(engine: EngineView) -> DeviceMesh:
    group = engine.group if engine.group is not None else dist.group.WORLD
    if group is None:  # dist.group.WORLD is None until init_process_group has run
        raise RuntimeError("a sharded ZeRO-3 state dict needs an initialized process group; none is")
    return DeviceMesh.from_group(group, engine.device.type)


def _per_param(engine: EngineView, segment: Segment, shard_tensor: Tensor) -> list[Tensor]:
    """All-gather a shard-shaped tensor of ``segment`` and return full per-parameter views of the result."""
    return segment.gather_values(shard_tensor, engine.group)


def _local_shape(shape: torch.Size, world_size: int, rank: int) -> tuple[int, ...]:
    chunks = torch.empty(shape, device="meta").chunk(world_size, dim=0)
    return tuple(chunks[rank].shape) if rank < len(chunks) else (0, *shape[1:])


def _to_dtensor(mesh: DeviceMesh, full: Tensor) -> DTensor:
    """This rank's dim-0 chunk of ``full`` (a copy), as a DTensor; 0-dim tensors are replicated."""
    if full.ndim == 0:
        return DTensor.from_local(full.clone(), mesh, [Replicate()], run_check=False)
    n, r = mesh.size(), mesh.get_local_rank()
    chunks = full.chunk(n, dim=0)
    local = chunks[r].clone() if r < len(chunks) else full.new_empty(_local_shape(full.shape, n, r))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


def _template(mesh: DeviceMesh, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> DTensor:
    """An empty DTensor for DCP to load into, sharded as :func:`_to_dtensor` shards."""
    if len(shape) == 0:
        return DTensor.from_local(torch.empty((), dtype=dtype, device=device), mesh, [Replicate()], run_check=False)
    local = torch.empty(_local_shape(shape, mesh.size(), mesh.get_local_rank()), dtype=dtype, device=device)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def _keeps_full(engine: EngineView) -> bool:
    """Whether this rank keeps a full state: the first rank of the engine's shard group and of its replicate group
    (hybrid sharding: global rank 0 only; tensor_parallel_scratch: replica 0's rank of each slice's data group)."""
    first = comm.rank(engine.group) == 0
    return first and (engine.replicate_group is None or comm.rank(engine.replicate_group) == 0)


def _on_rank_zero(engine: EngineView, full: Tensor) -> Tensor | None:
    """A full checkpoint is written by rank 0: it keeps a CPU copy of each gathered value as it arrives, the other
    ranks nothing, so no rank holds more than one segment beyond its shards ([Note: stage-3 state dict layout])."""
    return full.to("cpu", copy=True) if _keeps_full(engine) else None


def _full(value: Tensor) -> Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


# ---------------------------------------------------------------- model
def model_state_dict(engine: EngineView, sharded: bool) -> dict[str, Any]:
    """``module.state_dict()`` with every parameter full (rank 0; other ranks get ``{}``) or a DTensor."""
    mesh = _mesh(engine) if sharded else None
    values: dict[int, Tensor | None] = {}  # None on the ranks that do not keep a full copy
    for segment in engine.segments:
        for p, full in zip(segment.params, _per_param(engine, segment, segment.shard)):
            values[id(p)] = _to_dtensor(mesh, full) if mesh is not None else _on_rank_zero(engine, full)
    if not sharded and not _keeps_full(engine):
        return {}
    with engine.reading_placeholders():
        state = engine.module.state_dict(keep_vars=True)
    return {k: values.get(id(t), t.detach()) for k, t in state.items()}


def release(engine: EngineView, device: torch.device) -> None:
    """Gather every parameter into a tensor of its own on ``device`` and give the module back (one segment at a time;
    [Note: reading sharded parameters] in ``lightning_zero/zero/stage3/placeholder_reads.py``). Collective."""
    for segment in engine.segments:  # the master values, in the dtype the module had before any cast
        for p, full in zip(segment.params, _per_param(engine, segment, segment.shard)):
            p.data = full.to(device, dtype=segment.module_dtype, copy=True)
    engine.detach_from_module()


def model_template(engine: EngineView) -> dict[str, Any]:
    """What DCP loads a sharded model state into: DTensors for parameters, the module's buffers in place."""
    mesh = _mesh(engine)
    out = {}
    with engine.reading_placeholders():
        state = engine.module.state_dict(keep_vars=True)
    for key, t in state.items():
        if isinstance(t, torch.nn.Parameter):  # in the shard's dtype: master values load without rounding
            out[key] = _template(mesh, t.shape, engine.shard_dtype(t), engine.device)
        else:
            out[key] = t.detach()
    return out


def load_model_state_dict(engine: EngineView, state: dict[str, Any], strict: bool = True) -> None:
    """Load a full or sharded model state (any world size) into the shards; buffers are copied. ``strict``: the keys
    must be the module's state-dict keys exactly (as ``nn.Module.load_state_dict`` checks them), checked before any
    weight changes; otherwise what is missing keeps its value and what is unexpected is ignored."""
    if strict:
        with engine.reading_placeholders():
            expected = set(engine.module.state_dict(keep_vars=True))
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(
                f"the checkpoint's model state does not match the model (strict loading): missing keys {missing},"
                f" unexpected keys {unexpected}"
            )
    for segment in engine.segments:
        for i, (p, name) in enumerate(zip(segment.params, segment.names)):
            if name not in state:
                continue  # strict=False
            value = _full(state[name])
            if value.shape != p.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, but the model's has shape"
                    f" {tuple(p.shape)} (size mismatch)"
                )
            segment.load_param(i, value.to(engine.device))
    for name, buffer in engine.module.named_buffers():
        if name in state and state[name] is not buffer:
            buffer.copy_(state[name])


# ---------------------------------------------------------------- optimizer
def _elementwise(value: Any, shape: torch.Size) -> bool:
    """A per-element optimizer state (a moment), not a scalar such as ``step``."""
    return isinstance(value, Tensor) and value.ndim > 0 and value.shape == shape


def optimizer_state_dict(engine: EngineView, sharded: bool, k: int = 0) -> dict[str, Any]:
    """Optimizer ``k``'s state per parameter (see [Note: stage-3 state dict layout]); collective."""
    optimizer = engine.optimizers[k]
    mesh = _mesh(engine) if sharded else None
    per_param: dict[int, dict[str, Any]] = {}
    for segment in engine.segments:
        shard_state = optimizer.state.get(segment.shard, {})
        entries: list[dict[str, Any]] = [{} for _ in segment.params]
        for key, value in shard_state.items():
            if not _elementwise(value, segment.shard.shape):
                for entry in entries:  # a copy: optimizers update e.g. ``step`` in place
                    entry[key] = value.clone() if isinstance(value, Tensor) else value
                continue
            for entry, full in zip(entries, _per_param(engine, segment, value)):
                entry[key] = _to_dtensor(mesh, full) if mesh is not None else _on_rank_zero(engine, full)
        if shard_state:
            per_param.update({id(p): entry for p, entry in zip(segment.params, entries)})
    hyper = hyperparameters(optimizer.param_groups)
    if sharded:
        names = {id(p): name for s in engine.segments for p, name in zip(s.params, s.names)}
        return {"state": {names[i]: e for i, e in per_param.items()}, "param_groups": hyper}
    numbers, original = _numbering(engine, k), engine.original_groups_of[k]
    state = {numbers[id(p)]: per_param[id(p)] for group in original for p in group if id(p) in per_param}
    groups = [{**hp, "params": [numbers[id(p)] for p in group]} for hp, group in zip(hyper, original)]
    return {"state": state if _keeps_full(engine) else {}, "param_groups": groups}


def _numbering(engine: EngineView, k: int) -> dict[int, int]:
    """The index of each parameter in optimizer ``k``'s unsharded state dict: its position across the groups."""
    return {id(p): n for n, p in enumerate(p for group in engine.original_groups_of[k] for p in group)}


def optimizer_template(engine: EngineView, metadata: Metadata, prefix: str) -> dict[str, Any]:
    """What DCP loads ``prefix``'s sharded optimizer state into, shaped from the checkpoint's index."""
    mesh = _mesh(engine)
    state: dict[str, dict[str, Any]] = {}
    for segment in engine.segments:
        for p, name in zip(segment.params, segment.names):
            head = f"{prefix}.state.{name}."
            for fqn, item in metadata.state_dict_metadata.items():
                key = fqn[len(head) :]
                if not fqn.startswith(head) or "." in key:
                    continue
                entry = state.setdefault(name, {})
                if not isinstance(item, TensorStorageMetadata):
                    entry[key] = None
                elif tuple(item.size) == tuple(p.shape) and p.ndim > 0:
                    entry[key] = _template(mesh, p.shape, item.properties.dtype, engine.device)
                else:
                    entry[key] = torch.empty(item.size, dtype=item.properties.dtype, device=engine.device)
    return {"state": state}


def load_optimizer_state_dict(
    engine: EngineView, state_dict: dict[str, Any], param_groups: list[dict], k: int = 0
) -> None:
    """Load a full (numbered) or sharded (named) state of optimizer ``k`` with ``param_groups``' hyper-parameters."""
    optimizer = engine.optimizers[k]
    check_group_count(len(param_groups), len(optimizer.param_groups))
    numbers = _numbering(engine, k)
    index = {id(shard): i for i, shard in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    sharded_state: dict[int, dict[str, Any]] = {}
    for segment in engine.segments:
        entries = [
            state_dict["state"].get(name, state_dict["state"].get(numbers.get(id(p)), {}))
            for p, name in zip(segment.params, segment.names)
        ]
        if id(segment.shard) not in index or not any(entries):
            continue
        shard_state: dict[str, Any] = {}
        for key, first in entries[0].items():
            if not (isinstance(first, DTensor) or _elementwise(first, segment.params[0].shape)):
                shard_state[key] = first
                continue
            target = torch.zeros_like(segment.shard, dtype=first.dtype)
            for i, (p, name, entry) in enumerate(zip(segment.params, segment.names, entries)):
                value = _full(entry[key])
                if value.shape != p.shape:
                    raise ValueError(
                        f"optimizer state {key!r} of {name!r} has shape {tuple(value.shape)}: expected {tuple(p.shape)}"
                    )
                segment.load_param(i, value.to(engine.device), target)
            shard_state[key] = target
        sharded_state[index[id(segment.shard)]] = shard_state
    groups = [
        {**hp, "params": [index[id(s)] for s in group["params"]]}
        for hp, group in zip(param_groups, optimizer.param_groups)
    ]
    optimizer.load_state_dict({"state": sharded_state, "param_groups": groups})
