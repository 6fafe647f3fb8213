"""One Lightning step through the pipeline: the batch cut into micro-batches, this stage's part of the schedule run
with the user's step once per micro-batch (:func:`run_step`), and the last stage's results on every rank
(:func:`share_results`); ``pipeline_scratch`` runs every step through them.

**What a training step does.** Lightning calls the strategy's ``training_step`` once per batch. The batch is cut into
``micro_batches`` pieces (``lightning_zero/pipeline/stages.py``) and this rank runs its part of the schedule
(``lightning_zero/pipeline/schedule.py``) with :class:`~lightning_zero.pipeline.runtime.PipelineStage`, calling the
module's ``training_step`` once per micro-batch ([Note: running the user's step] in
``lightning_zero/pipeline/runtime.py``). The strategy runs every backward inside that step, each micro-batch's loss
weighted by its share of the batch and divided by ``accumulate_grad_batches`` as Lightning divides a loss; the
``backward`` Lightning then asks for only runs its hooks.

**Logging.** ``self.log`` calls inside the steps are recorded per micro-batch on the last stage (where the loss is),
combined as the size-weighted mean over the micro-batches (the batch's value for a per-sample mean such as a mean
loss or accuracy; ``batch_size`` summed), sent to every rank, and logged there once per batch. A ``Metric`` object
cannot be combined that way and is refused. The step's returned loss is the batch's loss on every rank.

[Note: gradients held for backward] Lightning zeroes the gradients *between* the training step and the backward (at
the start of an accumulation window), while the pipeline runs every backward inside the training step: this step's
gradients wait aside (:class:`HeldGradients`) until the strategy's ``backward`` adds them, as the backward Lightning
expects would.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, NamedTuple

import torch
from lightning.pytorch.core.module import LightningModule
from torch import Tensor

from lightning_zero.comm import collectives as comm
from lightning_zero.pipeline.outputs import LogRecorder, combine_logs, concatenate, weighted_loss
from lightning_zero.pipeline.runtime import PipelineStage
from lightning_zero.pipeline.schedule import Action, build
from lightning_zero.pipeline.stages import split_batch


class HeldGradients:
    """The gradients of the last training step, held aside for the strategy's ``backward`` ([Note: gradients held
    for backward])."""

    def __init__(self) -> None:
        self.grads: list[tuple[Tensor, Tensor | None]] = []

    @contextmanager
    def aside(self, params: Sequence[Tensor]) -> Generator[None, None, None]:
        """``params`` start without gradients; what they have at the end is held, and their earlier gradients
        come back."""
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            self.grads = [(p, p.grad) for p in params]
            for p, grad in zip(params, earlier):
                p.grad = grad

    def add(self) -> None:
        """Add the held gradients to the parameters' own (Lightning's ``backward``), and hold nothing more."""
        with torch.no_grad():
            for p, grad in self.grads:
                if grad is not None:
                    p.grad = grad if p.grad is None else p.grad.add_(grad)
        self.grads = []


class StepRun(NamedTuple):
    """What one step left on this stage: the last stage's outputs and its ``self.log`` calls (with their weights) in
    micro-batch order, and the micro-batches' weights; empty lists elsewhere but the weights."""

    outputs: list[Any]
    logs: list[tuple[float, dict[str, Any]]]
    weights: list[float]


def stage_actions(stage: PipelineStage, schedule: str, micro_batches: int, training: bool) -> list[Action]:
    """This stage's part of ``schedule`` for a training step; every forward in order otherwise."""
    if not training:
        return [Action("F", m) for m in range(micro_batches)]
    return build(schedule, len(stage.ranks), micro_batches)[stage.stage]


def run_step(
    stage: PipelineStage,
    module: LightningModule,
    hook: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    micro_batches: int,
    schedule: str,
    context: AbstractContextManager,
    held: HeldGradients,
    training: bool,
) -> StepRun:
    """Run ``hook`` (a LightningModule step) through the pipeline on the ``micro_batches`` pieces of ``args[0]``,
    inside ``context`` (the precision plugin's step context). A training step runs every backward too, each
    micro-batch's loss weighted by its share of the batch and divided by ``accumulate_grad_batches``; its gradients
    go to ``held``."""
    pieces = split_batch(args[0], micro_batches)
    user_step = getattr(module, hook)
    recorder = LogRecorder()

    def step(piece: Any) -> Any:
        recorder.weight = next(w for p, w in pieces if p is piece)
        return user_step(piece, *args[1:], **kwargs)

    scale = 1.0 / module.trainer.accumulate_grad_batches if training else 1.0
    module.log = recorder.record  # type: ignore[method-assign]  # an instance attribute: log_dict calls it too
    params = [p for p in module.parameters() if p.requires_grad and not p.is_meta] if training else []
    try:
        with held.aside(params), context:
            actions = stage_actions(stage, schedule, len(pieces), training)
            outputs = stage.run(actions, pieces, step, loss_scale=scale)
    finally:
        del module.log
    return StepRun(outputs, recorder.calls, [w for _, w in pieces])


def share_results(run: StepRun, training: bool, last: int, group: Any, is_last: bool) -> tuple[Any, list[dict]]:
    """On every rank of ``group``: the batch's output (a training step's weighted loss, else the micro-batches'
    outputs concatenated) and its logged values combined, from the last stage (global rank ``last``)."""
    payload = None
    if is_last:
        output = weighted_loss(run.outputs, run.weights) if training else concatenate(run.outputs)
        payload = (output, combine_logs(run.logs))
    return comm.broadcast_object(payload, last, group=group, tag="pipeline/outputs")
