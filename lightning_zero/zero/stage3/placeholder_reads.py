"""Stage 3: making a read of a placeholder visible.

[Note: reading sharded parameters] Outside its unit's forward and backward a module parameter is a placeholder that
reads as NaN. The root unit is gathered before each step (``ShardedParams.gather_root``), for the parameters a step
uses outside any module's forward (a LightningModule's own); any other read (an L2 penalty over self.parameters() after
the forward) computes with NaN: ZeroStrategy stops a fit whose first loss is not finite, before its backward, and warns
about a logged metric that is NaN (below). A fit that ends hands the full weights back (sharded_params_state.release,
when they fit in memory), and until then a state_dict() of a module holding placeholders raises instead of returning
NaN (:class:`StateDictGuard`).

What is computed from a placeholder is NaN where Lightning's ``ddp`` computes a number: :func:`check_first_loss` stops a
fit whose first loss is not finite, before its backward; :func:`warn_nan_metrics` warns, once per metric, about a logged
metric that is NaN (a weight norm logged in ``on_train_epoch_end``, a metric of a validation step that reads a weight
outside a forward).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_zero.zero.stage3.segments import Segment, Unit, UnitState


def check_first_loss(output: Any, name: str) -> None:
    """Raise before the first backward if the first loss is not finite. One device sync per fit."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if isinstance(loss, Tensor) and not bool(torch.isfinite(loss.detach()).all()):
        raise RuntimeError(
            f"the first training step's loss is {loss.detach().float().flatten()[0].item()} under {name}: a module"
            " parameter outside its unit's forward is a placeholder that reads as NaN, so a step that reads one there"
            " (an L2 penalty over self.parameters(), a weight used outside its module) computes with NaN. Compute it"
            " inside a module's forward (after it, reshard_after_forward=False keeps each unit gathered until its"
            " backward), or use zero1_scratch/zero2_scratch, which keep the whole parameters on every rank."
        )


def warn_nan_metrics(metrics: Mapping[str, Any], name: str, warned: set[str]) -> None:
    """Warn about each metric of ``metrics`` (``trainer.callback_metrics``) that is NaN and not in ``warned``, then add
    it there. One device sync per call."""
    keys = [k for k, v in metrics.items() if k not in warned and isinstance(v, Tensor) and v.is_floating_point()]
    if not keys:
        return
    nan = torch.stack([metrics[k].detach().float().reshape(-1)[:1].squeeze() for k in keys]).isnan().tolist()
    for key in (k for k, is_nan in zip(keys, nan) if is_nan):
        warned.add(key)
        rank_zero_warn(
            f"the logged metric {key!r} is NaN under {name}. If it is computed from module parameters outside a"
            " forward (a weight norm in an epoch-end hook, a weight read in a validation step), it read placeholders:"
            " under ZeRO-3 this rank holds only its shard of them and they read as NaN there, where ddp logs a number."
            " Compute it inside a module's forward, or inside `with trainer.strategy.engine.summon_full_params():` (on"
            " every rank), or use zero1_scratch/zero2_scratch, which keep the whole parameters on every rank."
        )


_PLACEHOLDER_WRITE = "more than one element of the written-to tensor refers to a single memory location"


def explain_placeholder_write(exception: BaseException, name: str) -> None:
    """Add a note to ``exception`` if it is torch's refusal to write into a placeholder."""
    if _PLACEHOLDER_WRITE in str(exception):
        _add_note(
            exception,
            f"{name}: between training steps a module parameter is a placeholder (this rank holds only its shard), so"
            " an in-place write to it (a weight clamp or renorm in a hook or callback) cannot work. ZeRO keeps one"
            " value of each parameter across the ranks and cannot follow writes outside the optimizer ([Note:"
            " parameters changed in place] in lightning_zero/zero/inplace.py): use ddp_scratch, or leave the"
            " parameter to the optimizer.",
        )


def _add_note(exception: BaseException, note: str) -> None:
    """``exception.add_note(note)``, or on Python 3.10, which has no notes, the note appended to its message."""
    if sys.version_info >= (3, 11):
        exception.add_note(note)
    else:
        exception.args = (f"{exception.args[0] if exception.args else ''}\n{note}", *exception.args[1:])


class StateDictGuard:
    """A ``state_dict`` pre-hook that raises when the module holds placeholders ([Note: reading sharded
    parameters]); ``where``: the engine's ``id(param) -> (unit, segment, index)``."""

    def __init__(self, where: Mapping[int, tuple[Unit, Segment, int]]) -> None:
        self._where = where
        self._reading = False

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Inside, ``state_dict()`` of the sharded module is allowed (for code that reads only keys and buffers)."""
        previous, self._reading = self._reading, True
        try:
            yield
        finally:
            self._reading = previous

    def check(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        sharded = [
            name
            for name, p in module.named_parameters(recurse=False)
            if id(p) in self._where and self._where[id(p)][0].state is UnitState.SHARDED
        ]
        if sharded and not self._reading:
            raise RuntimeError(
                f"the parameters of {prefix.rstrip('.') or 'the module'} ({sharded}) are sharded by zero3_scratch: this"
                " rank holds placeholders that read as NaN. Read them inside"
                " `with trainer.strategy.engine.summon_full_params():` (on every rank), or save"
                " `trainer.save_checkpoint(path)`. After a fit the full weights come back into the module when they"
                " fit in memory (ZeroStrategy(model_init=...) decides)."
            )
