"""What every collective of the shim asks first: the process group's size and this rank's place in it (1 and 0
when no process group is initialised, so single-process code runs the same calls), and the reduce ops by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

ReduceOpName = str  # "sum" | "avg" | "max" | "min" | "product"

LOCAL_REDUCE: dict[str, Callable[[Tensor, Tensor], Any]] = {
    "sum": Tensor.add_,
    "avg": Tensor.add_,
    "mean": Tensor.add_,
    "max": lambda out, x: torch.maximum(out, x, out=out),
    "min": lambda out, x: torch.minimum(out, x, out=out),
}
"""In-place combination of two contributions, for the gloo reduce-scatter substitute and the ring."""

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "mean": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def torch_reduce_op(name: ReduceOpName) -> Any:
    try:
        return REDUCE_OPS[name]
    except KeyError:
        raise ValueError(f"reduce op {name!r} is invalid: expected one of {sorted(REDUCE_OPS)}") from None


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def backend(group: Any = None) -> str:
    """The process group's backend (``"gloo"``, ``"nccl"``, ...), ``"none"`` without one."""
    return str(dist.get_backend(group)) if is_initialized() else "none"


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def global_rank(group_rank: int, group: Any = None) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (the ``src``/``dst`` our collectives take)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def rendezvous_store() -> Any:
    """The default process group's store (the rendezvous every rank joined; hosted by rank 0): where the Byzantine
    ranks mode, which trusts it, publishes public keys and addresses."""
    if not is_initialized():
        raise RuntimeError("the rendezvous store exists only once the process group is initialized")
    return dist.distributed_c10d._get_default_store()
