"""``RunStats``: per-rank optimizer-step time and model-state bytes of a fit, written to ``run_stats.json``.

Runbook::

    trainer = Trainer(..., callbacks=[lightning_zero.RunStats(output_dir="outputs/run1")])
    # Hydra (conf/callbacks/default.yaml): on by default; drop it with ~callbacks.run_stats

On every rank, each optimizer step is timed from the start of its first micro-batch (``on_train_batch_start``) to
the end of the micro-batch that stepped the optimizer (``on_train_batch_end``, after ``optimizer.step`` and the
strategy's post-step work, before validation and checkpointing); the first ``warmup_steps`` steps are not measured.
On CUDA the device is synchronised at both ends. After every optimizer step the rank's model-state bytes are counted
with :func:`lightning_zero.training.memory.strategy_model_state_bytes` (parameters, gradients, optimizer state, strategy
buffers; each storage once) and the largest total is kept.

At the end of training (``on_train_end``, before the strategy's teardown; collective: every rank takes part) every
rank's figures are gathered and rank 0 writes ``<output_dir>/run_stats.json`` (schema version 1)::

    {
      "schema_version": 1,
      "strategy": {"name": "zero3_scratch", "class": "lightning_zero.strategies.zero.ZeroStrategy"},
      "world_size": 2,
      "accumulate_grad_batches": 1,
      "optimizer_steps": 20,            # optimizer steps this fit ran
      "warmup_steps": 2,                # ... of which the first ones were not timed
      "measured_steps": 18,
      "strategy_buffers_counted": true, # false: the strategy keeps buffers Python cannot see (torch DDP's buckets)
      "median_step_time_ms": 41.2,      # the largest of the ranks' medians (null without measured steps)
      "peak_model_state_mib": 0.52,     # the largest of the ranks' peaks (null when memory is not measured)
      "ranks": [                        # one entry per global rank, in rank order
        {"rank": 0, "median_step_time_ms": 41.2, "measured_steps": 18,
         "step_time_ms": {"min": 39.8, "q1": 40.6, "median": 41.2, "q3": 42.0, "max": 47.5},  # over its steps
         "peak_model_state_mib": 0.52, "peak_step": 3,
         "peak_model_state_bytes": {"params": ..., "grads": ..., "optimizer": ..., "strategy_buffers": ...,
                                    "total": ...}},
        ...
      ]
    }

``step_time_ms`` is the spread of the rank's measured steps (quartiles by the inclusive method, so that
``median`` equals ``median_step_time_ms``; null without measured steps): the figures of ``lightning-zero-report``
draw it as a box, so that run-to-run noise shows beside a difference between strategies.

Each step's time (this rank's; rank 0's is what loggers write) is logged as ``perf/step_time_ms``, so it lands in
``metrics.csv``. The end-of-training summary goes to ``run_stats.json`` only: a key first logged at the end of a fit
breaks Lightning's CSV logger when a spawn-launched ``validate`` appends to the same file afterwards.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_zero.training.memory import ModelStateBytes, strategy_model_state_bytes

SCHEMA_VERSION = 1
FILENAME = "run_stats.json"
MIB = 2**20
# Registered names of Lightning strategy classes that carry no ``strategy_name`` attribute.
_LIGHTNING_NAMES = {"DDPStrategy": "ddp", "ModelParallelStrategy": "model_parallel"}
_QUANTILES = ("min", "q1", "median", "q3", "max")
_FIELDS = (
    *(f"{q}_ms" for q in _QUANTILES),
    "measured",
    "params",
    "grads",
    "optimizer",
    "strategy_buffers",
    "peak_step",
)


def strategy_name(strategy: Any) -> str:
    """The name a strategy is registered under (``"zero2_scratch"``, ``"ddp"``, ...), else its class name."""
    name = getattr(strategy, "strategy_name", None)
    if isinstance(name, str):
        return name
    cls = type(strategy).__name__
    return _LIGHTNING_NAMES.get(cls, cls)


def _buffers_counted(strategy: Any) -> bool:
    """Whether every strategy buffer is visible: a strategy that counts itself, or one that keeps none."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    return callable(getattr(strategy, "model_state_bytes", None)) or isinstance(strategy, SingleDeviceStrategy)


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value


def step_time_quantiles(seconds: list[float]) -> list[float]:
    """Min, first quartile, median, third quartile and max of ``seconds``, in ms (NaN for no steps).

    The inclusive method interpolates between the measured steps, so that the median is ``statistics.median``'s.
    """
    if not seconds:
        return [float("nan")] * len(_QUANTILES)
    ms = sorted(1e3 * s for s in seconds)
    q1, median, q3 = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else ms * 3
    return [ms[0], q1, median, q3, ms[-1]]


