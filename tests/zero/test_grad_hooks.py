"""Which hook overrides touch module gradients (``lightning_zero/zero/grad_hooks.py``); no processes."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities import grad_norm

import lightning_zero
from lightning_zero.zero.grad_hooks import gradient_reads


class ClipsItself(BoringModel):
    def on_before_optimizer_step(self, optimizer):
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)


class ScalesInAComprehension(BoringModel):
    def on_after_backward(self):
        [p.grad.mul_(0.5) for p in self.parameters() if p.grad is not None]


class LogsLightningsNorms(BoringModel):
    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))


class LogsOurNorms(BoringModel):
    def on_before_optimizer_step(self, optimizer):
        self.log_dict(lightning_zero.grad_norm(self, norm_type=2))


class LogsTheLoss(BoringModel):
    def on_after_backward(self):
        grad = 1.0  # a local of that name is no gradient
        self.log("seen", grad)


class GradientHistograms(L.Callback):
    def on_after_backward(self, trainer, pl_module):
        for p in pl_module.parameters():
            _ = p.grad.norm()


def test_overrides_that_touch_gradients_are_named() -> None:
    assert gradient_reads(ClipsItself(), []) == ["ClipsItself.on_before_optimizer_step uses clip_grad_norm_"]
    assert gradient_reads(ScalesInAComprehension(), []) == ["ScalesInAComprehension.on_after_backward uses p.grad"]
    assert gradient_reads(LogsLightningsNorms(), []) == [
        "LogsLightningsNorms.on_before_optimizer_step uses lightning.pytorch.utilities.grad_norm"
    ]
    assert gradient_reads(BoringModel(), [GradientHistograms()]) == ["GradientHistograms.on_after_backward uses p.grad"]


def test_hooks_that_leave_gradients_alone_and_lightnings_callbacks_are_not() -> None:
    callbacks = [ModelCheckpoint(), EarlyStopping("loss"), LearningRateMonitor()]
    for module in (BoringModel(), LogsOurNorms(), LogsTheLoss()):
        assert gradient_reads(module, callbacks) == []
