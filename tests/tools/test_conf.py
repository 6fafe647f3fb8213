"""Every option of every config group composes *and* instantiates; the groups added for issue 5 work for real.

``tests/tools/test_cli.py`` checks that every option composes and validates and that our strategy configs instantiate;
here every option is composed and then turned into objects the way ``lightning-zero-train`` does (data, model from
the data's ``model_kwargs()``, optimizer, callbacks, loggers, strategy, and a ``Trainer`` holding that strategy).
The options that cannot become a ``Trainer`` on a CPU machine say why where they are special-cased.

The new groups are also exercised: ``strategy=fsdp2`` shards the demo models with FSDP2 (in-process on 1 process;
as a 2-process CLI run in the slow set), ``logger=tensorboard`` writes an events file, the digits data and MLP
train above chance in-process, and ``hparams_search=optuna`` runs a 2-trial sweep through the real CLI.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from omegaconf import DictConfig, OmegaConf

from lightning_zero.comm.link_model import Link, LinkModel
from lightning_zero.demo import CharGPTModule, CharTextDataModule, DigitsDataModule, DigitsMLPModule
from lightning_zero.demo.digits import load_digits_arrays
from lightning_zero.tools.config import validate_config
from lightning_zero.tools.config_schema import ConfigError
from tests.helpers.cli import cli_env, run_cli
from tests.helpers.conf import CONF_DIR, REPO_ROOT, options

# Every group of train.yaml's defaults list that holds job settings (hydra/ holds Hydra's own run-dir settings and
# is part of every composition below).
GROUPS = (
    "trainer", "strategy", "aggregator", "attack", "data", "model", "optimizer", "callbacks", "logger", "experiment",
    "hparams_search",
)  # fmt: skip
# Overrides that make an option usable: each model with its data, the char data kept small.
COMPANIONS = {
    ("data", "digits"): ["model=digits_mlp"],
    ("model", "digits_mlp"): ["data=digits"],
    # aggregator/ and attack/ set keys of strategy=robust_ddp_scratch: n = 2 processes x 4 workers = 8
    **{(group, o): ["experiment=robust_digits"] for group in ("aggregator", "attack") for o in options(group)},
    ("aggregator", "bulyan"): ["experiment=robust_digits", "strategy.f=1"],  # n >= 4f + 3
}
SMALL_CHAR_DATA = ["data.max_chars=20000", "model.n_layer=1", "model.n_embd=32"]
QUIET = ["trainer.enable_progress_bar=false", "~callbacks.progress_bar"]
HAS_OPTUNA = importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None
HAS_TENSORBOARD = any(importlib.util.find_spec(m) is not None for m in ("tensorboardX", "tensorboard"))
NEEDS_OPTUNA = 'the optuna extra is not installed: pip install "lightning-zero[optuna]"'


def _overrides_for(group: str, option: str) -> list[str]:
    overrides = [f"{group}={option}", *COMPANIONS.get((group, option), [])]
    digits = "data=digits" in overrides or any(o.startswith("experiment=") for o in overrides)
    return overrides + ([] if digits else SMALL_CHAR_DATA)


def _build(cfg: DictConfig, trainer_overrides: dict[str, Any] | None = None) -> SimpleNamespace:
    """Instantiate ``cfg`` the way ``lightning-zero-train`` does (with ``datamodule.model_kwargs()``)."""
    data = instantiate(cfg.data)
    optimizer = instantiate(cfg.optimizer) if cfg.get("optimizer") else None
    model = instantiate(cfg.model, optimizer=optimizer, **data.model_kwargs())
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    strategy = instantiate(cfg.strategy)
    trainer = None
    if isinstance(strategy, FSDPStrategy) and not torch.cuda.is_available():
        # Lightning's FSDP (FSDP1) is GPU-only: it refuses a CPU accelerator when the Trainer is built, so on this
        # machine only the strategy object is instantiated and the refusal is checked.
        with pytest.raises(InstantiationException, match="The strategy `fsdp` requires a GPU accelerator"):
            instantiate(cfg.trainer, strategy=strategy, logger=False)
    else:
        trainer = instantiate(
            cfg.trainer, strategy=strategy, callbacks=callbacks, logger=loggers or False, **(trainer_overrides or {})
        )
        assert trainer.strategy is strategy
    return SimpleNamespace(
        data=data, model=model, callbacks=callbacks, loggers=loggers, strategy=strategy, trainer=trainer
    )


def test_every_yaml_says_what_it_is() -> None:
    for path in sorted(CONF_DIR.rglob("*.yaml")):
        lines = [line for line in path.read_text().splitlines() if not line.startswith("# @package")]
        assert lines and lines[0].startswith("# "), f"{path.relative_to(REPO_ROOT)} starts without a comment"


def test_the_issue_5_options_exist() -> None:
    assert {"fsdp", "fsdp2", "ddp"} <= set(options("strategy"))
    assert {"csv", "tensorboard"} <= set(options("logger"))
    assert "digits" in options("data") and "digits_mlp" in options("model")
    assert "digits_mlp" in options("experiment") and options("hparams_search") == ["optuna"]


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore::DeprecationWarning:optuna.*")  # optuna 2.10 on SQLAlchemy 1.4's 2.0 warnings
@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_instantiates(compose_cfg, group: str, option: str) -> None:
    if group == "hparams_search" and not HAS_OPTUNA:
        pytest.skip(NEEDS_OPTUNA)  # hydra/sweeper=optuna does not even compose without the plugin
    cfg = compose_cfg(*_overrides_for(group, option))
    validate_config(cfg)
    if group == "trainer" and cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        # trainer=gpu as shipped needs CUDA ("No supported gpu backend found"); every other key is checked by
        # building the same Trainer on one CPU process.
        built = _build(cfg, trainer_overrides={"accelerator": "cpu", "devices": 1})
    else:
        built = _build(cfg)
    assert isinstance(built.strategy, get_class(cfg.strategy._target_)) and isinstance(built.strategy, Strategy)
    assert isinstance(built.model, L.LightningModule) and isinstance(built.data, L.LightningDataModule)
    if built.trainer is not None:
        expected = 1 if group == "trainer" and cfg.trainer.accelerator == "gpu" else cfg.trainer.devices
        assert built.trainer.num_devices == expected
    if group == "logger":
        assert built.loggers and all(Path(lg.log_dir).parent == Path(cfg.paths.output_dir) for lg in built.loggers)
    if group == "callbacks":
        assert len(built.callbacks) == len(cfg.callbacks or {})
    if group == "optimizer":
        opt = built.model.optimizer_factory([torch.nn.Parameter(torch.zeros(2))])
        assert isinstance(opt, get_class(cfg.optimizer._target_)) and opt.defaults["lr"] == cfg.optimizer.lr
    if group in ("data", "model"):  # one real batch through the model
        built.data.setup("fit")
        built.model.configure_model()
        x, y = next(iter(built.data.train_dataloader()))
        assert built.model(x).shape[:-1] == y.shape
    if group == "hparams_search":
        hydra_cfg = compose_cfg(*_overrides_for(group, option), hydra=True).hydra
        assert str(hydra_cfg.mode) == "RunMode.MULTIRUN" and hydra_cfg.sweeper.direction == "minimize"
        assert type(instantiate(hydra_cfg.sweeper.sampler)).__name__ == "TPESampler"
        for key in hydra_cfg.sweeper.params:  # the searched keys exist in the job config
            assert OmegaConf.select(cfg, key) is not None, key


def test_checkpoints_follow_the_optimized_metric(compose_cfg) -> None:
    assert compose_cfg().callbacks.model_checkpoint.monitor == "val/ppl"
    cfg = compose_cfg("experiment=digits_mlp")
    assert cfg.optimized_metric == cfg.callbacks.model_checkpoint.monitor == "val/loss"
    assert (cfg.trainer.devices, cfg.data._target_, cfg.model._target_) == (
        1,
        "lightning_zero.demo.DigitsDataModule",
        "lightning_zero.demo.DigitsMLPModule",
    )


def test_data_modules_give_their_models_what_they_need() -> None:
    """The uniform interface: ``model(**datamodule.model_kwargs())``; ``val_history`` of ``history_metric``."""
    pairs = [(CharTextDataModule(max_chars=20000), CharGPTModule), (DigitsDataModule(), DigitsMLPModule)]
    for data, module in pairs:
        kwargs = data.model_kwargs()
        assert set(kwargs) <= set(inspect.signature(module).parameters)
        model = module(**kwargs)
        assert model.val_history == [] and model.history_metric in ("val/ppl", "val/loss")
    assert pairs[0][0].model_kwargs() == {"vocab_size": pairs[0][0].vocab_size}
    assert pairs[1][0].model_kwargs() == {"in_features": 64, "num_classes": 10}


# ---- strategy=fsdp / fsdp2 ----------------------------------------------------------------------------------------


def test_fsdp_wraps_each_block(compose_cfg) -> None:
    from lightning_zero.demo.model import Block

    strategy = instantiate(compose_cfg("strategy=fsdp").strategy)
    assert isinstance(strategy, FSDPStrategy)
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {Block}


@pytest.mark.parametrize(
    "overrides",
    [
        ["strategy.link_model={inter_node:{alpha_s:5e-5,bandwidth:10gbit}}"],
        ["+strategy.link_model.inter_node.alpha_s=5e-5", "+strategy.link_model.inter_node.bandwidth=10gbit"],
    ],
)
def test_ddp_scratch_takes_a_declared_link_model(compose_cfg, overrides: list[str]) -> None:
    cfg = compose_cfg("strategy=ddp_scratch", *overrides)
    validate_config(cfg)
    assert instantiate(cfg.strategy).link_model == LinkModel(inter_node=Link(5e-5, 8e-10))
    bad = compose_cfg("strategy=ddp_scratch", "strategy.link_model={inter_node:{alpha_s:5e-5}}")
    with pytest.raises(ConfigError, match=r"link_model.inter_node=.* expected a mapping of alpha_s"):
        validate_config(bad)


def test_fsdp_takes_the_arguments_of_torch_fsdp(compose_cfg) -> None:
    """FSDPStrategy passes its ``**kwargs`` to FullyShardedDataParallel: the key check lets those through."""
    cfg = compose_cfg("strategy=fsdp", "+strategy.forward_prefetch=true", "+strategy.limit_all_gathers=false")
    validate_config(cfg)
    strategy = instantiate(cfg.strategy)
    assert (strategy.kwargs["forward_prefetch"], strategy.kwargs["limit_all_gathers"]) == (True, False)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.num_nodes=2"], "data_parallel_size=2 x strategy.tensor_parallel_size=1 is invalid: expected"),
        (["trainer=gpu"], "strategy.data_parallel_size=-1 is invalid"),  # devices=-1: all GPUs, unknown here
        (["strategy.tensor_parallel_size=0"], "strategy.tensor_parallel_size=0 is invalid"),
    ],
)
def test_fsdp2_mesh_must_cover_the_processes(compose_cfg, overrides: list[str], message: str) -> None:
    validate_config(compose_cfg("strategy=fsdp2"))  # 2 processes, data_parallel_size 2
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_cfg("strategy=fsdp2", *overrides))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("data", ["pydoc_chars", "digits"])
def test_fsdp2_shards_the_demo_models_and_trains(compose_cfg, data: str) -> None:
    """One process in-process (the 2-process run is a CLI test in the slow set): FSDP2 units are in place."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    model = "digits_mlp" if data == "digits" else "char_gpt"
    extra = [] if data == "digits" else [*SMALL_CHAR_DATA, "model.n_layer=2"]
    trainer = ["trainer.max_steps=3", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1"]
    trainer += ["trainer.enable_progress_bar=false"]
    trainer += ["+trainer.enable_model_summary=false", "+trainer.enable_checkpointing=false", "callbacks=none"]
    cfg = compose_cfg("strategy=fsdp2", "trainer=cpu", f"data={data}", f"model={model}", *extra, *trainer)
    built = _build(cfg)
    torch.set_num_threads(1)
    built.trainer.fit(built.model, datamodule=built.data)
    net = built.model.net
    assert isinstance(built.trainer.strategy, ModelParallelStrategy) and isinstance(net, FSDPModule)
    if data != "digits":
        assert all(isinstance(block, FSDPModule) for block in net.blocks)
    assert all(isinstance(p, DTensor) for p in built.model.parameters())
    assert built.trainer.global_step == 3 and math.isfinite(built.model.val_history[-1][1])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cli_two_process_fsdp2_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["strategy=fsdp2", "trainer=ddp_sim", "trainer.max_steps=3", "trainer.val_check_interval=3"]
    args += ["trainer.limit_val_batches=2", "model.n_layer=2", "model.n_embd=32", "data.max_chars=40000"]
    result = run_cli([*args, f"hydra.run.dir={run_dir}"], tmp_path, timeout=150)
    assert result.returncode == 0, result.stdout[-6000:]
    assert "FSDPCharGPT" in result.stdout  # the model summary shows the fully_shard-ed root
    assert len(list((run_dir / "checkpoints" / "last.ckpt").glob("*.distcp"))) == 2  # one shard per rank
    assert not result.leftover, f"processes outlived the run: {result.leftover}"


# ---- logger=tensorboard -------------------------------------------------------------------------------------------


def _event_tags(path: Path) -> set[str]:
    """The scalar tags in a TensorBoard events file (TFRecord framing: length, crc, Event proto, crc)."""
    try:
        from tensorboardX.proto.event_pb2 import Event
    except ImportError:
        from tensorboard.compat.proto.event_pb2 import Event
    data, i, tags = path.read_bytes(), 0, set()
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i : i + 8])
        event = Event.FromString(data[i + 12 : i + 12 + n])
        tags |= {v.tag for v in event.summary.value}
        i += 12 + n + 4
    return tags


