"""The Hydra configs (``lightning_zero.conf``) and the ``lightning-zero-train`` CLI.

In-process: every option of every config group composes through Hydra's compose API, our strategy configs
instantiate, and bad settings (``strategy.stage=4``, an unknown strategy, ``trainer.devices=0``, a misspelt key)
fail with one message naming the value and what is allowed. As subprocesses (Lightning's popen launcher re-executes
``sys.argv`` for rank 1, which inside pytest would re-run pytest): a bad override exits non-zero before training, and
one tiny 2-process ``zero3_scratch`` run exits 0 and leaves its checkpoint, csv metrics and rank-1 log in one run dir.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.utils import instantiate
from omegaconf import OmegaConf

import lightning_zero
from lightning_zero.demo import CharGPTModule, CharTextDataModule
from lightning_zero.tools.config import validate_config
from lightning_zero.tools.config_schema import (
    SCHEMAS,
    ConfigError,
    PipelineStrategyConf,
    RobustDDPStrategyConf,
    ScratchDDPStrategyConf,
    TensorParallelStrategyConf,
    ZeroStrategyConf,
)
from lightning_zero.tools.train import _validate_at_the_end
from tests.helpers.cli import CliRun, cli_env, kill_dumping_stacks, run_cli, stacks_in
from tests.helpers.conf import CONF_DIR, options

GROUPS = ("trainer", "strategy", "model", "data", "optimizer", "callbacks", "logger", "experiment")
OUR_STRATEGIES = ("ddp_scratch", "zero1_scratch", "zero2_scratch", "zero3_scratch")


def test_every_group_has_itsoptions() -> None:
    assert set(options("strategy")) >= {*OUR_STRATEGIES, "ddp"}
    assert set(options("trainer")) >= {"cpu", "gpu", "ddp_sim"}
    assert {"csv", "tensorboard"} <= set(options("logger"))
    for group in (*GROUPS, "hydra"):
        assert options(group), f"conf/{group}/ has no options"


def test_schemas_are_no_config_group_options(compose_cfg) -> None:
    """The ConfigStore holds the schemas at its root: the groups and their options are exactly the YAML files."""
    loader = GlobalHydra.instance().config_loader()
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir() and list(p.glob("*.yaml"))}
    assert set(loader.list_groups("")) == groups | {"hydra"}
    assert loader.get_group_options("strategy") == options("strategy")
    assert set(SCHEMAS) <= set(loader.get_group_options(""))  # stored, at the root
    for name in SCHEMAS:
        with pytest.raises(MissingConfigException) as err:
            compose_cfg(f"strategy={name}")
        assert f"Could not find 'strategy/{name}'" in str(err.value)
        listed = str(err.value).split("Available options in 'strategy':\n")[1].split("Config search path:")[0]
        assert listed.split() == options("strategy")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes_and_validates(compose_cfg, group: str) -> None:
    for option in options(group):
        cfg = compose_cfg(f"{group}={option}")
        validate_config(cfg)
        assert cfg.trainer._target_ == "lightning.pytorch.Trainer"
        assert "_target_" in cfg.strategy and "_target_" in cfg.model and "_target_" in cfg.data


def test_default_is_the_zero3_demo_on_two_cpu_processes(compose_cfg) -> None:
    cfg = compose_cfg()
    assert (cfg.trainer.accelerator, cfg.trainer.devices) == ("cpu", 2)
    assert (cfg.strategy._target_, cfg.strategy.stage) == ("lightning_zero.ZeroStrategy", 3)
    assert cfg.model.block_size == cfg.data.block_size
    assert cfg.optimized_metric == "val/ppl"


@pytest.mark.parametrize("name", [*OUR_STRATEGIES, "robust_ddp_scratch", "pipeline_scratch", "tensor_parallel_scratch"])
def test_our_strategy_configs_are_typed_and_instantiate(compose_cfg, name: str) -> None:
    cfg = compose_cfg(f"strategy={name}")
    schemas = {
        "ddp_scratch": ScratchDDPStrategyConf,
        "robust_ddp_scratch": RobustDDPStrategyConf,
        "pipeline_scratch": PipelineStrategyConf,
        "tensor_parallel_scratch": TensorParallelStrategyConf,
    }
    classes = {
        "ddp_scratch": lightning_zero.ScratchDDPStrategy,
        "robust_ddp_scratch": lightning_zero.RobustDDPStrategy,
        "pipeline_scratch": lightning_zero.PipelineStrategy,
        "tensor_parallel_scratch": lightning_zero.TensorParallelStrategy,
    }
    assert OmegaConf.get_type(cfg.strategy) is schemas.get(name, ZeroStrategyConf)
    strategy = instantiate(cfg.strategy)
    assert type(strategy) is classes.get(name, lightning_zero.ZeroStrategy)
    if name.startswith("zero"):
        assert strategy.stage == int(name[4])


def test_quantized_communication_settings_reach_the_strategy(compose_cfg) -> None:
    cfg = compose_cfg(
        "strategy.quantized_weights=true", "strategy.quantized_grads=true", "strategy.quant_block_size=256"
    )
    validate_config(cfg)
    strategy = instantiate(cfg.strategy)
    assert (strategy.quantized_weights, strategy.quantized_grads, strategy.quant_block_size) == (True, True, 256)


@pytest.mark.parametrize("name", ["zero1_scratch", "zero2_scratch", "zero3_scratch"])
def test_shard_size_reaches_the_strategy(compose_cfg, name) -> None:
    cfg = compose_cfg(f"strategy={name}", "strategy.shard_size=2", "trainer.devices=4")
    validate_config(cfg)
    assert instantiate(cfg.strategy).shard_size == 2


def test_module_class_settings_take_import_paths(compose_cfg) -> None:
    from lightning_zero.demo.model import Block

    cfg = compose_cfg(
        "strategy=zero3_scratch",
        "strategy.auto_wrap_policy=[lightning_zero.demo.model.Block]",
        "strategy.activation_checkpointing_policy=[lightning_zero.demo.model.Block]",
        "strategy.grad_accum_dtype=null",
    )
    strategy = instantiate(cfg.strategy)
    assert strategy.auto_wrap_policy == strategy.activation_checkpointing_policy == {Block}


def test_powersgd_options_compose_and_reach_the_strategy(compose_cfg) -> None:
    """``strategy.powersgd`` is a dict (empty: torch's defaults); options are added with a ``+``."""
    cfg = compose_cfg(
        "strategy=ddp_scratch",
        "strategy.grad_compression=powersgd",
        "+strategy.powersgd.rank=2",
        "+strategy.powersgd.start_iter=10",
    )
    validate_config(cfg)
    strategy = instantiate(cfg.strategy)
    assert (strategy.compression.rank, strategy.compression.start_iter) == (2, 10)
    assert instantiate(compose_cfg("strategy=ddp_scratch").strategy).compression is None


def test_lightning_ddp_config_instantiates(compose_cfg) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    assert type(instantiate(compose_cfg("strategy=ddp").strategy)) is DDPStrategy


def test_lightning_ddp_takes_the_arguments_of_torch_ddp(compose_cfg) -> None:
    """DDPStrategy passes its ``**kwargs`` to DistributedDataParallel: the key check lets those through."""
    cfg = compose_cfg("strategy=ddp", "+strategy.bucket_cap_mb=10", "+strategy.gradient_as_bucket_view=true")
    validate_config(cfg)
    strategy = instantiate(cfg.strategy)
    expected = {"find_unused_parameters": False, "bucket_cap_mb": 10, "gradient_as_bucket_view": True}
    assert strategy._ddp_kwargs == expected


@pytest.mark.timeout(60)
def test_demo_data_model_and_optimizer_instantiate_and_step(compose_cfg) -> None:
    cfg = compose_cfg("data.max_chars=20000", "model.n_layer=1", "model.n_embd=32")
    data = instantiate(cfg.data)
    assert isinstance(data, CharTextDataModule) and data.vocab_size > 50
    data.setup("fit")
    model = instantiate(cfg.model, vocab_size=data.vocab_size, optimizer=instantiate(cfg.optimizer))
    assert isinstance(model, CharGPTModule) and model.net is None  # built in configure_model()
    model.configure_model()
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == (cfg.data.batch_size, cfg.data.block_size)
    assert torch.equal(x[:, 1:], y[:, :-1])
    opt = model.optimizer_factory([p for p in model.parameters()])
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == cfg.optimizer.lr
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    assert abs(loss.item() - torch.log(torch.tensor(float(data.vocab_size))).item()) < 1.5  # near uniform at init


def test_callbacks_and_logger_instantiate(compose_cfg, tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    cfg = compose_cfg()
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    ckpt = next(c for c in callbacks if isinstance(c, ModelCheckpoint))
    assert ckpt.dirpath == str(tmp_path / "checkpoints")
    (logger,) = [instantiate(c) for c in cfg.logger.values()]
    assert isinstance(logger, CSVLogger) and Path(logger.log_dir) == tmp_path / "csv"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy.stage=4"], "stage=4 is invalid: expected 1, 2 or 3"),
        (["strategy=zero2_scratch", "strategy.grad_sync=sometimes"], "grad_sync='sometimes' is invalid"),
        (["strategy=zero1_scratch", "strategy.min_num_params=10"], "apply to stage=3 only: got stage=1"),
        (["strategy.model_init=eager"], "model_init='eager' is invalid: expected one of ('auto', 'full', 'meta')"),
        (["strategy=zero2_scratch", "strategy.model_init=full"], "apply to stage=3 only: got stage=2"),
        (["strategy=ddp_scratch", "strategy.bucket_size_mb=0"], "bucket_size_mb=0.0 is invalid"),
        (["trainer.devices=0"], "trainer.devices=0 is invalid: expected an integer >= 1"),
        (["trainer.num_nodes=0"], "trainer.num_nodes=0 is invalid"),
        (
            ["+trainer.max_stepz=3"],
            "trainer has unknown keys ['max_stepz']: they are not arguments of lightning.pytorch.Trainer;"
            " did you mean trainer.max_steps?",
        ),
        # Keys added with a + (Hydra's own hint for a misspelt key) are not checked by the schema when composed.
        (
            ["strategy=ddp_scratch", "+strategy.bucket_size_m=10"],
            "strategy has unknown keys ['bucket_size_m']: they are not arguments of lightning_zero.ScratchDDPStrategy;"
            " did you mean strategy.bucket_size_mb?",
        ),
        (
            ["+strategy.stagee=3", "+strategy.colour=red"],
            "strategy has unknown keys ['colour', 'stagee']: they are not arguments of lightning_zero.ZeroStrategy;"
            " did you mean strategy.stage?",
        ),
        (
            ["strategy=robust_ddp_scratch", "+strategy.agregator=median"],
            "strategy has unknown keys ['agregator']: they are not arguments of lightning_zero.RobustDDPStrategy;"
            " did you mean strategy.aggregator?",
        ),
        (
            ["strategy=ddp", "+strategy.bucket_size_m=10"],
            "strategy has unknown keys ['bucket_size_m']: they are not arguments of"
            " lightning.pytorch.strategies.DDPStrategy nor of torch.nn.parallel.DistributedDataParallel (its **kwargs);"
            " did you mean strategy.bucket_cap_mb?",
        ),
        (
            ["strategy=ddp", "+strategy.device_ids=[0]"],  # DDPStrategy sets it: a second one would be a TypeError
            "strategy has unknown keys ['device_ids']",
        ),
        (
            ["strategy=fsdp", "+strategy.forward_prefetc=true"],
            "strategy has unknown keys ['forward_prefetc']: they are not arguments of"
            " lightning.pytorch.strategies.FSDPStrategy nor of torch.distributed.fsdp.FullyShardedDataParallel"
            " (its **kwargs); did you mean strategy.forward_prefetch?",
        ),
        (
            ["strategy=fsdp2", "+strategy.data_paralel_size=2"],
            "strategy has unknown keys ['data_paralel_size']: they are not arguments of"
            " lightning.pytorch.strategies.ModelParallelStrategy; did you mean strategy.data_parallel_size?",
        ),
        (
            ["strategy=fsdp2", "strategy._target_=lightning_zero.ModelParallel"],
            "strategy._target_='lightning_zero.ModelParallel' cannot be imported: expected the import path of a class",
        ),
        (["strategy.reduce_dtype=int8"], "reduce_dtype='int8' is invalid: expected 'auto', one of ['bf16'"),
        (["strategy=zero1_scratch", "strategy.grad_accum_dtype=int8"], "grad_accum_dtype='int8' is invalid"),
        (["strategy=zero3_scratch", "strategy.grad_accum_dtype=bf16"], "applies to stages 1 and 2 only: got stage=3"),
        (["strategy=zero2_scratch", "strategy.quantized_weights=true"], "quantized_weights=True apply to stage=3 only"),
        (
            ["strategy=zero3_scratch", "strategy.shard_size=3", "trainer.devices=4"],
            "shard_size=3 does not divide the world size 4: expected one of [1, 2, 4] or None (all ranks)"
            " (trainer.devices=4 x trainer.num_nodes=1)",
        ),
        (["strategy=zero1_scratch", "strategy.shard_size=0"], "shard_size=0 is invalid: expected an integer >= 1"),
        (
            ["strategy=zero3_scratch", "strategy.quant_block_size=0"],
            "quant_block_size=0 is invalid: expected an integer",
        ),
        (
            ["strategy=zero3_scratch", "strategy.quantized_grads=true", "strategy.reduce_dtype=bf16"],
            "reduce_dtype='bf16' conflicts with quantized_grads=True",
        ),
        (
            ["strategy=ddp_scratch", "strategy.activation_checkpointing_policy=[nope.Block]"],
            "activation_checkpointing_policy: cannot import 'nope.Block'",
        ),
        (
            ["strategy=zero1_scratch", "strategy.auto_wrap_policy=[torch.nn.Linear]"],
            "auto_wrap_policy=['torch.nn.Linear'] apply to stage=3 only: got stage=1",
        ),
        (
            ["strategy=zero2_scratch", "strategy.param_dtype=bf16", "trainer.precision=32-true"],
            "with trainer.precision='32-true': param_dtype=torch.bfloat16 needs a low-precision Trainer precision",
        ),
        (
            ["strategy=ddp_scratch", "strategy.param_dtype=bf16", "trainer.precision=bf16-mixed"],
            "this strategy gathers none: pass cast_module=True",
        ),
        (
            ["strategy=robust_ddp_scratch", "strategy.cast_module=true", "trainer.precision=bf16-mixed"],
            "robust_ddp_scratch keeps no fp32 master weights",
        ),
        (
            ["strategy=ddp_scratch", "strategy.grad_compression=zip"],
            "grad_compression='zip' is invalid: expected None or one of ('powersgd',)",
        ),
        (
            ["strategy=ddp_scratch", "+strategy.powersgd.rank=2"],
            "powersgd={'rank': 2} is set but grad_compression=None",
        ),
        (
            ["strategy=ddp_scratch", "strategy.grad_compression=powersgd", "+strategy.powersgd.rank=0"],
            "powersgd rank=0 is invalid: expected an integer >= 1",
        ),
        (
            ["strategy=ddp_scratch", "strategy.grad_compression=powersgd", "+strategy.powersgd.rnak=2"],
            "powersgd has unknown options ['rnak']: expected some of ['rank', 'start_iter'",
        ),
        (
            ["strategy=ddp_scratch", "strategy.grad_compression=powersgd", "strategy.reduce_dtype=bf16"],
            "reduce_dtype='bf16' cannot be combined with grad_compression='powersgd'",
        ),
        (
            ["strategy=pipeline_scratch", "strategy.stages=3"],
            "stages=3 is invalid: expected a divisor of the world size 2",
        ),
        (
            ["strategy=pipeline_scratch", "strategy.balance=[3,2,2]", "trainer.devices=4", "strategy.stages=2"],
            "balance=[3, 2, 2] has 3 entries: expected one per stage, 2 (trainer.devices=4 x trainer.num_nodes=1)",
        ),
        (
            ["strategy=tensor_parallel_scratch", "strategy.tensor_parallel_size=4"],
            "tensor_parallel_size=4 is invalid: expected a divisor of the world size 2",
        ),
        (
            ["strategy=tensor_parallel_scratch", "strategy.plan=lightning_zero.tensor_parallel.NO_SUCH_PLAN"],
            "plan='lightning_zero.tensor_parallel.NO_SUCH_PLAN' is invalid",
        ),
        (
            ["strategy=pipeline_scratch", "strategy.schedule=zero_bubble"],
            "schedule='zero_bubble' is invalid: expected one of ('gpipe', '1f1b')",
        ),
        (
            ["ckpt_path=/nonexistent/last.ckpt"],
            "ckpt_path='/nonexistent/last.ckpt' is invalid: expected null, 'last' (resume from the newest last*.ckpt",
        ),
    ],
)
def test_bad_values_fail_validation_with_a_clear_message(compose_cfg, overrides: list[str], message: str) -> None:
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(cfg)


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (["strategy=zero4_scratch"], MissingConfigException, "Could not find 'strategy/zero4_scratch'"),
        (["strategy=zero_scratch_schema"], MissingConfigException, "Could not find 'strategy/zero_scratch_schema'"),
        (["strategy.stagee=3"], ConfigCompositionException, "strategy.stagee"),  # a typo in a key
        (["strategy.stage=three"], ConfigCompositionException, "strategy.stage=three"),  # a wrong type
    ],
)
def test_bad_overrides_fail_at_composition(compose_cfg, overrides: list[str], error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        compose_cfg(*overrides)


def test_schema_rejects_unknown_keys_in_a_strategy_yaml(compose_cfg) -> None:
    """The typo check also covers values written in a YAML file, not only command-line overrides."""
    cfg = compose_cfg()
    with pytest.raises(Exception, match="bucket_sizes_mb"):
        OmegaConf.merge(cfg.strategy, {"bucket_sizes_mb": 3})


# ---- the CLI as a subprocess ------------------------------------------------------------------------------------


def _assert_refused(result: CliRun, run_dir: Path, message: str, kind: str = "configuration") -> None:
    """Exit non-zero with ``message`` printed once, last, and nothing left on disk: Hydra created the run dir (its
    composed config, an empty log) before main ran, and main removed it."""
    assert result.returncode == 1, result.stdout[-6000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines[-1] == f"lightning-zero-train: invalid {kind}: {message}", result.stdout[-6000:]
    assert result.stdout.count(message) == 1 and "Traceback" not in result.stdout
    assert not run_dir.exists()
    assert not result.leftover


@pytest.mark.timeout(60)
def test_cli_bad_override_exits_non_zero_with_one_message(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(["strategy.stage=4", f"hydra.run.dir={run_dir}"], tmp_path, timeout=45)
    message = "strategy (lightning_zero.ZeroStrategy): stage=4 is invalid: expected 1, 2 or 3"
    _assert_refused(result, run_dir, message)
    assert list(tmp_path.iterdir()) == []
    result = run_cli(["strategy.stage=4"], tmp_path, timeout=45)  # Hydra's own outputs/runs/<time>/, removed too
    _assert_refused(result, tmp_path / "outputs", message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["strategy=zero3_scrach"], "strategy=zero3_scrach is not an option of strategy; did you mean zero3_scratch?"),
        (["-m", "strategy=ddp_scratch,zero4_scratch"], "strategy=zero4_scratch is not an option of strategy; did"),
        (
            ["trainer.max_step=10"],
            "trainer.max_step is not an argument of lightning.pytorch.Trainer; did you mean trainer.max_steps?",
        ),
        (
            ["strategy.stgae=2"],
            "strategy.stgae is not a setting of strategy=zero3_scratch; did you mean strategy.stage?",
        ),
        (
            ["strategy=ddp_scratch", "strategy.bucket_size_m=5"],
            "strategy.bucket_size_m is not a setting of strategy=ddp_scratch; did you mean strategy.bucket_size_mb?",
        ),
    ],
)
def test_cli_misspelt_names_get_did_you_mean_before_hydra_runs(tmp_path: Path, args, message) -> None:
    """Hydra's answer to ``trainer.max_step=10`` is to append it with ``+`` (the wrong key), and to an unknown option
    a list of every option: the command line is checked first, and nothing is written."""
    result = run_cli(args, tmp_path, timeout=60)
    assert result.returncode == 1, result.stdout[-6000:]
    last = [line for line in result.stdout.splitlines() if line.strip()][-1]
    assert last.startswith(f"lightning-zero-train: invalid override: {message}"), result.stdout[-3000:]
    assert "+trainer" not in result.stdout and "Traceback" not in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_more_processes_than_cores_are_warned_about_once_with_the_numbers(caplog, monkeypatch) -> None:
    import torch

    from lightning_zero.tools.train import _set_threads

    threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    try:
        with caplog.at_level("WARNING", logger="lightning_zero.tools.train"):
            _set_threads(OmegaConf.create({"trainer": {"devices": cores + 2, "accelerator": "cpu"}}))
            _set_threads(OmegaConf.create({"trainer": {"devices": cores, "accelerator": "cpu"}}))
        monkeypatch.setenv("LOCAL_RANK", "1")  # an extra rank: rank 0 has said it
        with caplog.at_level("WARNING", logger="lightning_zero.tools.train"):
            _set_threads(OmegaConf.create({"trainer": {"devices": cores + 2, "accelerator": "cpu"}}))
    finally:
        torch.set_num_threads(threads)
    (record,) = caplog.records
    expected = f"trainer.devices={cores + 2} starts {cores + 2} processes x 1 thread(s) on {cores} CPU cores"
    assert record.getMessage().startswith(expected), record.getMessage()


@pytest.mark.timeout(60)
def test_cli_refuses_a_key_added_with_a_plus(tmp_path: Path) -> None:
    """Hydra's hint for ``strategy.bucket_size_m=10`` is ``+strategy.bucket_size_m=10``: refused, not a TypeError."""
    run_dir = tmp_path / "run"
    args = ["strategy=ddp_scratch", "+strategy.bucket_size_m=10", f"hydra.run.dir={run_dir}"]
    result = run_cli(args, tmp_path, timeout=45)
    message = (
        "strategy has unknown keys ['bucket_size_m']: they are not arguments of lightning_zero.ScratchDDPStrategy;"
        " did you mean strategy.bucket_size_mb?"
    )
    _assert_refused(result, run_dir, message)


@pytest.mark.timeout(90)
def test_cli_lists_only_the_strategies_as_options(tmp_path: Path) -> None:
    """``--help`` and Hydra's error for an unknown option list the YAMLs of ``strategy/``, not the schemas."""
    result = run_cli(["--help"], tmp_path, timeout=40)
    assert result.returncode == 0, result.stdout[-6000:]
    assert f"strategy: {', '.join(options('strategy'))}" in result.stdout.splitlines()
    assert "schema" not in result.stdout
    run_dir = tmp_path / "run"
    result = run_cli(["strategy=zero_scratch_schema", f"hydra.run.dir={run_dir}"], tmp_path, timeout=40)
    assert result.returncode == 1
    listed = ", ".join(options("strategy"))
    assert "zero_scratch_schema is not an option of strategy; did you mean" in result.stdout, result.stdout
    assert f"(options: {listed})" in result.stdout, result.stdout
    assert not run_dir.exists()  # refused before Hydra composes or creates the run dir


@pytest.mark.slow  # 30 s; the pipeline's Hydra config is composed and validated in the default run
@pytest.mark.timeout(120)
def test_cli_digits_pipeline_trains_and_both_stages_report_the_same_metrics(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "experiment=digits_pipeline",
        "trainer.max_steps=30",
        "trainer.val_check_interval=15",
        f"hydra.run.dir={run_dir}",
    ]
    result = run_cli(args, tmp_path, timeout=90)
    assert result.returncode == 0, result.stdout[-6000:]
    first, final = map(float, re.search(r"val/loss: first ([\d.]+) \(step 0\), final ([\d.]+)", result.stdout).groups())
    assert final < first
    done = r"rank {} of 2: done, validation metrics (\{{.*\}})"
    rank0 = re.search(done.format(0), result.stdout)
    rank1 = re.search(done.format(1), (run_dir / "train_ddp_process_1.log").read_text())
    assert rank0 is not None and rank1 is not None and rank0.group(1) == rank1.group(1)  # the last stage's, on both
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()  # the whole model, gathered from both stages


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.max_steps=100"], {"val_check_interval": 100}),
        (["trainer.max_steps=60", "+trainer.accumulate_grad_batches=2"], {"val_check_interval": 120}),
        (["trainer.max_steps=400"], {}),  # validates every 200 batches on its own
        (["trainer.max_steps=-1", "trainer.max_epochs=1"], {}),  # no step budget: nothing to move
        (["trainer.max_steps=100", "trainer.val_check_interval=0.5"], {}),  # a fraction of the epoch: the user's
    ],
)
def test_a_run_shorter_than_its_validation_interval_validates_at_its_end(compose_cfg, overrides, expected) -> None:
    cfg = compose_cfg(*overrides)
    assert cfg.trainer.val_check_interval == 200 or "trainer.val_check_interval=0.5" in overrides
    assert _validate_at_the_end(cfg.trainer) == expected


