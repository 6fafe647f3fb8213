"""``ddp_scratch`` against plain single-process PyTorch and Lightning's ``ddp``, on real gloo processes.

One set of worker processes per world size runs every fit the tests below need (processes importing torch and
Lightning cost seconds each on two cores); the tests then assert on the parts.
"""

from __future__ import annotations

import pytest
import torch
import torchmetrics
from lightning.pytorch import Callback
from lightning.pytorch.strategies import DDPStrategy

import lightning_zero
from tests.helpers.parity import (
    ParityConfig,
    ParityModule,
    fit_lightning,
    loss_fn,
    make_trainer,
    max_abs_diff,
    reference_params,
    train_loader,
)
from tests.helpers.probes import LedgerPerBatch
from tests.helpers.workers import run_workers

TOLERANCE = 1e-5
LEDGER_G = 4
SMALL_BUCKET_MB = 512 / 2**20  # 512 bytes: the parity net (467 params) spans several buckets


# (optimizer, accumulate_grad_batches). AdamW with clipping is blind to the gradient's scale, so plain SGD with
# momentum and no clipping runs too: it catches a sum where a mean belongs.
VARIANTS = [("adamw", 1), ("adamw", 3), ("sgd", 3)]


def _config(world_size: int, variant: tuple[str, int]) -> ParityConfig:
    optimizer, g = variant
    if optimizer == "sgd":
        return ParityConfig(world_size, g, optimizer="sgd", gradient_clip_val=None, lr=0.05)
    return ParityConfig(world_size, g)