@pytest.mark.skipif(not HAS_TENSORBOARD, reason='needs tensorboardX: pip install "lightning-zero[tensorboard]"')
@pytest.mark.timeout(60)
def test_tensorboard_logger_writes_an_events_file(compose_cfg, tmp_path: Path) -> None:
    trainer = ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.log_every_n_steps=1"]
    cfg = compose_cfg("experiment=digits_mlp", "logger=tensorboard", *trainer, *QUIET)
    built = _build(cfg)
    built.trainer.fit(built.model, datamodule=built.data)
    events = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events, sorted(p.name for p in tmp_path.rglob("*"))
    tags = set().union(*(_event_tags(p) for p in events))
    assert {"train/loss", "val/loss", "val/acc"} <= tags


# ---- the digits example -------------------------------------------------------------------------------------------


def test_digits_split_is_fixed_by_its_seed() -> None:
    def split(**kwargs: Any) -> DigitsDataModule:
        data = DigitsDataModule(**kwargs)
        data.setup("fit")
        return data

    torch.manual_seed(0)
    a = split()
    torch.manual_seed(1)  # the global seed does not move the split
    b, c = split(), split(split_seed=1)
    assert (len(a.train_set), len(a.val_set), len(a.test_set)) == (1257, 270, 270)
    assert all(torch.equal(x, y) for x, y in zip(a.val_set.tensors, b.val_set.tensors))
    assert not torch.equal(a.val_set.tensors[0], c.val_set.tensors[0])
    images, labels = (torch.cat(t) for t in zip(a.train_set.tensors, a.val_set.tensors, a.test_set.tensors))
    all_images, all_labels = load_digits_arrays()
    assert images.shape == (1797, 64) and images.min() == 0 and images.max() == 1
    # A partition of the whole set: same label counts, same pixel sums.
    assert torch.equal(labels.bincount(), all_labels.bincount())
    assert torch.allclose(images.sum(0), all_images.sum(0))
    assert sorted(a.val_set.tensors[1].unique().tolist()) == list(range(10))


