"""Running lightning_zero's Trainer strategies under Ray Train (``pip install 'lightning-zero[ray]'``).

Ray's ``TorchTrainer`` starts one process per worker and creates the default process group before
``train_loop_per_worker`` runs; ``ray.train.lightning.RayLightningEnvironment`` then gives Lightning Ray's ranks. Our
strategies take that as they are::

    import lightning as L
    from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback
    from lightning_zero import ZeroStrategy
    from lightning_zero.integrations.ray import prepare_trainer

    def train_loop_per_worker(config):
        trainer = L.Trainer(
            strategy=ZeroStrategy(stage=3, state_dict_type="full"),
            plugins=[RayLightningEnvironment()],
            accelerator="cpu",
            devices="auto",
            callbacks=[RayTrainReportCallback()],
        )
        trainer = prepare_trainer(trainer)
        trainer.fit(model, train_loader)

- Ray sets ``LOCAL_RANK``, so the environment's ``creates_processes_externally`` is true and the default ``popen``
  launcher starts no process.
- ``setup_environment`` finds the process group initialized and reuses it: its backend and timeout are those of
  ``ray.train.torch.TorchConfig``; the strategy's ``process_group_backend`` and ``timeout`` have no effect.
- Each worker is one Trainer with ``devices="auto"``: one CPU, or the GPUs Ray lets the node's workers see. The
  strategy runs on its single device whatever its local rank, and the distributed sampler counts Ray's world size.

Ray's own ``prepare_trainer`` only checks the trainer, and it accepts Ray's strategy classes only.
:func:`prepare_trainer` here checks what matters for ours, and hands any other strategy to Ray's.
"""

from __future__ import annotations

from types import ModuleType

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

from lightning_zero.strategies import ScratchParallelStrategy, ZeroStrategy

INSTALL_HINT = "pip install 'lightning-zero[ray]'"


def _ray_lightning() -> ModuleType:
    """``ray.train.lightning``, imported when first needed: Ray is an optional dependency."""
    try:
        from ray.train import lightning as ray_lightning
    except ImportError as err:
        raise ImportError(f"lightning_zero.integrations.ray needs Ray Train: {INSTALL_HINT}") from err
    return ray_lightning


def prepare_trainer(trainer: pl.Trainer) -> pl.Trainer:
    """Check that ``trainer`` can run a lightning_zero strategy inside a Ray Train worker; return it unchanged.

    Call it in ``train_loop_per_worker`` after building the Trainer, where Ray's ``prepare_trainer`` would be
    called (a strategy that is not lightning_zero's goes to Ray's, with its checks).

    Args:
        trainer: a Trainer built with ``plugins=[RayLightningEnvironment()]``.

    Returns:
        ``trainer``.

    Raises:
        ImportError: Ray Train is not installed.
        RuntimeError: the cluster environment is not ``RayLightningEnvironment``, so the ranks would not be Ray's.
        ValueError: the strategy would start processes of its own (``start_method`` other than ``"popen"``), or is
            a ZeRO strategy saving sharded checkpoints while ``RayTrainReportCallback`` reports them.
    """
    ray_lightning = _ray_lightning()
    strategy = trainer.strategy
    if not isinstance(strategy, ScratchParallelStrategy):
        return ray_lightning.prepare_trainer(trainer)
    name = strategy.strategy_name
    if not isinstance(strategy.cluster_environment, ray_lightning.RayLightningEnvironment):
        raise RuntimeError(
            f"{name} under Ray Train needs Ray's ranks: build the Trainer with"
            f" plugins=[ray.train.lightning.RayLightningEnvironment()], not {type(strategy.cluster_environment)}"
        )
    if isinstance(strategy.launcher, _MultiProcessingLauncher):
        raise ValueError(
            f"{name} under Ray Train: Ray starts the worker processes, so the strategy must not start its own;"
            " use start_method='popen' (the default), which launches nothing when the environment created them"
        )
    reports = any(isinstance(cb, ray_lightning.RayTrainReportCallback) for cb in trainer.callbacks)
    if reports and isinstance(strategy, ZeroStrategy) and strategy.state_dict_type == "sharded":
        # RayTrainReportCallback has every rank save into a directory of its own, then merges the directories in
        # Ray's storage; a sharded save finishes by renaming rank 0's directory only, so the other ranks' shards
        # would stay behind under PATH.partial and the reported checkpoint would miss them.
        raise ValueError(
            f"{name} with state_dict_type='sharded' cannot write the checkpoints RayTrainReportCallback reports (each"
            " rank saves into a directory of its own): pass state_dict_type='full'"
        )
    return trainer