class _MetricsModule(ParityModule):
    """Logs values whose global reduction is known: the mean rank, a torchmetrics sum, a validation loss."""

    def __init__(self) -> None:
        super().__init__()
        self.rank_sum = torchmetrics.SumMetric()
        self.val_loss_metric = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        self.log("rank_mean", float(self.global_rank), sync_dist=True, on_step=False, on_epoch=True)
        self.rank_sum.update(torch.tensor(self.global_rank + 1.0))
        self.log("rank_sum", self.rank_sum, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        loss = loss_fn(self.net, *batch)
        self.val_loss_metric.update(loss)
        self.log("val_loss_metric", self.val_loss_metric)
        self.log("val_loss_sync", loss, sync_dist=True)


class _LedgerPerBatch(LedgerPerBatch):
    def on_train_end(self, trainer, pl_module):
        reducer = trainer.strategy.reducer
        self.bucket_bytes = [b.numel() * b.element_size() for b in reducer.buffers]


def _val_loader(world_size: int):
    g = torch.Generator().manual_seed(99)
    x, y = torch.randn(world_size * 8, 6, generator=g), torch.randn(world_size * 8, 3, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _fit_metrics(config: ParityConfig) -> dict:
    module = _MetricsModule()
    trainer = make_trainer(config, "ddp_scratch", limit_val_batches=None)
    trainer.fit(module, train_loader(config), _val_loader(config.world_size))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    net = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    return {"metrics": metrics, "net": net}


def _fit_ledger(world_size: int) -> dict:
    config = ParityConfig(world_size=world_size, accumulate_grad_batches=LEDGER_G, max_epochs=1)
    recorder = _LedgerPerBatch()
    module = ParityModule(config.lr)
    strategy = lightning_zero.ScratchDDPStrategy(bucket_size_mb=SMALL_BUCKET_MB)
    trainer = make_trainer(config, strategy, callbacks=[recorder])
    trainer.fit(module, train_loader(config))
    psi = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {"batches": recorder.batches, "bucket_bytes": recorder.bucket_bytes, "psi": psi}


def _all_fits(world_size: int) -> dict:
    """Everything one rank runs; called on every rank by run_workers."""
    out = {}
    for variant in VARIANTS:
        config = _config(world_size, variant)
        out[("ddp_scratch", variant)] = fit_lightning(config, "ddp_scratch")
        out[("ddp", variant)] = fit_lightning(config, DDPStrategy())
    out["ledger"] = _fit_ledger(world_size)
    out["metrics"] = _fit_metrics(ParityConfig(world_size=world_size))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"N{n}")
def fits(request):
    world_size = request.param
    return world_size, run_workers(_all_fits, world_size, world_size, timeout=400)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-g{v[1]}")
def test_parity_with_single_process_reference_and_lightning_ddp(fits, variant):
    world_size, per_rank = fits
    reference = reference_params(_config(world_size, variant))
    ours = per_rank[0][("ddp_scratch", variant)]
    assert max_abs_diff(ours, reference) <= TOLERANCE
    assert max_abs_diff(ours, per_rank[0][("ddp", variant)]) <= TOLERANCE
    # replicas never drift apart
    for rank_result in per_rank[1:]:
        assert max_abs_diff(rank_result[("ddp_scratch", variant)], ours) == 0.0
    # training moved the parameters far more than the tolerance, so the comparison is meaningful
    initial = dict(ParityModule().net.state_dict())
    assert max_abs_diff(ours, initial) > 1e3 * TOLERANCE


@pytest.mark.timeout(600)
def test_ledger_one_pass_per_optimizer_step_and_silence_between(fits):
    _, per_rank = fits
    for rank_result in per_rank:
        _assert_ledger(rank_result["ledger"])


def _assert_ledger(ledger: dict) -> None:
    psi, bucket_bytes = ledger["psi"], ledger["bucket_bytes"]
    assert len(bucket_bytes) > 1
    assert sum(bucket_bytes) == 4 * psi  # fp32 gradients, no padding, nothing else in the buckets
    batches = ledger["batches"]
    assert len(batches) == ParityConfig().batches_per_rank
    for batch_idx, records in enumerate(batches):
        boundary = (batch_idx + 1) % LEDGER_G == 0 or batch_idx + 1 == len(batches)
        if not boundary:
            assert records == [], f"micro-batch {batch_idx} communicated: {records}"
            continue
        grads = [(op, nbytes) for op, tag, nbytes in records if tag == "grads"]
        assert grads == [("all_reduce", b) for b in bucket_bytes]  # each bucket once, in launch order
        assert sum(nbytes for _, nbytes in grads) == 4 * psi


@pytest.mark.timeout(600)
def test_sync_dist_torchmetrics_and_validation_give_global_values(fits):
    world_size, per_rank = fits
    result = per_rank[0]["metrics"]
    metrics = result["metrics"]
    assert metrics["rank_mean"] == pytest.approx((world_size - 1) / 2)
    batches = ParityConfig().batches_per_rank
    assert metrics["rank_sum"] == pytest.approx(batches * world_size * (world_size + 1) / 2)
    # the global validation loss, recomputed here from the final parameters on the whole validation set
    net = ParityModule().net
    net.load_state_dict(result["net"])
    x, y = _val_loader(world_size).dataset.tensors
    with torch.no_grad():
        expected = loss_fn(net, x, y).item()
    assert metrics["val_loss_metric"] == pytest.approx(expected, abs=1e-6)
    assert metrics["val_loss_sync"] == pytest.approx(expected, abs=1e-6)
    for rank_result in per_rank[1:]:
        assert rank_result["metrics"]["metrics"] == metrics


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_parity_on_cuda_with_nccl(monkeypatch):
    from tests.helpers.workers import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    config = ParityConfig(world_size=1, accumulate_grad_batches=3)
    backends = []

    class _Backend(Callback):
        def on_train_start(self, trainer, pl_module):
            backends.append(torch.distributed.get_backend())
            backends.append(next(pl_module.parameters()).device.type)

    ours = fit_lightning(config, "ddp_scratch", accelerator="gpu", devices=1, callbacks=[_Backend()])
    assert backends == ["nccl", "cuda"]
    diff = max_abs_diff(ours, reference_params(config))
    print(f"CUDA/NCCL ddp_scratch vs CPU reference: max abs diff {diff:.2e}")
    assert diff <= TOLERANCE
