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
    quiet_trainer,
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
    """Also the bucket sizes each batch's backward launches (the layout is rebuilt once, after the first
    synchronised pass: [Note: bucket rebuild] in ``lightning_zero/dp/reducer.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bucket_bytes: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.bucket_bytes.append([b.numel() * b.element_size() for b in trainer.strategy.reducer.buffers])


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
    n_params = sum(p.requires_grad for p in module.parameters())
    return {"batches": recorder.batches, "bucket_bytes": recorder.bucket_bytes, "psi": psi, "n_params": n_params}


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
    psi = ledger["psi"]
    batches = ledger["batches"]
    assert len(batches) == ParityConfig().batches_per_rank
    synced = 0
    for batch_idx, (records, bucket_bytes) in enumerate(zip(batches, ledger["bucket_bytes"])):
        assert len(bucket_bytes) > 1
        assert sum(bucket_bytes) == 4 * psi  # fp32 gradients, no padding, nothing else in the buckets
        boundary = (batch_idx + 1) % LEDGER_G == 0 or batch_idx + 1 == len(batches)
        if not boundary:
            assert records == [], f"micro-batch {batch_idx} communicated: {records}"
            continue
        grads = [(op, nbytes) for op, tag, nbytes in records if tag == "grads"]
        assert grads == [("all_reduce", b) for b in bucket_bytes]  # each bucket once, in launch order
        assert sum(nbytes for _, nbytes in grads) == 4 * psi
        # the first synchronised pass broadcasts rank 0's arrival order (the rebuild), and no later one
        order = [("broadcast", "bucket_order", 8 * ledger["n_params"])] if synced == 0 else []
        assert [r for r in records if r[1] != "grads"] == order
        synced += 1


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


class _Buckets(Callback):
    """The gradient buckets at the end of fit by parameter name: ``ddp_scratch``'s, or torch DDP's rebuilt ones
    under Lightning's ``ddp``."""

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        if isinstance(strategy, lightning_zero.ScratchDDPStrategy):
            self.buckets = strategy.reducer.bucket_param_names
            return
        names = [n for n, p in pl_module.named_parameters() if p.requires_grad]
        rebuilt = strategy.model._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
        self.buckets = [[names[int(i)] for i in bucket.split()] for bucket in rebuilt.split(",")]


def _transformer_fit(strategy) -> dict:
    """Lightning's demo ``LightningTransformer`` (a 1000-token vocabulary, so 6.8 MB of gradients: several buckets
    with torch's 1 MiB first one), 3 steps on random tokens."""
    from lightning.pytorch import seed_everything
    from lightning.pytorch.demos import LightningTransformer

    class _OnRandomTokens(LightningTransformer):
        def prepare_data(self) -> None:  # no WikiText2 download
            pass

    seed_everything(0, verbose=False)
    module = _OnRandomTokens(vocab_size=1000)
    tokens = torch.randint(0, 1000, (12, 2, 16), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, 0], tokens[:, 1]), batch_size=2)
    buckets = _Buckets()
    quiet_trainer(strategy, max_steps=3, callbacks=[buckets]).fit(module, loader)
    return {"buckets": buckets.buckets, "weights": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def _transformer_fits() -> dict:
    return {"ours": _transformer_fit("ddp_scratch"), "ddp": _transformer_fit(DDPStrategy())}


@pytest.mark.timeout(300)
def test_buckets_are_rebuilt_as_torch_ddp_rebuilds_them_on_lightnings_transformer():
    """[Note: bucket rebuild] in ``lightning_zero/dp/reducer.py``: after the first step the buckets hold the
    parameters torch DDP's hold under Lightning's ``ddp``, in the same order; the weights stay Lightning's."""
    for rank_result in run_workers(_transformer_fits, 2, timeout=240):
        ours, theirs = rank_result["ours"], rank_result["ddp"]
        assert ours["buckets"] == theirs["buckets"]
        assert len(ours["buckets"]) > 1
        assert max_abs_diff(ours["weights"], theirs["weights"]) <= TOLERANCE


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
