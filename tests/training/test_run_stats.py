"""RunStats: step times and exact model-state bytes in run_stats.json, per rank; the shared model-state count."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import RunStats, ScratchDDPStrategy, ZeroStrategy
from lightning_zero.training.memory import strategy_model_state_bytes
from lightning_zero.training.run_stats import step_time_quantiles
from tests.helpers.workers import run_workers

MIB = 2**20


class TinyModule(L.LightningModule):
    """Two linear layers, fp32 AdamW: Ψ = in*hidden + hidden + hidden + 1 parameters in 4 tensors."""

    def __init__(self, width: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader(n: int = 64, width: int = 8, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, 1, generator=g)), batch_size)


def _fit(tmp: Path, strategy: Any = "auto", max_steps: int = 6, accumulate: int = 1, width: int = 8, **kw: Any):
    L.seed_everything(0, verbose=False)
    module = TinyModule(width=width, **kw)
    stats = RunStats(output_dir=tmp, warmup_steps=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        logger=L.pytorch.loggers.CSVLogger(tmp, name="csv", version=""),
        callbacks=[stats],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(module, _loader(width=width))
    return module, stats


def _psi_and_tensors(module: nn.Module) -> tuple[int, int]:
    params = [p for p in module.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), len(params)


def test_single_device_fit_writes_exact_model_states_and_step_times(tmp_path: Path) -> None:
    module, callback = _fit(tmp_path)
    stats = json.loads((tmp_path / "run_stats.json").read_text())
    psi, tensors = _psi_and_tensors(module)
    assert psi == 8 * 16 + 16 + 16 + 1

    assert stats["schema_version"] == 1
    assert stats["strategy"] == {
        "name": "single_device",
        "class": "lightning.pytorch.strategies.single_device.SingleDeviceStrategy",
    }
    assert stats["world_size"] == 1 and stats["strategy_buffers_counted"] is True
    assert (stats["optimizer_steps"], stats["warmup_steps"], stats["measured_steps"]) == (6, 2, 4)
    [rank] = stats["ranks"]
    assert rank["rank"] == 0 and rank["measured_steps"] == 4
    # fp32 AdamW: 4Ψ params + 4Ψ grads + 8Ψ moments (16Ψ), plus AdamW's per-tensor fp32 `step` scalar.
    assert rank["peak_model_state_bytes"] == {
        "params": 4 * psi,
        "grads": 4 * psi,
        "optimizer": 8 * psi + 4 * tensors,
        "strategy_buffers": 0,
        "total": 16 * psi + 4 * tensors,
    }
    assert rank["peak_model_state_mib"] == stats["peak_model_state_mib"] == (16 * psi + 4 * tensors) / MIB
    assert rank["peak_step"] == 1  # the moments exist from the first step on; nothing grows later
    assert 0 < rank["median_step_time_ms"] == stats["median_step_time_ms"] < 10_000
    assert callback.stats == stats

    with (tmp_path / "csv" / "metrics.csv").open() as file:
        rows = list(csv.DictReader(file))
    per_step = [float(r["perf/step_time_ms"]) for r in rows if r.get("perf/step_time_ms")]
    assert len(per_step) == 6 and all(t > 0 for t in per_step)  # every step, warm-up included
    # The spread is that of the measured (logged after the warm-up) steps, its median the reported one.
    measured = sorted(per_step[2:])
    spread = rank["step_time_ms"]
    assert spread["median"] == pytest.approx(rank["median_step_time_ms"], rel=1e-9)
    assert (spread["min"], spread["max"]) == pytest.approx((measured[0], measured[-1]), rel=1e-5)  # logged as fp32
    # Inclusive quartiles of 4 sorted points: at positions 0.75 and 2.25 (of 0..3), interpolated.
    q1, q3 = (measured[0] * 0.25 + measured[1] * 0.75), (measured[2] * 0.75 + measured[3] * 0.25)
    assert (spread["q1"], spread["q3"]) == pytest.approx((q1, q3), rel=1e-5)


def test_accumulation_times_whole_optimizer_steps(tmp_path: Path) -> None:
    _, callback = _fit(tmp_path, max_steps=5, accumulate=3)
    stats = callback.stats
    assert stats is not None
    assert stats["accumulate_grad_batches"] == 3
    assert (stats["optimizer_steps"], stats["measured_steps"]) == (5, 3)  # one time per optimizer step, not per batch


def test_scratch_strategy_counts_itself(tmp_path: Path) -> None:
    """ddp_scratch on one process: the gradients are views of the reducer's buckets, so those add no bytes."""
    module, callback = _fit(tmp_path, strategy=ScratchDDPStrategy())
    psi, tensors = _psi_and_tensors(module)
    stats = callback.stats
    assert stats is not None and stats["strategy"]["name"] == "ddp_scratch"
    assert stats["ranks"][0]["peak_model_state_bytes"] == {
        "params": 4 * psi,
        "grads": 4 * psi,
        "optimizer": 8 * psi + 4 * tensors,
        "strategy_buffers": 0,
        "total": 16 * psi + 4 * tensors,
    }


