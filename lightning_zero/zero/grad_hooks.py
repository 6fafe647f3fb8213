"""User code that reads or changes ``p.grad`` where ZeRO leaves it ``None``.

[Note: gradients in the hooks] Under ZeRO-2/3 (and ZeRO-1 with ``grad_sync="microbatch"``) the averaged gradient exists
only as this rank's shard, the ``.grad`` of the optimizer's flat parameters; a module parameter's ``p.grad`` is
``None`` in ``on_after_backward`` and ``on_before_optimizer_step`` (the table in docs/guide/drop-in.md). Code there
that clips or scales ``p.grad`` itself (``torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)``,
``p.grad.mul_(0.5)``) then does nothing, silently, where ``ddp`` changes the update, and Lightning's ``grad_norm``
returns nothing. The strategy cannot see what a hook does at run time, so :func:`gradient_reads` looks at the code of
the module's and the callbacks' own overrides of those hooks (their comprehensions and nested functions included) for a
``.grad`` access, torch's clipping functions or Lightning's ``grad_norm``, and the strategy warns at setup. Best
effort: a helper called from the hook is not looked into. ``lightning_zero.grad_norm``, ``gradient_clip_val`` and
``self.clip_gradients`` work on the shards.
"""

from __future__ import annotations

import dis
import types
from collections.abc import Iterable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

HOOKS = ("on_after_backward", "on_before_optimizer_step")
_ATTRIBUTE_OPS = frozenset({"LOAD_ATTR", "STORE_ATTR", "DELETE_ATTR", "LOAD_METHOD"})
_CLIPPING = frozenset({"clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "clip_grads_with_norm_"})


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _reads_gradients(function: types.FunctionType) -> str | None:
    """What in ``function``'s code touches gradients: ``.grad``, a clipping function, Lightning's ``grad_norm``."""
    for code in _code_objects(function.__code__):
        for instruction in dis.get_instructions(code):
            op, name = instruction.opname, instruction.argval
            if name == "grad" and op in _ATTRIBUTE_OPS:
                return "p.grad"
            if name in _CLIPPING:
                return name
            if name == "grad_norm" and op == "LOAD_GLOBAL" and function.__globals__.get(name) is lightning_grad_norm:
                return "lightning.pytorch.utilities.grad_norm"
    return None


def gradient_reads(module: pl.LightningModule, callbacks: Iterable[Any]) -> list[str]:
    """``"<Class>.<hook> uses <what>"`` for each override of :data:`HOOKS` that touches module gradients."""
    found = []
    for owner, base in [(module, pl.LightningModule), *((c, pl.Callback) for c in callbacks)]:
        for hook in HOOKS:
            function = getattr(type(owner), hook, None)
            if isinstance(function, types.FunctionType) and function is not getattr(base, hook):
                what = _reads_gradients(function)
                if what is not None:
                    found.append(f"{type(owner).__name__}.{hook} uses {what}")
    return found
