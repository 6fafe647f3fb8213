"""``robust_zero1_scratch`` / ``robust_zero2_scratch`` on real gloo processes: the same fit as ``robust_ddp_scratch``
with the same rule (two interleaved param groups, so each rank's columns are several ranges), the ZeRO memory formulas
plus the robust rows, and checkpoints that resume bit-identically and move to ``robust_ddp_scratch`` and back."""

from __future__ import annotations

import os

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_zero
from lightning_zero.comm.collectives import LEDGER
from tests.helpers.parity import (
    ParityConfig,
    ParityModule,
    fit_lightning,
    make_trainer,
    max_abs_diff,
    quiet_trainer,
    reference_params,
    train_loader,
)
from tests.helpers.workers import run_workers

PARITY = ParityConfig(world_size=2, accumulate_grad_batches=3)  # clipping at 0.05: the global norm of the aggregate
K = 2  # workers per rank: n = 4
CASES = {
    "mean": {},
    "trimmed_mean+nnm+momentum/sign_flip": dict(
        aggregator="trimmed_mean", f=1, pre_aggregators=["nnm"], worker_momentum=0.9, attack="sign_flip",
        attack_kwargs={"scale": 3.0}, byzantine_workers=[1],
    ),
    "geometric_median+clip/gaussian": dict(
        aggregator="geometric_median", f=1, pre_aggregators=[{"name": "clip", "c": 0.5}], attack="gaussian",
        attack_kwargs={"std": 2.0},
    ),
}  # fmt: skip


class _MemoryAtLastStep(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.memory = trainer.strategy.model_state_bytes()


def _strategy(kind: str, case: str, **kwargs):
    if kind == "robust_ddp":
        return lightning_zero.RobustDDPStrategy(workers_per_rank=K, **CASES[case], **kwargs)
    return lightning_zero.RobustZeroStrategy(stage=int(kind[-1]), workers_per_rank=K, **CASES[case], **kwargs)


def _fit_all(case: str) -> dict:
    out = {}
    for kind in ("robust_ddp", "robust_zero1", "robust_zero2"):
        memory = _MemoryAtLastStep()
        out[kind] = fit_lightning(PARITY, _strategy(kind, case), callbacks=[memory])
        out[f"{kind}_memory"] = memory.memory.as_dict()
    if case == "mean":
        out["zero2_scratch"] = fit_lightning(PARITY, "zero2_scratch")
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(CASES))
def test_robust_zero_trains_as_robust_ddp_with_the_same_rule(case):
    per_rank = run_workers(_fit_all, 2, case, timeout=300)
    ours = per_rank[0]
    for stage in (1, 2):
        # the same aggregate up to the order of float sums; ZeRO's AdamW on shards is AdamW per element
        assert max_abs_diff(ours[f"robust_zero{stage}"], ours["robust_ddp"]) <= 1e-6, stage
        assert max_abs_diff(per_rank[1][f"robust_zero{stage}"], ours[f"robust_zero{stage}"]) == 0.0
    initial = dict(ParityModule().net.state_dict())
    assert max_abs_diff(ours["robust_zero2"], initial) > 1e-3
    if case == "mean":
        assert max_abs_diff(ours["robust_zero2"], ours["zero2_scratch"]) <= 1e-6
        assert max_abs_diff(ours["robust_zero2"], reference_params(PARITY)) <= 1e-5
    # model-state bytes: ZeRO's formulas (optimizer state 8Ψ/N; gradients 4Ψ at stage 1, 4Ψ/N at stage 2) plus the
    # robust rows: k worker rows, their momentum rows, and the received n x (Ψ/N) columns
    psi = sum(v.numel() for v in initial.values())
    world, n = PARITY.world_size, K * PARITY.world_size
    rows = 4 * psi * K * (2 if "worker_momentum" in CASES[case] else 1)
    ddp, zero1, zero2 = (ours[f"{kind}_memory"] for kind in ("robust_ddp", "robust_zero1", "robust_zero2"))
    padding = 4 * 2 * world  # two flat groups, each padded to a multiple of N
    assert zero1["grads"] == pytest.approx(4 * psi, abs=padding)
    assert zero2["grads"] == pytest.approx(4 * psi / world, abs=padding)
    assert ddp["optimizer"] == pytest.approx(8 * psi, abs=2 * 8 * 4)  # AdamW's step counters: 2 groups x 2 params
    for zero in (zero1, zero2):
        assert zero["optimizer"] == pytest.approx(8 * psi / world, abs=padding + 2 * 8)
        # the received columns are this rank's shard: n x (Ψ/N) values instead of n x Ψ
        assert zero["strategy_buffers"] == pytest.approx(rows + 4 * n * psi / world, abs=n * padding)
    assert ddp["strategy_buffers"] == rows + 4 * n * psi + 0  # unsharded: the whole (n, Ψ) stack