def test_step_time_quantiles_of_few_steps() -> None:
    assert all(math.isnan(v) for v in step_time_quantiles([]))  # no measured step: null in run_stats.json
    assert step_time_quantiles([0.004]) == [4.0] * 5  # one step: a flat box at its time
    assert step_time_quantiles([0.003, 0.001]) == pytest.approx([1.0, 1.5, 2.0, 2.5, 3.0])  # sorted, interpolated


def test_no_measured_step_has_no_spread(tmp_path: Path) -> None:
    _, callback = _fit(tmp_path, max_steps=2)  # both steps are warm-up
    assert callback.stats is not None
    [rank] = callback.stats["ranks"]
    assert rank["measured_steps"] == 0 and rank["median_step_time_ms"] is None and rank["step_time_ms"] is None


def test_warmup_steps_is_validated() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        RunStats(warmup_steps=-1)


def test_dtensor_parameters_count_their_local_shard() -> None:
    """A strategy without its own count (FSDP2-like): DTensor params, grads and moments count by local shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.helpers.workers import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    weight = nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
    module = SimpleNamespace(parameters=lambda: iter([weight]))
    optimizer = torch.optim.AdamW([weight])
    weight.grad = distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)])
    optimizer.step()
    counted = strategy_model_state_bytes(SimpleNamespace(lightning_module=module, optimizers=[optimizer]))
    assert (counted.params, counted.grads, counted.optimizer, counted.strategy_buffers) == (96, 96, 192 + 4, 0)


# ------------------------------------------------------------------ two ranks
def _two_rank_fits(out: str) -> list[dict[str, Any] | None]:
    """On each worker: one ddp_scratch fit and one zero3_scratch fit, each writing its own run_stats.json."""
    results = []
    for name, strategy in (("ddp_scratch", ScratchDDPStrategy()), ("zero3_scratch", ZeroStrategy(stage=3))):
        L.seed_everything(0, verbose=False)
        callback = RunStats(output_dir=Path(out) / name, warmup_steps=1)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=3,
            logger=False,
            callbacks=[callback],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(TinyModule(width=64, hidden=64), _loader(width=64))
        results.append(callback.stats)
    return results


def test_two_ranks_gather_per_rank_figures(tmp_path: Path) -> None:
    per_worker = run_workers(_two_rank_fits, 2, str(tmp_path))
    psi, tensors = _psi_and_tensors(TinyModule(width=64, hidden=64))
    for i, name in enumerate(("ddp_scratch", "zero3_scratch")):
        stats = json.loads((tmp_path / name / "run_stats.json").read_text())
        assert per_worker[0][i] == per_worker[1][i] == stats  # gathered: every rank holds the same report
        assert stats["strategy"]["name"] == name and stats["world_size"] == 2
        assert [r["rank"] for r in stats["ranks"]] == [0, 1]
        assert all(r["measured_steps"] == 2 and r["median_step_time_ms"] > 0 for r in stats["ranks"])
        for rank in stats["ranks"]:  # each rank's own spread, ordered, around its own median
            spread = rank["step_time_ms"]
            assert 0 < spread["min"] <= spread["q1"] <= spread["median"] <= spread["q3"] <= spread["max"]
            assert spread["median"] == pytest.approx(rank["median_step_time_ms"], rel=1e-9)
        for rank in stats["ranks"]:
            counted = rank["peak_model_state_bytes"]
            states = counted["params"] + counted["grads"] + counted["optimizer"]
            if name == "ddp_scratch":  # 16Ψ on every rank; the gradients are bucket views
                assert counted["strategy_buffers"] == 0
                assert states == 16 * psi + 4 * tensors
            else:  # 16Ψ/N, up to padding of the shards and the optimizer's step scalars
                assert 8 * psi <= states <= 8 * psi * 1.02
