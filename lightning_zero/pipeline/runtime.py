"""One pipeline stage at run time: runs its schedule's actions, sending activations forward and their gradients back.

[Note: stage tensors] For micro-batch ``m`` a stage holds:

- its **stage input**: the activation received from the previous stage (a leaf that requires a gradient when the
  sender's output did), or, on the first stage, whatever the user's step passes to the layers;
- its **stage output**: what its layers return, sent to the next stage and kept until the backward of ``m``, which
  runs ``torch.autograd.backward(stage output, received gradient)`` (the last stage: the loss's backward instead);
- the **input gradient**: ``stage input.grad`` after that backward, sent back to the previous stage.

Both are dropped after the backward of ``m``, so the activations a stage keeps are those of the micro-batches
between their forward and their backward: all of them under GPipe, at most ``stages - stage`` under 1F1B.

[Note: running the user's step] The stage does not know how the user's step turns a batch into the layers' input and
their output into a loss. So for each forward action the strategy calls the user's ``training_step`` on the
micro-batch, with the pipelined ``nn.Sequential``'s ``forward`` replaced by :meth:`PipelineStage._forward`: on the
first stage it runs the stage's layers on the input the step passes; on the others it ignores that input and runs
them on the activation received. A stage that is not the last sends the result and raises :class:`StageDone`, which
ends the user's step there (what follows is the loss, which only the last stage can compute); the last stage returns
the result and the step computes the loss.

Sends are asynchronous and waited on only at the end of the run: a stage never blocks on a send, only on the
receive of an input its next action needs, so any schedule :func:`lightning_zero.pipeline.schedule.simulate` accepts
runs without deadlock. Each activation goes with a header (:func:`lightning_zero.pipeline.stages.encode_header`)
from which the receiver allocates (the next header's receive is posted as soon as an activation arrives, so that only
the activation itself is waited for when its forward comes); a gradient has its activation's shape. Everything
crosses through :mod:`lightning_zero.comm.collectives` (ledger tags ``pipeline/header``, ``pipeline/activation``,
``pipeline/gradient``).

The stage also measures itself: each action's start, the moment its inputs had arrived, and its end
(:attr:`PipelineStage.timeline`, ``time.perf_counter``, comparable across processes of one host), the most
micro-batches held at once, and, when asked (``measure_activations=True``: a Python call per tensor autograd saves,
so off by default), the bytes autograd saved for backward that were alive at once (:class:`ActivationMeter`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as comm
from lightning_zero.pipeline.schedule import Action
from lightning_zero.pipeline.stages import HEADER_SLOTS, decode_header, encode_header


class StageDone(BaseException):
    """Ends the user's step on a stage that is not the last, once its layers' output is sent. A ``BaseException``,
    so a step's own ``except Exception`` does not swallow it."""


