"""What a pipelined step hands back to Lightning: the batch's loss, its logged values and its outputs.

The user's step runs once per micro-batch on the last stage (where the loss is); Lightning expects one call per
batch. :class:`LogRecorder` stands in for ``LightningModule.log`` during the micro-batches and :func:`combine_logs`
turns its calls into one per name: the size-weighted mean of the micro-batches' values (the batch's value for a
per-sample mean such as a mean loss or an accuracy; ``batch_size`` summed). :func:`weighted_loss` does the same for
the returned loss, :func:`concatenate` joins evaluation and prediction outputs.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device
from lightning.pytorch.core.module import LightningModule
from torch import Tensor
from torchmetrics import Metric

_LOG_PARAMETERS = list(inspect.signature(LightningModule.log).parameters)[1:]  # name, value, prog_bar, ...


class LogRecorder:
    """Records ``self.log`` calls with the weight of the micro-batch running (:attr:`weight`, set by the caller)."""

    def __init__(self) -> None:
        self.weight = 0.0
        self.calls: list[tuple[float, dict[str, Any]]] = []

    def record(self, *args: Any, **kwargs: Any) -> None:
        call = dict(zip(_LOG_PARAMETERS, args), **kwargs)
        value = call["value"]
        values = value.values() if isinstance(value, dict) else [value]
        if any(isinstance(v, Metric) for v in values):
            raise TypeError(
                f"pipeline_scratch cannot log the Metric object {call['name']!r}: a pipeline logs each batch's value"
                " combined over its micro-batches; log metric.compute() or a tensor instead"
            )
        self.calls.append((self.weight, call))


def weighted_loss(outputs: list[Any], weights: list[float]) -> Any:
    """The batch's training-step output: the micro-batches' losses weighted by their share of the batch; a dict
    output keeps the last micro-batch's other entries."""
    losses = [o["loss"] if isinstance(o, dict) else o for o in outputs]
    loss = sum(w * x.detach() for w, x in zip(weights, losses))
    if isinstance(outputs[-1], dict):
        return {**to_device(outputs[-1], "cpu"), "loss": loss.cpu()}
    return loss.cpu()


def combine_logs(recorded: list[tuple[float, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One call per logged name: the weighted mean of its values over the micro-batches that logged it."""
    combined: dict[str, dict[str, Any]] = {}
    totals: dict[str, float] = {}
    for weight, call in recorded:
        name, value = call["name"], call["value"]
        value = value.detach().double().cpu() if isinstance(value, Tensor) else torch.tensor(float(value))
        if name not in combined:
            combined[name] = {**call, "value": value * weight}
            totals[name] = weight
            continue
        combined[name]["value"] = combined[name]["value"] + value * weight
        totals[name] += weight
        if call.get("batch_size") is not None:
            combined[name]["batch_size"] = (combined[name].get("batch_size") or 0) + call["batch_size"]
    for name, call in combined.items():
        call["value"] = (call["value"] / totals[name]).float()
    return list(combined.values())


def concatenate(outputs: list[Any]) -> Any:
    """The micro-batches' step outputs as one: tensors concatenated, ``None`` kept, anything else listed."""
    if all(o is None for o in outputs):
        return None
    if all(isinstance(o, Tensor) and o.dim() for o in outputs):
        return torch.cat([o.detach().cpu() for o in outputs])
    return [to_device(o, "cpu") for o in outputs]


def to_device(value: Any, device: torch.device | str) -> Any:
    return move_data_to_device(apply_to_collection(value, Tensor, Tensor.detach), device)