@pytest.mark.timeout(60)
def test_digits_experiment_trains_above_chance_in_process(compose_cfg) -> None:
    """The experiment's own config (zero3_scratch on one CPU process, default callbacks) for 40 steps."""
    trainer = ["trainer.max_steps=40", "trainer.val_check_interval=20", "+trainer.enable_model_summary=false"]
    cfg = compose_cfg("experiment=digits_mlp", "optimizer.lr=3e-3", *trainer, *QUIET)
    built = _build(cfg)
    torch.set_num_threads(1)
    built.trainer.fit(built.model, datamodule=built.data)
    history = built.model.val_history
    assert [step for step, _ in history] == [0, 20, 40]  # the sanity check (step 0), then every 20 steps
    assert history[-1][1] < 0.5 * history[0][1]  # val/loss at least halves from the untrained ~ln(10)
    assert float(built.trainer.callback_metrics["val/acc"]) > 0.5  # chance is 0.1
    assert float(built.trainer.callback_metrics["val/loss"]) == pytest.approx(history[-1][1])
    assert built.trainer.checkpoint_callback.best_model_path  # it monitors val/loss, which exists
    (test,) = built.trainer.test(built.model, datamodule=built.data, verbose=False)
    assert test["test/acc"] > 0.5


@pytest.mark.timeout(60)
def test_digits_without_scikit_learn_says_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['sklearn'] = None\n"
        "import lightning_zero, lightning_zero.demo, lightning_zero.tools.train\n"  # the core package never needs it
        "from lightning_zero.demo import DigitsDataModule\n"
        "try:\n    DigitsDataModule()\nexcept ImportError as err:\n    print('ImportError:', err)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=50, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'ImportError: DigitsDataModule needs scikit-learn: pip install "lightning-zero[examples]"' in result.stdout


