"""What the ZeRO strategy refuses or warns about, because ZeRO holds the parameters or gradients as shards where
``ddp`` holds them whole: callbacks that change or read sharded parameters, hooks that touch ``p.grad``, parameters
written in place, an optimizer that evaluates the closure twice, and stage 3's reads of placeholders.

:class:`ZeroGuards` sits between :class:`~lightning_zero.strategies.zero_checkpoints.ZeroCheckpointing` (the engine it
asks about) and :class:`~lightning_zero.strategies.zero.ZeroStrategy`, which calls :meth:`ZeroGuards._check_callbacks`
at setup and raises :data:`CLOSURE_TWICE` in its optimizer step.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_zero.strategies.zero_checkpoints import ZeroCheckpointing
from lightning_zero.zero.grad_hooks import HOOKS, gradient_reads
from lightning_zero.zero.inplace import ParamVersions, check_renorming_modules
from lightning_zero.zero.settings import ZeroSettings
from lightning_zero.zero.stage3.placeholder_reads import (
    check_first_loss,
    explain_placeholder_write,
    warn_nan_metrics,
)

_FINETUNING = (
    "such a callback unfreezes parameters during the fit and maps the optimizer's param groups to module parameters,"
    " but ZeRO shards the optimizer over the parameters trainable at setup. Declare them trainable from the start"
    " (requires_grad=True, in their own optimizer param group with lr=0 until they should train), or use ddp_scratch,"
    " which follows such changes."
)
_WEIGHT_AVERAGING = (
    "such a callback reads and writes the module's parameters between steps, where stage 3 holds only this rank's"
    " shard of them (Lightning supports neither under FSDP or DeepSpeed). Use zero1_scratch or zero2_scratch, which"
    " keep the whole parameters on every rank."
)


CLOSURE_TWICE = (
    "{} evaluated the closure a second time in one step under {}: an optimizer that re-evaluates the loss (SAM, a"
    " line search) reads or changes the weights between the two evaluations, which ZeRO holds as shards, so its step"
    " would differ from ddp's. Use lightning_zero.optim.SAM (or implement lightning_zero.optim.ShardAware), or train"
    " with ddp_scratch."
)


class ZeroGuards(ZeroCheckpointing):
    """The checks of a ZeRO fit that ``ddp`` does not need (module docstring). ``settings`` is the subclass's."""

    settings: ZeroSettings

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._first_loss_unchecked = False  # stage 3, fitting: see check_first_loss
        self._nan_metrics_warned: set[str] = set()  # stage 3: see warn_nan_metrics
        self._versions: ParamVersions | None = None  # fitting: [Note: parameters changed in place]

    def _check_callbacks(self, trainer: pl.Trainer) -> None:
        """Refuse, by name and with the way out, the callbacks that change or read parameters ZeRO has sharded; warn
        about hooks that touch gradients ZeRO leaves ``None`` ([Note: gradients in the hooks])."""
        check_renorming_modules(self.lightning_module, self.strategy_name)
        refused = {BaseFinetuning: _FINETUNING}
        if self.stage == 3:
            refused.update({StochasticWeightAveraging: _WEIGHT_AVERAGING, WeightAveraging: _WEIGHT_AVERAGING})
        for kind, why in refused.items():
            found = [type(c).__name__ for c in trainer.callbacks if isinstance(c, kind)]
            if found:
                raise ValueError(f"{self.strategy_name} cannot run {found}: {why}")
        if self.stage >= 2 or self.settings.grad_sync == "microbatch":
            for use in gradient_reads(self.lightning_module, trainer.callbacks):
                rank_zero_warn(
                    f"{use}, but under {self.strategy_name} a module parameter's p.grad is None in"
                    f" {' and '.join(HOOKS)}: the averaged gradient exists only as this rank's shard. Clipping or"
                    " scaling p.grad there changes nothing and Lightning's grad_norm returns nothing, where ddp would"
                    " act on the gradient. Use gradient_clip_val or self.clip_gradients, lightning_zero.grad_norm,"
                    " or ddp_scratch/zero1_scratch (grad_sync='boundary'), where p.grad holds the averaged gradient"
                    " ([Note: gradients in the hooks] in lightning_zero/zero/grad_hooks.py)."
                )

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if self.stage == 3:
            explain_placeholder_write(exception, self.strategy_name)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.lightning_module is not None:  # after any checkpoint was loaded into the parameters
            self._versions = ParamVersions(self.lightning_module, self.strategy_name)

    @contextmanager
    def _writes_checked(self) -> Generator[None, None, None]:
        """Around a training step: refuse parameters written in place since the last step or during it ([Note:
        parameters changed in place] in ``lightning_zero/zero/inplace.py``)."""
        if self._versions is not None:
            self._versions.check("between two training steps (in a hook, a callback or a validation step)")
        yield
        if self._versions is not None:
            self._versions.check("during training_step")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._writes_checked():
            output = super().training_step(*args, **kwargs)
        if self._first_loss_unchecked:
            self._first_loss_unchecked = False
            check_first_loss(output, self.strategy_name)
        return output

    # Stage 3: a logged NaN may be a placeholder read (lightning_zero/zero/stage3/placeholder_reads.py); checked at
    # the start of each training epoch (the previous epoch's end) and at the end of each run.
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if batch_idx == 0:
            self._warn_nan_metrics()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._warn_nan_metrics()

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._warn_nan_metrics()

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        self._warn_nan_metrics()

    def _warn_nan_metrics(self) -> None:
        module = self.lightning_module
        if self._params is not None and module is not None and module._trainer is not None:
            warn_nan_metrics(module.trainer.callback_metrics, self.strategy_name, self._nan_metrics_warned)
