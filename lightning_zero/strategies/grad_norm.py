"""``grad_norm``: what ``lightning.pytorch.utilities.grad_norm`` gives under ``ddp``, under every strategy.

Under ZeRO stage 2 and 3 (and stage 1 with ``grad_sync="microbatch"``) ``p.grad`` is ``None`` when
``on_before_optimizer_step`` runs: the averaged gradient exists only as each rank's shard of it. Use this function
instead of Lightning's, on every rank (it is collective under ZeRO)::

    from lightning_zero import grad_norm

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))

It returns the same keys (``grad_2.0_norm/<name>`` for each parameter that has a gradient under ``ddp``, and
``grad_2.0_norm_total``) and the same values: each rank adds up ``|g|^p`` over its pieces of each parameter and one
all-reduce completes them (``lightning_zero/zero/grad_norm.py``). Under the other strategies it is Lightning's
``grad_norm``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import nn

from lightning_zero.strategies.zero import ZeroStrategy


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Any]:
    """Each parameter's gradient norm and their overall norm, as ``lightning.pytorch.utilities.grad_norm`` computes
    them from ``p.grad``, under every lightning_zero strategy (see the module docstring)."""
    trainer = getattr(module, "_trainer", None)
    strategy = trainer.strategy if trainer is not None else None
    if not isinstance(strategy, ZeroStrategy) or strategy.engine is None:
        return lightning_grad_norm(module, norm_type, group_separator)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type={norm_type!r} is invalid: expected a positive number or 'inf'")
    per_param = strategy.grad_norms(norm_type)
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": per_param[name]
        for name, _ in module.named_parameters()
        if name in per_param
    }
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms
