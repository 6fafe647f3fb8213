"""Sharpness-aware minimisation (Foret et al., "Sharpness-Aware Minimization for Efficiently Improving
Generalization", ICLR 2021) that trains the same under ``ddp`` and every ZeRO stage.

Runbook::

    def configure_optimizers(self):
        return lightning_zero.optim.SAM(self.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)

    Trainer(strategy="zero2_scratch")  # or ddp, ddp_scratch, zero1_scratch, zero3_scratch

Each step evaluates the loss twice through Lightning's closure: at ``w`` (gradient ``g``), then at ``w + e`` with
``e = rho * g / ||g||``; the base optimizer then steps ``w`` with the second gradient. ``||g||`` is the norm of the
whole averaged gradient: under ZeRO the engine takes it across the shards, and makes the module compute with the
perturbed shards before the second evaluation ([Note: shard-aware optimizers] in
``lightning_zero/optim/sharding.py``). A SAM written the usual way computes that norm from each rank's shard alone,
so ZeRO refuses it (it is not a ``torch.optim`` optimizer) and points here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils import get_total_norm

from lightning_zero.optim.sharding import ShardAware


class SAM(ShardAware):
    """Args:
    params: the parameters (or param groups) to optimize.
    base_optimizer: the class of the elementwise optimizer that takes the step (default ``torch.optim.SGD``).
    rho: radius of the neighbourhood (>= 0; ``rho=0`` is the base optimizer, evaluated twice).
    **kwargs: for ``base_optimizer`` (``lr``, ``momentum``, ...).

    The base optimizer shares this optimizer's param groups and state, so LR schedulers, checkpoints and ZeRO's
    sharding of the state see one optimizer."""

    def __init__(
        self,
        params: Iterable[Any],
        base_optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
        rho: float = 0.05,
        **kwargs: Any,
    ) -> None:
        if not rho >= 0:
            raise ValueError(f"rho={rho!r} is invalid: expected a number >= 0")
        super().__init__(params, {"rho": rho, **kwargs})
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.base_optimizer.state = self.state  # one state: checkpoints and ZeRO's sharding see all of it

    def _grad_norm(self) -> Tensor:
        if self.sharding is not None:
            return self.sharding.grad_norm()
        return get_total_norm([p.grad for group in self.param_groups for p in group["params"] if p.grad is not None])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is None:
            raise ValueError("SAM evaluates the loss twice per step: call step(closure) (Lightning does)")
        loss = torch.enable_grad()(closure)()
        norm = self._grad_norm()
        weights: list[tuple[Tensor, Tensor]] = []
        for group in self.param_groups:
            scale = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                if p.grad is not None:
                    weights.append((p, p.detach().clone()))
                    p.add_(p.grad * scale.to(p.grad.dtype))
        if self.sharding is not None:
            self.sharding.params_changed()
        self.zero_grad()  # under ZeRO it restarts the engine's window too ([Note: zero_grad reaches the engine])
        torch.enable_grad()(closure)()  # the gradient at w + e
        for p, w in weights:
            p.copy_(w)
        self.base_optimizer.step()
        return loss