class RunStats(pl.Callback):
    """Measures optimizer-step wall time and peak model-state bytes on every rank; rank 0 writes ``run_stats.json``.

    Args:
        output_dir: where ``run_stats.json`` goes (created if missing); default: the Trainer's ``default_root_dir``.
        warmup_steps: optimizer steps at the start of each fit that are not timed (>= 0).
        measure_memory: count model-state bytes after every optimizer step (a walk over parameters and optimizer
            state, outside the timed window).
        log_step_time: log ``perf/step_time_ms`` every step to the loggers.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        warmup_steps: int = 2,
        measure_memory: bool = True,
        log_step_time: bool = True,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} is invalid: expected an integer >= 0")
        self.output_dir = output_dir
        self.warmup_steps = warmup_steps
        self.measure_memory = measure_memory
        self.log_step_time = log_step_time
        self.path: Path | None = None  # where rank 0 wrote the last report
        self.stats: dict[str, Any] | None = None  # the last report (every rank)
        self._reset(0)

    def _reset(self, global_step: int) -> None:
        self.step_times: list[float] = []  # seconds, this rank, warm-up dropped
        self.steps = 0  # optimizer steps seen in this fit
        self.peak: ModelStateBytes | None = None
        self.peak_step = -1
        self._start: float | None = None
        self._last_global_step = global_step

    @staticmethod
    def _sync(trainer: pl.Trainer) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset(trainer.global_step)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._start is None:  # the first micro-batch of an optimizer step
            self._sync(trainer)
            self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_global_step or self._start is None:
            return  # a micro-batch that only accumulated gradients: the step goes on
        self._sync(trainer)
        elapsed = time.perf_counter() - self._start
        self._start = None
        self._last_global_step = trainer.global_step
        self.steps += 1
        if self.steps > self.warmup_steps:
            self.step_times.append(elapsed)
        if self.log_step_time and trainer.loggers:
            pl_module.log("perf/step_time_ms", 1e3 * elapsed, on_step=True, on_epoch=False, batch_size=1)
        if self.measure_memory:
            counted = strategy_model_state_bytes(trainer.strategy)
            if self.peak is None or counted.total > self.peak.total:
                self.peak, self.peak_step = counted, trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        peak = self.peak or ModelStateBytes(0, 0, 0, 0)
        times = step_time_quantiles(self.step_times)
        local = [*times, len(self.step_times), peak.params, peak.grads, peak.optimizer, peak.strategy_buffers]
        # float64 holds byte counts exactly up to 2**53; one small collective gathers every rank's row.
        row = torch.tensor([*local, self.peak_step], dtype=torch.float64, device=strategy.root_device)
        gathered = strategy.all_gather(row).reshape(-1, len(_FIELDS)).cpu().tolist()
        self.stats = self._summary(trainer, gathered)
        if trainer.is_global_zero:
            out = Path(self.output_dir if self.output_dir is not None else trainer.default_root_dir)
            out.mkdir(parents=True, exist_ok=True)
            self.path = out / FILENAME
            tmp = self.path.with_name(f".{FILENAME}.tmp")
            tmp.write_text(json.dumps(self.stats, indent=2) + "\n")
            tmp.replace(self.path)

    def _summary(self, trainer: pl.Trainer, gathered: list[list[float]]) -> dict[str, Any]:
        ranks = []
        for rank, values in enumerate(gathered):
            row = dict(zip(_FIELDS, values))
            counted = ModelStateBytes(*(int(row[k]) for k in ("params", "grads", "optimizer", "strategy_buffers")))
            measured = self.measure_memory and row["peak_step"] >= 0
            ranks.append(
                {
                    "rank": rank,
                    "median_step_time_ms": _finite(row["median_ms"]),
                    "measured_steps": int(row["measured"]),
                    "step_time_ms": {q: row[f"{q}_ms"] for q in _QUANTILES} if row["measured"] else None,
                    "peak_model_state_mib": counted.total / MIB if measured else None,
                    "peak_step": int(row["peak_step"]) if measured else None,
                    "peak_model_state_bytes": counted.as_dict() if measured else None,
                }
            )
        medians = [r["median_step_time_ms"] for r in ranks if r["median_step_time_ms"] is not None]
        peaks = [r["peak_model_state_mib"] for r in ranks if r["peak_model_state_mib"] is not None]
        strategy = trainer.strategy
        return {
            "schema_version": SCHEMA_VERSION,
            "strategy": {
                "name": strategy_name(strategy),
                "class": f"{type(strategy).__module__}.{type(strategy).__name__}",
            },
            "world_size": trainer.world_size,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "optimizer_steps": self.steps,
            "warmup_steps": self.warmup_steps,
            "measured_steps": len(self.step_times),
            "strategy_buffers_counted": _buffers_counted(strategy),
            "median_step_time_ms": max(medians) if medians else None,
            "peak_model_state_mib": max(peaks) if peaks else None,
            "ranks": ranks,
        }