class ActivationMeter:
    """Bytes of the tensors autograd saves for backward (each storage once; the parameters' own storage left out),
    alive now (:attr:`live`) and at most since :meth:`reset` (:attr:`peak`)."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._refs: dict[int, int] = {}
        self._excluded: set[int] = set()

    def reset(self, parameters: Sequence[Tensor]) -> None:
        self.peak = self.live
        self._excluded = {p.untyped_storage().data_ptr() for p in parameters if not p.is_meta}

    @contextmanager
    def counting(self) -> Generator[None, None, None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, tensor: Tensor) -> Any:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._excluded or tensor.is_meta:
            return tensor
        return _Saved(tensor, self, ptr, storage.nbytes())

    def _add(self, ptr: int, nbytes: int) -> None:
        count = self._refs.get(ptr, 0)
        if not count:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._refs[ptr] = count + 1

    def _remove(self, ptr: int, nbytes: int) -> None:
        self._refs[ptr] -= 1
        if not self._refs[ptr]:
            del self._refs[ptr]
            self.live -= nbytes


class _Saved:
    """A tensor autograd saved, counted by its meter while the graph keeps it."""

    __slots__ = ("_meter", "_nbytes", "_ptr", "tensor")

    def __init__(self, tensor: Tensor, meter: ActivationMeter, ptr: int, nbytes: int) -> None:
        self.tensor, self._meter, self._ptr, self._nbytes = tensor, meter, ptr, nbytes
        meter._add(ptr, nbytes)

    def __del__(self) -> None:
        self._meter._remove(self._ptr, self._nbytes)


def _unpack(saved: Any) -> Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved


@dataclass(frozen=True)
class ActionTime:
    """When one action ran: ``start`` (the stage turned to it), ``ready`` (its input had arrived), ``end``."""

    kind: str
    micro_batch: int
    start: float
    ready: float
    end: float


class PipelineStage:
    """Stage ``stage`` of ``stages``: the layers ``indices`` of ``layers``, on global rank ``ranks[stage]``.

    Args:
        layers: the pipelined ``nn.Sequential`` (the other stages' layers may be meta-device placeholders).
        indices: the positions of this stage's layers in ``layers``.
        stage, ranks: this stage's index and the global rank of every stage.
        device: where received activations are allocated.
        group: the process group the point-to-point calls go through.
        measure_activations: count the bytes autograd saves for backward on this stage (:attr:`meter`).
    """

    def __init__(
        self,
        layers: nn.Sequential,
        indices: range,
        stage: int,
        ranks: Sequence[int],
        device: torch.device,
        group: Any = None,
        measure_activations: bool = False,
    ) -> None:
        self.layers, self.indices, self.stage, self.ranks = layers, indices, stage, list(ranks)
        self.device, self.group = device, group
        self.is_first, self.is_last = stage == 0, stage == len(self.ranks) - 1
        self.meter = ActivationMeter() if measure_activations else None
        self.timeline: list[ActionTime] = []
        self.peak_micro_batches = 0
        self._inputs: dict[int, Tensor] = {}
        self._outputs: dict[int, Tensor] = {}
        self._sends: list[tuple[comm.Handle, Tensor]] = []
        self._current: int | None = None
        self._headers_left = 0  # activations still to receive in this run
        self._next_header: tuple[Tensor, comm.Handle] | None = None  # its header's receive, posted ahead
        self._ready = 0.0

    # ------------------------------------------------------------ one run of a schedule
    def run(
        self,
        actions: Sequence[Action],
        micro_batches: Sequence[tuple[Any, float]],
        step: Callable[[Any], Any],
        loss_scale: float = 1.0,
    ) -> list[Any]:
        """Run ``actions`` (this stage's part of a schedule; forwards only outside training). ``step(micro_batch)``
        is the user's step; on the last stage it returns the step's output, whose loss the backward of that
        micro-batch differentiates with weight ``micro-batch weight * loss_scale``. Returns the last stage's step
        outputs in micro-batch order (empty elsewhere)."""
        self.timeline, self.peak_micro_batches = [], 0
        if self.meter is not None:
            self.meter.reset(list(self.layers.parameters()))
        counting = self.meter.counting() if self.meter is not None else nullcontext()
        outputs: dict[int, Any] = {}
        losses: dict[int, Tensor] = {}
        training = any(kind == "B" for kind, _ in actions)
        self._headers_left = 0 if self.is_first else sum(kind == "F" for kind, _ in actions)
        try:
            with self._patched_forward(), counting:
                for kind, m in actions:
                    start = self._ready = time.perf_counter()
                    if kind == "F":
                        out = self._run_forward(m, micro_batches[m][0], step)
                        if self.is_last:
                            outputs[m] = out
                            if training:
                                losses[m] = _loss_of(out, m)
                    else:
                        self._run_backward(m, losses.pop(m, None), micro_batches[m][1] * loss_scale)
                    self.timeline.append(ActionTime(kind, m, start, self._ready, time.perf_counter()))
        finally:
            for handle, _ in self._sends:
                handle.wait()
            self._sends, self._inputs, self._outputs, self._current = [], {}, {}, None
            self._next_header = None  # posted only while activations are still to come: none after a full run
        return [outputs[m] for m in sorted(outputs)]

    def _run_forward(self, m: int, micro_batch: Any, step: Callable[[Any], Any]) -> Any:
        self._current = m
        try:
            out = step(micro_batch)
        except StageDone:
            out = None
        if m not in self._inputs:
            raise RuntimeError(
                f"pipeline_scratch: the step of micro-batch {m} never called the pipelined layers on stage"
                f" {self.stage}: every step must pass its input through them once"
            )
        if not torch.is_grad_enabled() or not self._held(m):
            self._inputs.pop(m, None)
        self.peak_micro_batches = max(self.peak_micro_batches, len(self._inputs))
        return out

    def _held(self, m: int) -> bool:
        out = self._outputs.get(m)
        return self.is_last or (out is not None and out.requires_grad)

    def _run_backward(self, m: int, loss: Tensor | None, weight: float) -> None:
        if self.is_last:
            if loss is not None and loss.requires_grad:
                (loss * weight).backward()
        elif m in self._outputs:
            output = self._outputs.pop(m)
            if output.requires_grad:
                grad = torch.empty_like(output)
                self._recv(grad, self.ranks[self.stage + 1], "pipeline/gradient")
                self._ready = time.perf_counter()
                torch.autograd.backward(output, grad)
        stage_input = self._inputs.pop(m, None)
        if not self.is_first and stage_input is not None and stage_input.requires_grad:
            grad = stage_input.grad if stage_input.grad is not None else torch.zeros_like(stage_input)
            self._send(grad, self.ranks[self.stage - 1], "pipeline/gradient")

    # ------------------------------------------------------------ the layers' forward, as the user's step calls it
    @contextmanager
    def _patched_forward(self) -> Generator[None, None, None]:
        self.layers.forward = self._forward  # type: ignore[method-assign]  # an instance attribute: nn.Module calls it
        try:
            yield
        finally:
            del self.layers.forward

    def _forward(self, x: Any) -> Any:
        m = self._current
        if m is None or m in self._inputs:
            raise RuntimeError(
                "pipeline_scratch: the step called the pipelined layers twice for one micro-batch: a pipeline runs each"
                " micro-batch through them once"
            )
        if not self.is_first:
            x = self._receive_activation()
        self._inputs[m] = x
        for i in self.indices:
            x = self.layers[i](x)
        if self.is_last:
            return x
        if not isinstance(x, Tensor):
            raise TypeError(
                f"pipeline_scratch: stage {self.stage} returned a {type(x).__name__}: a stage passes one tensor to the"
                " next"
            )
        next_rank = self.ranks[self.stage + 1]
        self._send(encode_header(x), next_rank, "pipeline/header")
        self._send(x.detach(), next_rank, "pipeline/activation")
        if x.requires_grad:
            self._outputs[m] = x
        raise StageDone

    def _receive_activation(self) -> Tensor:
        previous = self.ranks[self.stage - 1]
        header, pending = self._next_header or self._post_header(previous)
        pending.wait()
        dtype, requires_grad, shape = decode_header(header)
        x = torch.empty(shape, dtype=dtype, device=self.device)
        self._recv(x, previous, "pipeline/activation")
        self._ready = time.perf_counter()
        self._headers_left -= 1
        # The next activation's header is received ahead: when its forward comes, only the activation itself is
        # waited for (one message on the critical path instead of two).
        self._next_header = self._post_header(previous) if self._headers_left > 0 else None
        return x.requires_grad_(requires_grad and torch.is_grad_enabled())

    def _post_header(self, src: int) -> tuple[Tensor, comm.Handle]:
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        return header, comm.recv(header, src, group=self.group, tag="pipeline/header")

    # ------------------------------------------------------------ point to point
    def _send(self, tensor: Tensor, dst: int, tag: str) -> None:
        """Start a send and keep the tensor alive until the run's end (headers are built on the CPU: NCCL takes
        device tensors only, so they are moved first)."""
        tensor = tensor.to(self.device) if tensor.device != self.device else tensor
        self._sends.append((comm.send(tensor, dst, group=self.group, tag=tag), tensor))

    def _recv(self, tensor: Tensor, src: int, tag: str) -> None:
        buffer = tensor.to(self.device) if tensor.device != self.device else tensor
        comm.recv(buffer, src, group=self.group, tag=tag).wait()
        if buffer is not tensor:
            tensor.copy_(buffer)


def _loss_of(output: Any, m: int) -> Tensor:
    """The loss in a step's output: the tensor itself or its ``"loss"`` entry."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"pipeline_scratch: the training step of micro-batch {m} returned {type(output).__name__}: expected the"
            " loss tensor or a dict with a 'loss' tensor (a pipeline cannot skip a micro-batch)"
        )
    return loss
