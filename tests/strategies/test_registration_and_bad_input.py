"""Registration on import, and settings rejected before any process starts."""

from __future__ import annotations

import importlib
import subprocess
import sys

import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_zero
from lightning_zero import RobustDDPStrategy, ScratchDDPStrategy, ZeroStrategy

NAMES = {
    "ddp_scratch": (ScratchDDPStrategy, {}),
    "ddp_scratch_spawn": (ScratchDDPStrategy, {"start_method": "spawn"}),
    "ddp_scratch_find_unused_parameters_true": (ScratchDDPStrategy, {"find_unused_parameters": True}),
    "zero1_scratch": (ZeroStrategy, {"stage": 1}),
    "zero1_scratch_spawn": (ZeroStrategy, {"stage": 1, "start_method": "spawn"}),
    "zero2_scratch": (ZeroStrategy, {"stage": 2}),
    "zero2_scratch_spawn": (ZeroStrategy, {"stage": 2, "start_method": "spawn"}),
    "zero3_scratch": (ZeroStrategy, {"stage": 3}),
    "zero3_scratch_spawn": (ZeroStrategy, {"stage": 3, "start_method": "spawn"}),
}


def test_import_registers_names_and_reimport_does_not_raise():
    for name, (cls, init_params) in NAMES.items():
        assert StrategyRegistry[name]["strategy"].__qualname__ == cls.__qualname__
        assert StrategyRegistry[name]["init_params"] == init_params
    importlib.reload(lightning_zero)
    assert all(name in StrategyRegistry for name in NAMES)


def test_names_exist_only_after_import_in_a_fresh_interpreter():
    code = (
        "from lightning.pytorch.strategies import StrategyRegistry as R;"
        "before = 'ddp_scratch' in R; import lightning_zero; print(before, 'ddp_scratch' in R)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "True"]


def test_a_name_owned_by_another_package_is_not_clobbered():
    class Foreign(ScratchDDPStrategy):
        pass

    Foreign.__module__ = "someone_else.strategies"
    registry = type(StrategyRegistry)()
    registry.register("ddp_scratch", Foreign)
    with pytest.raises(ValueError, match=r"already registered by someone_else\.strategies\.Foreign"):
        ScratchDDPStrategy.register_strategies(registry)


def test_trainer_builds_the_registered_strategy():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_scratch_spawn", logger=False)
    assert type(trainer.strategy).__name__ == "ScratchDDPStrategy"
    assert trainer.strategy._start_method == "spawn"
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert trainer._accelerator_connector.is_distributed


COMMON_BAD_SETTINGS = [
    ({"process_group_backend": "nvlink"}, "process_group_backend='nvlink' is invalid: expected one of"),
    ({"start_method": "thread"}, "start_method='thread' is invalid: expected one of"),
    ({"timeout": -3}, "timeout=.* is invalid: expected a positive timedelta"),
    ({"find_unused_parameters": "yes"}, "find_unused_parameters='yes' is invalid: expected True or False"),
    ({"broadcast_buffers": 1}, "broadcast_buffers=1 is invalid: expected True or False"),
]
BUCKET_BAD_SETTINGS = [
    ({"bucket_size_mb": 0}, "bucket_size_mb=0 is invalid: expected a number of MiB > 0"),
    ({"bucket_size_mb": -1.5}, "bucket_size_mb=-1.5 is invalid"),
    ({"bucket_size_mb": "25"}, "bucket_size_mb='25' is invalid"),
]


@pytest.mark.parametrize(
    ("strategy", "kwargs", "message"),
    [(s, *case) for s in (ScratchDDPStrategy, RobustDDPStrategy, ZeroStrategy) for case in COMMON_BAD_SETTINGS]
    + [(s, *case) for s in (ScratchDDPStrategy, ZeroStrategy) for case in BUCKET_BAD_SETTINGS],
)
def test_bad_settings_raise_one_clear_value_error(strategy, kwargs, message):
    with pytest.raises(ValueError, match=message):
        strategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 3, "model_init": "eager"}, r"model_init='eager' is invalid: expected one of \('auto', 'full'"),
        ({"stage": 1, "model_init": "full"}, "model_init apply to stage=3 only: got stage=1"),
    ],
)
def test_bad_zero_settings_raise_one_clear_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroStrategy(**kwargs)


@pytest.mark.parametrize(
    ("strategy", "kwargs", "trainer_kwargs", "message"),
    [
        (ZeroStrategy, {"param_dtype": "int8"}, {}, r"param_dtype='int8' is invalid: expected 'auto', one of"),
        (ScratchDDPStrategy, {"master_weights": "yes"}, {}, "master_weights='yes' is invalid: expected True or False"),
        (ZeroStrategy, {"param_dtype": "bf16"}, {}, "needs a low-precision Trainer precision"),
        (ZeroStrategy, {"param_dtype": "fp16"}, {"precision": "bf16-true"}, "conflicts with precision='bf16-true'"),
        (ScratchDDPStrategy, {"param_dtype": "bf16"}, {"precision": "bf16-mixed"}, "this strategy gathers none"),
        (RobustDDPStrategy, {"master_weights": True}, {"precision": "bf16-true"}, "keeps no fp32 master weights"),
        (RobustDDPStrategy, {"reduce_dtype": "bf16"}, {}, "reduce_dtype=torch.bfloat16 is not supported"),
    ],
)
def test_bad_precision_settings_fail_while_the_trainer_is_built(strategy, kwargs, trainer_kwargs, message):
    """Against the Trainer's precision, before any process starts."""
    with pytest.raises(ValueError, match=message):
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy(**kwargs), **trainer_kwargs)


def test_nccl_on_cpu_is_rejected_while_the_trainer_is_built():
    with pytest.raises(ValueError, match="process_group_backend='nccl' needs CUDA devices, but this run uses 'cpu'"):
        L.Trainer(accelerator="cpu", devices=2, strategy=ScratchDDPStrategy(process_group_backend="nccl"))