# ------------------------------------------------------------------------------------------------ checkpoints
def _fit_ckpt(kind: str, tmp: str, epochs: int, resume: str | None = None, save: str | None = None, **kwargs):
    L.seed_everything(PARITY.seed, verbose=False)
    module = ParityModule(PARITY.lr, PARITY.optimizer)
    config = ParityConfig(world_size=2, accumulate_grad_batches=3, max_epochs=epochs)
    trainer = make_trainer(config, _strategy(kind, "trimmed_mean+nnm+momentum/sign_flip", **kwargs))
    trainer.fit(module, train_loader(config), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def _checkpoint_runs(tmp: str) -> dict:
    sharded, full = os.path.join(tmp, "zero2_half"), os.path.join(tmp, "zero2_half.ckpt")
    ddp_half = os.path.join(tmp, "ddp_half.ckpt")
    return {
        "straight": _fit_ckpt("robust_zero2", tmp, 2),
        "half": _fit_ckpt("robust_zero2", tmp, 1, save=sharded),
        "resumed": _fit_ckpt("robust_zero2", tmp, 2, resume=sharded),
        "half_full": _fit_ckpt("robust_zero2", tmp, 1, save=full, state_dict_type="full"),
        "ddp_from_zero2": _fit_ckpt("robust_ddp", tmp, 2, resume=full),
        "ddp_half": _fit_ckpt("robust_ddp", tmp, 1, save=ddp_half),
        "zero1_from_ddp": _fit_ckpt("robust_zero1", tmp, 2, resume=ddp_half),
    }


@pytest.mark.timeout(400)
def test_checkpoints_resume_bit_identically_and_move_to_robust_ddp_and_back(tmp_path):
    runs = run_workers(_checkpoint_runs, 2, str(tmp_path), timeout=300)[0]
    assert os.path.isdir(tmp_path / "zero2_half")  # the default: a sharded directory
    assert max_abs_diff(runs["resumed"], runs["straight"]) == 0.0
    assert max_abs_diff(runs["half"], runs["straight"]) > 1e-4
    # the worker momentum rows and the optimizer state travel: the other strategy continues the same fit
    assert max_abs_diff(runs["ddp_from_zero2"], runs["straight"]) <= 1e-6
    assert max_abs_diff(runs["zero1_from_ddp"], runs["straight"]) <= 1e-6


# ------------------------------------------------------------------------------------------------ Lightning's model
def _boring_strategy(kind: str):
    if kind == "ddp":
        return "ddp"
    if kind == "robust_ddp_median":
        return lightning_zero.RobustDDPStrategy(aggregator="median")
    if kind == "robust_zero2_median":
        return lightning_zero.RobustZeroStrategy(stage=2, aggregator="median")
    return lightning_zero.RobustZeroStrategy(stage=int(kind[-1]))


def _boring(kind: str, precision: str = "32-true") -> dict:
    L.seed_everything(0, verbose=False)
    model = BoringModel()
    LEDGER.reset()
    trainer = quiet_trainer(_boring_strategy(kind), max_steps=6, limit_val_batches=0, precision=precision)
    trainer.fit(model)
    calls = LEDGER.calls("all_to_all", "worker_grads")
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "all_to_all": calls}


def _boring_all(_: int) -> dict:
    out = {kind: _boring(kind) for kind in ("ddp", "robust_zero1", "robust_zero2")}
    # bf16-mixed: autocast around the module's own fp32 parameters, as under robust_ddp_scratch (no bf16 gathers)
    return {
        **out,
        **{f"{kind}_bf16": _boring(kind, "bf16-mixed") for kind in ("robust_ddp_median", "robust_zero2_median")},
    }


@pytest.mark.timeout(300)
def test_lightning_boring_model_trains_as_under_lightning_ddp():
    out = run_workers(_boring_all, 2, 0, timeout=240)[0]
    for stage in (1, 2):
        assert max_abs_diff(out[f"robust_zero{stage}"]["weights"], out["ddp"]["weights"]) <= 1e-6
        assert out[f"robust_zero{stage}"]["all_to_all"] == 6  # one per optimizer step (one worker per rank)
    assert max_abs_diff(out["robust_zero2_median_bf16"]["weights"], out["robust_ddp_median_bf16"]["weights"]) <= 1e-6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(stage=3), "stage=3 is invalid for robust ZeRO: expected 1 or 2"),
        (dict(stage=2, grad_sync="microbatch"), "grad_sync='microbatch' is not supported by robust_zero2_scratch"),
        (dict(stage=1, shard_size=1), "shard_size=1 is not supported by robust_zero1_scratch"),
        (dict(sharded_aggregation=False), "sharded_aggregation=False is invalid for robust_zero2_scratch"),
    ],
)
def test_bad_settings_fail_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lightning_zero.RobustZeroStrategy(**kwargs)


def test_names_are_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    for stage in (1, 2):
        entry = StrategyRegistry[f"robust_zero{stage}_scratch"]
        assert entry["strategy"] is lightning_zero.RobustZeroStrategy and entry["init_params"] == {"stage": stage}
        assert StrategyRegistry[f"robust_zero{stage}_scratch_spawn"]["init_params"]["start_method"] == "spawn"