@pytest.mark.timeout(120)
def test_cli_tiny_two_process_zero3_run_writes_one_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "trainer.max_steps=5",  # shorter than the config's validation interval: validates at its last batch
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "model.n_layer=1",
        "model.n_embd=32",
        "data.max_chars=40000",
        f"hydra.run.dir={run_dir}",
    ]
    result = run_cli(args, tmp_path, timeout=90)
    assert result.returncode == 0, result.stdout[-6000:]
    assert not result.leftover, f"processes outlived the run: {result.leftover}"
    assert f"outputs: {run_dir}" in result.stdout
    assert f"(best: {run_dir / 'checkpoints'}" in result.stdout, result.stdout[-3000:]  # not "best: -"
    assert f"logs: {run_dir}/train.log (rank 0) and train_ddp_process_<rank>.log (ranks 1 to 1)" in result.stdout
    first, final = map(float, re.search(r"val/ppl: first ([\d.]+) \(step 0\), final ([\d.]+)", result.stdout).groups())
    assert final < first
    # One run dir holds everything: rank 0's and rank 1's logs, both ranks' checkpoint shards, csv metrics.
    logs = ["train.log", "train_console.log", "train_ddp_process_1.log", "train_ddp_process_1_console.log"]
    assert sorted(p.name for p in run_dir.glob("*.log")) == logs
    assert "rank 1 of 2: done" in (run_dir / "train_ddp_process_1.log").read_text()
    console = (run_dir / "train_console.log").read_text()  # what the console showed: Lightning's, the progress bar
    assert "All distributed processes registered" in console and "Epoch 0: 100%" in console, console[-3000:]
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    last = run_dir / "checkpoints" / "last.ckpt"
    assert (last / "meta.pt").is_file() and len(list(last.glob("*.distcp"))) == 2
    metrics = (run_dir / "csv" / "metrics.csv").read_text()
    assert "train/loss" in metrics.splitlines()[0] and "val/ppl" in metrics.splitlines()[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written elsewhere


@pytest.mark.timeout(180)
def test_cli_ctrl_c_leaves_a_trace_in_the_logs(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the run's process group, as a terminal sends it) during the fit: Lightning shuts down, and
    ``train.log`` says at which step the run was interrupted."""
    run_dir = tmp_path / "run"
    args = ["trainer.max_steps=100000", "model.n_layer=1", "model.n_embd=32", "data.max_chars=40000"]
    cmd = [sys.executable, "-m", "lightning_zero.tools.train", *args, f"hydra.run.dir={run_dir}"]
    # As a terminal starts it: SIGINT at its default. A test session started in the background by a shell without
    # job control (`pytest ... &`, `.ci/run &`) ignores SIGINT, and a process inherits that: Python then installs no
    # KeyboardInterrupt handler, and the run would rightly train on through the Ctrl-C (measured: it did, to epoch 188).
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "Epoch 0" not in _read(run_dir / "train_console.log") and time.monotonic() < deadline:
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            kill_dumping_stacks(proc.pid)
            out = proc.communicate()[0].decode(errors="replace")
            pytest.fail(f"no exit within 60 s of Ctrl-C; the stacks:\n{stacks_in(out)}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    log = (run_dir / "train.log").read_text()
    assert re.search(r"\[ERROR\] - rank 0: interrupted \(Ctrl-C or a signal\) at step \d+, epoch \d+", log), log[-3000:]
    assert proc.returncode != 0


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_crashed_rank_in_the_byzantine_mode_leaves_the_cli_run_to_finish(tmp_path: Path) -> None:
    """4 processes under Lightning's popen launcher, rank 3 exits at step 1 (``crash``): Lightning's child-process
    observer would SIGKILL the job; the mode's launcher lets the others finish, and the run exits 0 naming the rank
    it tolerated (lightning_zero/byzantine/launcher.py, lightning_zero/tools/multirun.py)."""
    pytest.importorskip("cryptography")
    run_dir = tmp_path / "run"
    args = [
        "experiment=robust_digits", "aggregator=median", "trainer.devices=4", "trainer.max_steps=5",
        "trainer.val_check_interval=5", "strategy.byzantine_ranks=1", "strategy.byzantine_timeout=2.0",
        "strategy.workers_per_rank=2", "data.batch_size=32", "callbacks=none",
        "strategy.byzantine_rank_behaviour=crash", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    result = run_cli(args, tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-6000:]
    assert "rank 3 evicted after step 2" in (run_dir / "train.log").read_text()
    assert "exited with code 75: the Byzantine ranks mode had evicted it" in result.stdout, result.stdout[-3000:]
    assert "val/acc" in result.stdout
