"""Shared test hygiene (every test starts and ends with a clean process environment) and ``compose_cfg``.

Lightning's launchers write ``MASTER_ADDR``/``MASTER_PORT``/``LOCAL_RANK``/``WORLD_SIZE``/``NODE_RANK`` and
``seed_everything`` writes ``PL_GLOBAL_SEED`` into ``os.environ``; a leaked ``LOCAL_RANK`` makes the next Trainer
believe its processes were created externally. An in-process fit also leaves the default process group alive.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from lightning_zero.comm.collectives import LEDGER


def _destroy_default_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _clean_process_state() -> Iterator[None]:
    """Snapshot ``os.environ``, start with an empty ledger; afterwards restore both and drop the process group."""
    saved_env = dict(os.environ)
    LEDGER.reset()
    try:
        yield
    finally:
        _destroy_default_process_group()
        LEDGER.reset()
        os.environ.clear()
        os.environ.update(saved_env)


@pytest.fixture
def compose_cfg(tmp_path: Path) -> Iterator:
    """``compose_cfg(*overrides, hydra=False)``: the composed ``train`` config, outputs under ``tmp_path``."""
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_zero.conf", version_base="1.3"):

        def _compose(*overrides: str, hydra: bool = False) -> DictConfig:
            overrides = (f"paths.output_dir={tmp_path}", *overrides)
            return compose(config_name="train", overrides=list(overrides), return_hydra_config=hydra)

        yield _compose
    GlobalHydra.instance().clear()