@pytest.mark.timeout(120)
def test_cli_runs_the_digits_experiment(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["experiment=digits_mlp", "trainer.max_steps=40", "trainer.val_check_interval=20", "optimizer.lr=3e-3"]
    result = run_cli([*args, f"hydra.run.dir={run_dir}"], tmp_path, timeout=100)
    assert result.returncode == 0, result.stdout[-6000:]
    assert list((run_dir / "checkpoints").glob("step*.ckpt"))  # best by val/loss
    assert "val/acc" in (run_dir / "csv" / "metrics.csv").read_text().splitlines()[0]
    assert not result.leftover


# ---- hparams_search=optuna ----------------------------------------------------------------------------------------


@pytest.mark.slow  # the popen sweep of tests/tools/test_multirun.py runs the real CLI in the default run
@pytest.mark.skipif(not HAS_OPTUNA, reason=NEEDS_OPTUNA)
@pytest.mark.timeout(150)
def test_cli_optuna_sweep_runs_its_trials(tmp_path: Path) -> None:
    # Two-process trials (trainer=ddp_sim, popen): each trial's rank 1 re-runs only that trial, with its sampled lr.
    args = ["hparams_search=optuna", "hydra.sweeper.n_trials=2", "trainer=ddp_sim"]
    args += ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=2"]
    args += ["model.n_layer=1", "model.n_embd=32", "data.max_chars=40000", f"paths.log_dir={tmp_path / 'logs'}"]
    # run_cli pins MASTER_PORT: every trial must still rendezvous on a port of its own
    # (lightning_zero/tools/multirun.py).
    result = run_cli(args, tmp_path, timeout=130)
    assert result.returncode == 0, result.stdout[-6000:]
    (sweep_dir,) = (tmp_path / "logs" / "multiruns").iterdir()
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1"]
    lrs = []
    for job in ("0", "1"):
        overrides = yaml.safe_load((sweep_dir / job / ".hydra" / "overrides.yaml").read_text())
        lrs += [float(o.split("=", 1)[1]) for o in overrides if o.startswith("optimizer.lr=")]
        assert (sweep_dir / job / "csv" / "metrics.csv").is_file()
        assert "rank 1 of 2: done" in (sweep_dir / job / "train_ddp_process_1.log").read_text()
    assert len(lrs) == 2 and lrs[0] != lrs[1] and all(1e-4 <= lr <= 3e-3 for lr in lrs)
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert set(results["best_params"]) == {"optimizer.lr", "optimizer.weight_decay"}
    assert math.isfinite(results["best_value"]) and results["best_value"] > 1  # a perplexity
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]  # nothing written elsewhere
    assert not result.leftover


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["aggregator=krum", "strategy.f=3"], r"n=8, f=3 is invalid: Krum needs n >= 2f\+3 = 9 .*workers_per_rank=4"),
        (["aggregator=bulyan"], r"n=8, f=2 is invalid: Bulyan needs n >= 4f\+3 = 11"),
        (["aggregator=median", "trainer=cpu"], r"n=4, f=2 is invalid: .*trainer.devices=1"),  # 1 process x 4
        (["strategy.aggregator=kurm"], "aggregator='kurm' is invalid: expected one of"),
        (["strategy.workers_per_rank=0"], "workers_per_rank=0 is invalid"),
        (["attack=alie", "~strategy.attack_kwargs.z"], "alie.* z"),
        (["strategy.aggregation_replicas=2"], "aggregation_replicas=2 needs sharded_aggregation=True"),
        (
            ["strategy.sharded_aggregation=true", "strategy.aggregation_replicas=3"],
            r"aggregation_replicas=3 is invalid for 2 processes: .* expected an integer in \[1, 2\]",
        ),
        (["strategy.byzantine_ranks=1"], r"byzantine_ranks=1 needs at least 3f \+ 1 = 4 processes, got 2"),
        (["strategy.byzantine_ranks=1", "trainer.devices=4", "strategy.aggregator=mean"], "needs a robust rule"),
        (["strategy.byzantine_ranks=1", "trainer.devices=4", "+strategy.byzantine_rank_behaviour=lie"], "'lie'"),
        (["strategy.byzantine_timeout=0", "strategy.byzantine_ranks=1"], r"byzantine_timeout=0(\.0)? is invalid"),
    ],
)
def test_robust_settings_fail_before_any_process(compose_cfg, overrides: list[str], message: str) -> None:
    cfg = compose_cfg("experiment=robust_digits", *overrides)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy.stage=3"], "stage=3 is invalid for robust ZeRO: expected 1 or 2"),
        (["strategy.sharded_aggregation=false"], "sharded_aggregation=False is invalid for robust_zero2_scratch"),
        (["strategy.state_dict_type=dcp"], "state_dict_type='dcp' is invalid: expected one of"),
    ],
)
def test_robust_zero_settings_fail_when_composed(compose_cfg, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_cfg("strategy=robust_zero2_scratch", *overrides))
