"""ZeRO-3's view of autograd: which backward pass is running, what it will compute, and when a unit's part is over.

[Note: unit lifecycle] (FSDP2's design, ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``) A unit is gathered
before its forward and freed after it (``reshard_after_forward``); gathered again before its backward (hooks on its
forward outputs); and its gradients are reduce-scattered and it is freed only when its backward is *complete*:

- the gradients of its forward inputs have been computed (:class:`InputsDone`, one hook per forward that had inputs
  requiring grad): the unit's weights, frozen ones included, are needed for those input gradients, so a unit of a
  frozen base weight and trainable adapters (LoRA) is not freed when its adapters' gradients arrive;
- every trainable parameter of the unit that this backward *will* reach (:func:`will_execute` on its gradient
  accumulator) has its gradient: a parameter a rank did not use is not waited for, one that gets its gradient late
  (after the input gradients) is.

Both conditions are decided by the autograd graph of the pass, not by counting gradients, so every rank completes a
unit at the same point of its backward as long as the ranks run the same units. A unit whose inputs need no gradient
(the first one) completes on its parameters alone; one that never completes (an output no loss used) is reduced when
the pass ends.

[Note: graph tasks] Which backward passes count: only a pass that accumulates into ``.grad`` (``loss.backward()``,
``manual_backward``) reduces gradients and ends the engine's pass. ``torch.autograd.grad`` inside a step (a gradient
penalty, MAML's inner step) gathers what it needs and frees it at its end, or, with ``create_graph=True``, keeps every
unit it touched gathered (*pinned*) until the step's own backward ends: the graph it built saved views of their
weights for that backward. A unit is also pinned when the step reads one of its parameters outside the unit's forward
(:class:`GatherOnRead`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


def will_execute(node: Any) -> bool:
    """Whether the running backward pass will execute autograd ``node``. A leaf that ``torch.autograd.grad``
    captures counts as computed (torch refuses the question for it)."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return True


def grad_accumulator(p: Tensor) -> Any:
    """The ``AccumulateGrad`` node of leaf ``p`` (keep a reference: torch keeps it alive only while it is used)."""
    return torch.autograd.graph.get_gradient_edge(p).node


def accumulates(accumulators: Sequence[Any]) -> bool:
    """Whether the running backward pass accumulates into ``.grad`` of any of the leaves of ``accumulators``:
    ``torch.autograd.grad`` never does (its leaves are captured or not executed)."""
    for node in accumulators:
        try:
            if torch._C._will_engine_execute_node(node):
                return True
        except RuntimeError:  # a leaf captured by torch.autograd.grad
            return False
    return False


def current_task() -> int:
    """The id of the running backward pass (-1 outside backward)."""
    return torch._C._current_graph_task_id()


@dataclass
class GraphTask:
    """One backward pass as the engine sees it ([Note: graph tasks])."""

    accumulates: bool
    create_graph: bool
    nested: bool = False  # started while another ran (a reentrant checkpoint's): the outer one decides
    touched: set[int] = field(default_factory=set)  # indices of the units it reached


class InputsDone:
    """Calls ``fn()`` once per backward pass, when the gradients of every tensor of ``tensors`` that the pass will
    compute have been computed (``torch.autograd.graph.register_multi_grad_hook(mode="all")``, whose count also
    covers leaves: torch's refuses the question for a leaf that ``torch.autograd.grad`` captures)."""

    def __init__(self, tensors: Sequence[Tensor], fn: Callable[[], None]) -> None:
        self._nodes = [t.grad_fn if t.grad_fn is not None else grad_accumulator(t) for t in tensors]
        self._fn = fn
        self._seen: dict[int, int] = {}  # task -> gradients still to come
        self._handles = [t.register_hook(self._on_grad) for t in tensors]

    def _on_grad(self, grad: Tensor) -> None:
        task = current_task()
        if task not in self._seen:
            self._seen[task] = sum(will_execute(node) for node in self._nodes)
        self._seen[task] -= 1
        if self._seen[task] == 0:
            del self._seen[task]
            self._fn()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def grad_inputs(args: Any, kwargs: Any) -> list[Tensor]:
    """The tensors among a forward's arguments that require grad (each once)."""
    flat, _ = tree_flatten((args, kwargs))
    seen: dict[int, Tensor] = {}
    for t in flat:
        if isinstance(t, Tensor) and t.requires_grad:
            seen.setdefault(id(t), t)
    return list(seen.values())


METADATA_READS = frozenset(
    {
        "__get__", "__set__", "__delete__", "__hash__", "__len__", "__dir__", "size", "dim", "ndimension", "numel",
        "nelement", "stride", "storage_offset", "is_contiguous", "element_size", "is_floating_point", "is_complex",
        "data_ptr", "get_device", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
        "retain_grad",
    }
)  # fmt: skip
"""Tensor methods and attribute accessors that read no values: they never gather a sharded parameter (``p.grad``,
``p.shape``, ``p.data = ...``, ``optimizer.state[p]``)."""


class GatherOnRead(TorchFunctionMode):
    """While active, an operation that reads the values of a module parameter whose unit is sharded calls
    ``on_read(param)`` first, which gathers and pins that unit ([Note: unit lifecycle]): a parameter read outside its
    unit's forward (``MultiheadAttention`` reading ``out_proj.weight``, an L2 penalty over ``self.parameters()``,
    MAML's fast weights) computes with its full value, as under ``ddp``.

    ``params`` maps ``id(param)`` of every sharded module parameter to anything; ``on_read`` is called for each such
    argument (top level, in a list or tuple argument, or a keyword argument), whatever the state of its unit."""

    def __init__(self, on_read: Callable[[Tensor], None], params: dict[int, Any]) -> None:
        super().__init__()
        self._on_read, self._params = on_read, params

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        params = self._params
        found = [a for a in args if id(a) in params]
        for arg in args:
            if type(arg) in (list, tuple):
                found += [item for item in arg if id(item) in params]
        if kwargs:
            found += [value for value in kwargs.values() if id(value) in params]
        if found and getattr(func, "__name__", "") not in METADATA_READS:
            for param in found:
                self._on_read(param)
        return func(*args, **(kwargs or {}))
