"""Our strategies under Ray Train: ``TorchTrainer`` + ``RayLightningEnvironment`` + ``RayTrainReportCallback``.

The parity fit (:mod:`tests.helpers.parity`) runs on a local Ray cluster with two CPU workers and must end with the
weights of the same fit on two torchrun-like processes (:func:`tests.helpers.workers.run_workers`), read back from
the checkpoint Ray reports, and with the same logged loss (measured bit-identical on CPU; the bound is 1e-6).
:func:`lightning_zero.integrations.ray.prepare_trainer`'s checks run in Ray Train's local mode (``num_workers=0``:
the training function runs in this process, with a Ray Train context of one worker).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.train")  # the optional extra: pip install 'lightning-zero[ray]'

import lightning as L
import ray
import torch
from lightning.pytorch.strategies import DDPStrategy
from ray.train import RunConfig, ScalingConfig
from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback
from ray.train.torch import TorchConfig, TorchTrainer

from lightning_zero import ScratchDDPStrategy, ZeroStrategy
from lightning_zero.integrations.ray import prepare_trainer
from tests.helpers.parity import ParityConfig, ParityModule, make_trainer, max_abs_diff, train_loader
from tests.helpers.workers import run_workers

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG = ParityConfig()


class LoggedParityModule(ParityModule):
    """The parity module, logging its training loss so that ``RayTrainReportCallback`` has a metric to report."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def _strategy(name: str) -> ScratchDDPStrategy | ZeroStrategy:
    """``ddp_scratch`` or ``zero<stage>_scratch``; ZeRO writes full checkpoints, the kind Ray can report."""
    if name == "ddp_scratch":
        return ScratchDDPStrategy()
    return ZeroStrategy(stage=int(name[len("zero")]), state_dict_type="full")


def _fit_under_ray(config: dict[str, str]) -> None:
    """Ray's ``train_loop_per_worker``: the parity fit, with an epoch-end checkpoint reported to Ray."""
    torch.set_num_threads(1)
    L.seed_everything(CONFIG.seed, verbose=False)
    trainer = make_trainer(
        CONFIG,
        _strategy(config["strategy"]),
        devices="auto",
        plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback()],
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(LoggedParityModule(CONFIG.lr, CONFIG.optimizer), train_loader(CONFIG))


def _fit_under_torchrun(name: str) -> tuple[dict[str, torch.Tensor], float]:
    """The same fit on a torchrun-like rank: the final weights and this rank's last logged loss."""
    L.seed_everything(CONFIG.seed, verbose=False)
    module = LoggedParityModule(CONFIG.lr, CONFIG.optimizer)
    trainer = make_trainer(CONFIG, _strategy(name))
    trainer.fit(module, train_loader(CONFIG))
    engine = getattr(trainer.strategy, "engine", None)  # ZeRO-3 may keep the model sharded: gather it (collective)
    with engine.summon_full_params() if hasattr(engine, "summon_full_params") else nullcontext():
        weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return weights, trainer.callback_metrics["train_loss"].item()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster of two CPUs whose workers can import ``tests`` (the training function lives here)."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.getenv("PYTHONPATH")]))}
        },
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["zero3_scratch", "ddp_scratch"])
def test_ray_fit_matches_torchrun(ray_cluster: None, tmp_path: Path, name: str) -> None:
    trainer = TorchTrainer(
        _fit_under_ray,
        train_loop_config={"strategy": name},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=str(tmp_path / "ray"), name=name),
    )
    result = trainer.fit()
    (expected, expected_loss), _ = run_workers(_fit_under_torchrun, 2, name)

    assert result.metrics["step"] == CONFIG.optimizer_steps
    assert result.metrics["epoch"] == CONFIG.max_epochs - 1
    assert result.metrics["train_loss"] == pytest.approx(expected_loss, abs=1e-6)
    assert result.checkpoint is not None
    checkpoint = torch.load(
        Path(result.checkpoint.path) / RayTrainReportCallback.CHECKPOINT_NAME, map_location="cpu", weights_only=False
    )
    assert checkpoint["global_step"] == CONFIG.optimizer_steps
    assert max_abs_diff(checkpoint["state_dict"], expected) <= 1e-6


def _check_prepare_trainer() -> None:
    """In Ray Train's local mode: which trainers :func:`prepare_trainer` accepts and which it refuses."""

    def trainer(strategy: Any, report: bool = True) -> L.Trainer:
        callbacks = [RayTrainReportCallback()] if report else []
        return L.Trainer(
            accelerator="cpu",
            devices="auto",
            strategy=strategy,
            plugins=[RayLightningEnvironment()],
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
        )

    for accepted in (ZeroStrategy(stage=3, state_dict_type="full"), ScratchDDPStrategy(), RayDDPStrategy()):
        built = trainer(accepted)
        assert prepare_trainer(built) is built
    built = trainer(ZeroStrategy(stage=3), report=False)  # sharded, but no per-rank checkpoint directories
    assert prepare_trainer(built) is built
    with pytest.raises(ValueError, match="state_dict_type='full'"):
        prepare_trainer(trainer(ZeroStrategy(stage=2)))
    with pytest.raises(ValueError, match="start_method='popen'"):
        prepare_trainer(trainer(ScratchDDPStrategy(start_method="spawn")))
    with pytest.raises(RuntimeError, match="Invalid strategy class"):  # not ours: Ray's own checks
        prepare_trainer(trainer(DDPStrategy()))


@pytest.mark.timeout(120)
def test_prepare_trainer_in_a_ray_worker(ray_cluster: None, tmp_path: Path) -> None:
    run_config = RunConfig(storage_path=str(tmp_path / "ray"), name="prepare_trainer")
    TorchTrainer(_check_prepare_trainer, scaling_config=ScalingConfig(num_workers=0), run_config=run_config).fit()


def test_prepare_trainer_needs_ray_lightning_environment() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=3), logger=False)
    with pytest.raises(RuntimeError, match="RayLightningEnvironment"):
        prepare_trainer(trainer)


def test_missing_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray.train", None)  # what an environment without Ray Train imports
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=3), logger=False)
    with pytest.raises(ImportError, match=r"lightning-zero\[ray\]"):
        prepare_trainer(trainer)
