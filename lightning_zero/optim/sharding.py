"""The protocol between a ZeRO engine and an optimizer whose step needs more than each element's own values.

[Note: shard-aware optimizers] ZeRO steps each rank's shard of the flattened parameters on its own, which trains as
``ddp`` only for an elementwise update ([Note: elementwise optimizers] in ``lightning_zero/zero/partition.py``). An
optimizer that needs a global quantity or changes the weights between two evaluations of the loss (SAM: the norm of
the whole gradient, then a step to ``w + e`` and back) can still be sharded if the engine supplies those: it
subclasses :class:`ShardAware`, and the engine that shards it calls :meth:`ShardAware.attach_sharding` with a
:class:`Sharding`. Under ``ddp`` (no engine) the optimizer holds the whole parameters and averaged gradients, and
computes everything itself. Its :attr:`ShardAware.base_optimizer` (the elementwise update it ends with) is checked
like any other optimizer.

[Note: zero_grad reaches the engine] An engine that rebuilds the user's optimizer over storage of its own (ZeRO's
shards, ``ddp_scratch``'s fp32 masters) keeps gradients where ``optimizer.zero_grad()`` cannot see them: stage 1's
full flat gradient behind the module's ``p.grad``, stage 2's shard accumulator under ``grad_accum_dtype``, the
buckets of a window not yet reduced, the record of which parameters were used. Under ``ddp`` a ``zero_grad`` drops
that optimizer's gradients whenever it is called: between two backward passes of a GAN's two losses, or to discard a
bad batch without stepping. :func:`restart_on_zero_grad` gives the optimizer a ``zero_grad`` that also restarts
the engine's window of that optimizer's parameters. It replaces the optimizer's class by a subclass of the same name
rather than patching the instance, because Lightning's and Fabric's optimizer wrappers imitate the class of the
optimizer they wrap and so call the class's ``zero_grad``, never an attribute of the instance; the Trainer rewraps its
optimizers after the engine attached them, Fabric wraps them after the strategy set them up.

[Note: toggled-off optimizers] ``LightningModule.toggle_optimizer(opt)`` (and ``opt.toggle_model()``) turns off
``requires_grad`` on the parameters of every other optimizer, which under such an engine are its stand-ins (shards,
masters): the module's parameters keep computing gradients, and autograd adds them in place into a ``p.grad`` the
engine keeps between backward passes (stage 1's full gradient, a window's buckets) before any hook could refuse
them. So the strategies run each backward inside :func:`toggled_off`: a module parameter whose stand-in is turned off
is turned off too, and autograd accumulates nothing into it, as under ``ddp``. Its hook still fires (``requires_grad``
changed after the forward); the reducer ignores it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Sharding:
    """What a ZeRO engine gives a shard-aware optimizer. Both are collective: every rank calls them in the same
    order."""

    grad_norm: Callable[[], Tensor]
    """The 2-norm of the whole averaged gradient (each parameter's norm, then the norm of those, in the optimizer's
    order: ``torch.nn.utils.get_total_norm`` as under ``ddp``)."""
    params_changed: Callable[[], None]
    """After the optimizer wrote its parameters (the shards): make the module compute with the new values."""


class ShardAware(torch.optim.Optimizer):
    """An optimizer that ZeRO may shard although its step is not elementwise ([Note: shard-aware optimizers])."""

    base_optimizer: torch.optim.Optimizer
    """The elementwise optimizer whose update ends each step; it shares this optimizer's param groups and state."""
    sharding: Sharding | None = None
    """Set by the engine that shards this optimizer; ``None`` otherwise."""

    def attach_sharding(self, sharding: Sharding) -> None:
        self.sharding = sharding


RESTART = "_restart_engine_window"
"""The attribute of an optimizer under :func:`restart_on_zero_grad` that holds its engine's restart."""
_PLAIN = "_class_without_restart"
"""The attribute of a class made by :func:`_restarting` that holds the optimizer's own class."""


def restart_on_zero_grad(optimizer: torch.optim.Optimizer, restart: Callable[[], None] | None) -> None:
    """Make ``optimizer.zero_grad()`` call ``restart()`` after its own ([Note: zero_grad reaches the engine]);
    another engine's restart replaces it, ``None`` (the engine removed) ends it."""
    kind = type(optimizer)
    if _PLAIN not in vars(kind):
        optimizer.__class__ = _restarting(kind)
    setattr(optimizer, RESTART, restart)


@cache
def _restarting(kind: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``kind`` with a ``zero_grad`` that restarts the engine's window, under ``kind``'s own name."""

    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        kind.zero_grad(self, set_to_none)
        restart = getattr(self, RESTART, None)  # a Lightning/Fabric wrapper reads it from the optimizer it wraps
        if callable(restart):
            restart()

    def __reduce_ex__(self: Any, protocol: Any) -> Any:  # pickled as the plain optimizer, without the engine
        return _unpickle, (kind, self.__getstate__())

    namespace = {"zero_grad": zero_grad, "__reduce_ex__": __reduce_ex__, _PLAIN: kind}
    namespace.update(__module__=kind.__module__, __qualname__=kind.__qualname__, __doc__=kind.__doc__)
    return type(kind.__name__, (kind,), namespace)


def _unpickle(kind: type[torch.optim.Optimizer], state: dict[str, Any]) -> torch.optim.Optimizer:
    optimizer = kind.__new__(kind)
    optimizer.__setstate__(state)
    return optimizer


@contextmanager
def toggled_off(pairs: Iterable[tuple[nn.Parameter, Tensor]]) -> Iterator[None]:
    """Inside: each module parameter whose stand-in (``pairs``: module parameter, what its optimizer steps) has
    ``requires_grad`` off has it off too ([Note: toggled-off optimizers])."""
    off = [p for p, stand_in in pairs if not stand_in.requires_grad and p.requires_grad]
    for p in off:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in off:
            p.requires_grad_(True)
