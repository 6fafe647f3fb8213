"""``pipeline_scratch`` against the single-process PyTorch reference on the same batches.

The parity MLP (``tests/helpers/parity.py``: an ``nn.Sequential`` of six layers under ``net``) is cut into 2 or 4
stages. Every stage reads the whole batch (one data replica), so the reference is the one-process run
(``world_size=1``: a shuffling ``DistributedSampler`` with one replica). The last batch of an epoch has 7 samples,
which cut into uneven micro-batches.
"""

from __future__ import annotations

import shutil
import sys
from unittest.mock import Mock

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader

import lightning_zero
from lightning_zero.comm import collectives as comm
from lightning_zero.pipeline.schedule import build, simulate
from lightning_zero.training.checkpoint_checks import CheckpointError
from lightning_zero.zero.checkpoint import read_meta, read_metadata
from tests.helpers.launch import clean_env, run_script
from tests.helpers.parity import (
    ParityConfig,
    ParityModule,
    fit_lightning,
    make_dataset,
    make_net,
    make_trainer,
    max_abs_diff,
    quiet_trainer,
    reference_params,
    train_loader,
)
from tests.helpers.workers import run_workers

CONFIG = ParityConfig(world_size=1, batch_size=8, gradient_clip_val=0.05)


def pipeline(**kwargs) -> lightning_zero.PipelineStrategy:
    return lightning_zero.PipelineStrategy(layers="net", **kwargs)


class LoggingModule(ParityModule):
    """The parity module, logging its loss per step and its validation loss (``sync_dist``)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


class StepLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.callback_metrics["train_loss"].item())


# ---------------------------------------------------------------- training parity
def _fit(config: ParityConfig, devices: int, kwargs: dict) -> dict[str, torch.Tensor]:
    return fit_lightning(config, pipeline(**kwargs), devices=devices)


@pytest.mark.parametrize(
    ("devices", "kwargs", "accumulate", "clip"),
    [
        (2, {"schedule": "1f1b", "micro_batches": 4}, 1, 0.05),
        (2, {"schedule": "gpipe", "micro_batches": 3}, 3, None),
        (4, {"schedule": "1f1b", "micro_batches": 6, "balance": [2, 2, 1, 1]}, 2, 0.05),
    ],
    ids=["1f1b-2stages-clip", "gpipe-2stages-accumulate", "1f1b-4stages"],
)
def test_training_matches_single_process(devices, kwargs, accumulate, clip):
    config = ParityConfig(world_size=1, batch_size=8, accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    weights = run_workers(_fit, devices, config, devices, kwargs, timeout=180)
    reference = reference_params(config)
    for rank_weights in weights:  # every rank holds the whole model after the fit
        assert max_abs_diff(rank_weights, reference) < 1e-5


def _fit_replicas(config: ParityConfig) -> tuple[dict[str, torch.Tensor], dict]:
    strategy = pipeline(stages=2, micro_batches=2)
    weights = fit_lightning(config, strategy, devices=4)
    stats = {"grads": comm.LEDGER.calls("all_reduce", "grads"), "sampler": strategy.distributed_sampler_kwargs}
    return weights, stats | {"metered": strategy.stage.meter is not None}


def test_two_replicas_of_a_two_stage_pipeline_match_ddp_on_two_ranks():
    # 4 processes: replicas {0, 1} and {2, 3}; the reference is data parallelism over 2 ranks on the same batches
    config = ParityConfig(world_size=2, batch_size=4, accumulate_grad_batches=3, gradient_clip_val=0.05)
    results = run_workers(_fit_replicas, 4, config, timeout=180)
    reference = reference_params(config)
    for rank, (weights, stats) in enumerate(results):
        assert max_abs_diff(weights, reference) < 1e-5
        assert stats["sampler"] == {"num_replicas": 2, "rank": rank // 2}
        assert stats["grads"] == config.optimizer_steps  # one gradient all-reduce per window, none in between
        assert not stats["metered"]  # measure_activations is off by default


class BatchNormModule(ParityModule):
    """The parity module with BatchNorm after each hidden Linear: buffers that ddp broadcasts from rank 0. The Linears
    before a BatchNorm have no bias, as usual: its gradient is zero in exact arithmetic, and AdamW would turn two runs'
    different rounding noise into opposite steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(6, 16, bias=False),
            nn.BatchNorm1d(16),
            nn.Tanh(),
            nn.Linear(16, 16, bias=False),
            nn.BatchNorm1d(16),
            nn.Linear(16, 3),
        )


def _fit_batchnorm(strategy_name: str, devices: int) -> dict[str, torch.Tensor]:
    config = ParityConfig(world_size=2, batch_size=4)
    L.seed_everything(config.seed, verbose=False)
    module = BatchNormModule()
    strategy = pipeline(stages=2, micro_batches=1) if strategy_name == "pipeline" else strategy_name
    make_trainer(config, strategy, devices=devices).fit(module, train_loader(config))
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def test_replicas_keep_batchnorm_buffers_as_lightning_ddp_does():
    ddp = run_workers(_fit_batchnorm, 2, "ddp", 2, timeout=120)
    for rank, state in enumerate(run_workers(_fit_batchnorm, 4, "pipeline", 4, timeout=120)):
        assert "1.running_mean" in state and "4.num_batches_tracked" in state
        # weights, and the running statistics: replica r's are those of ddp's rank r (each updated its own since the
        # last broadcast of rank 0's)
        assert max_abs_diff(state, ddp[rank // 2]) < 1e-5


def _fit_meta(config: ParityConfig) -> tuple[dict[str, torch.Tensor], list[bool]]:
    L.seed_everything(config.seed, verbose=False)
    module = ParityModule(config.lr, config.optimizer, build_in_configure_model=True)
    trainer = make_trainer(config, pipeline(model_init="meta"), devices=2, max_epochs=1)
    real_at_start = []
    trainer.callbacks.append(
        L.pytorch.callbacks.LambdaCallback(
            on_train_start=lambda t, m: real_at_start.extend(not p.is_meta for p in m.net.parameters())
        )
    )
    trainer.fit(module, train_loader(config))
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}, real_at_start


def test_meta_init_builds_only_the_stage_and_matches():
    config = ParityConfig(world_size=1, batch_size=8, max_epochs=1)
    (weights0, real0), (weights1, real1) = run_workers(_fit_meta, 2, config, timeout=120)
    # six children split 3 + 3: Linear, LayerNorm (stage 0) | Linear, Linear (stage 1), two tensors each
    assert real0 == [True] * 4 + [False] * 4 and real1 == [False] * 4 + [True] * 4
    reference = reference_params(config)
    assert max_abs_diff(weights0, reference) < 1e-5 and max_abs_diff(weights1, reference) < 1e-5


# ---------------------------------------------------------------- logging, validation, predict
def _fit_logged(config: ParityConfig) -> tuple[list[float], float, torch.Tensor]:
    L.seed_everything(config.seed, verbose=False)
    module, losses = LoggingModule(config.lr), StepLosses()
    trainer = make_trainer(config, pipeline(micro_batches=3), devices=2, callbacks=[losses])
    trainer.fit(module, train_loader(config))
    val_loss = trainer.validate(module, train_loader(config), verbose=False)[0]["val_loss"]
    predictions = torch.cat(trainer.predict(module, train_loader(config)))
    return losses.losses, val_loss, predictions


def test_logged_loss_validation_and_predictions_match_single_process():
    config = CONFIG
    results = run_workers(_fit_logged, 2, config, timeout=120)
    expected_losses: list[float] = []
    reference = make_net()
    reference.load_state_dict(reference_params(config, losses=expected_losses))
    x, y = make_dataset(config).tensors
    with torch.no_grad():
        expected_val = torch.stack(
            [nn.functional.mse_loss(reference(xb), yb) * len(xb) for xb, yb in zip(x.split(8), y.split(8))]
        ).sum() / len(x)
        expected_predictions = reference(x)
    for losses, val_loss, predictions in results:  # every rank logs and returns the last stage's values
        assert losses == pytest.approx(expected_losses, abs=1e-6)
        assert val_loss == pytest.approx(expected_val.item(), abs=1e-6)
        assert torch.allclose(predictions, expected_predictions, atol=1e-5)


# ---------------------------------------------------------------- activations and communication
def _one_step(schedule: str, micro_batches: int) -> dict:
    config = ParityConfig(world_size=1, batch_size=8, batches_per_rank=1, max_epochs=1, gradient_clip_val=None)
    L.seed_everything(config.seed, verbose=False)
    strategy = pipeline(schedule=schedule, micro_batches=micro_batches, measure_activations=True)
    trainer = make_trainer(config, strategy, devices=2, limit_train_batches=1)
    comm.LEDGER.reset()
    trainer.fit(ParityModule(config.lr), train_loader(config))
    stage = strategy.stage
    return {
        "peak_micro_batches": stage.peak_micro_batches,
        "peak_bytes": stage.meter.peak,
        "live_bytes": stage.meter.live,
        "sent": {tag: comm.LEDGER.bytes("send", tag) for tag in ("pipeline/activation", "pipeline/gradient")},
        "received": {tag: comm.LEDGER.bytes("recv", tag) for tag in ("pipeline/activation", "pipeline/gradient")},
        "timeline": [(t.kind, t.micro_batch) for t in stage.timeline],
    }


def test_1f1b_holds_fewer_activations_than_gpipe_and_sends_what_the_schedule_says():
    runs = {name: run_workers(_one_step, 2, name, 4, timeout=120) for name in ("gpipe", "1f1b")}
    for name, stats in runs.items():
        expected = simulate(build(name, 2, 4))
        assert [s["peak_micro_batches"] for s in stats] == expected.peak_activations
        assert [s["timeline"] for s in stats] == [[tuple(a) for a in actions] for actions in build(name, 2, 4)]
        assert all(s["live_bytes"] == 0 for s in stats)  # every saved activation freed by its backward
        # stage 0 -> 1: the batch's 7 samples (in four micro-batches) x 16 fp32 values; as much comes back as gradients
        act, grad, nbytes = "pipeline/activation", "pipeline/gradient", 7 * 16 * 4
        assert stats[0]["sent"][act] == nbytes == stats[1]["received"][act]
        assert stats[1]["sent"][grad] == nbytes == stats[0]["received"][grad]
    assert runs["gpipe"][0]["peak_micro_batches"] == 4 and runs["1f1b"][0]["peak_micro_batches"] == 2
    assert runs["1f1b"][0]["peak_bytes"] < runs["gpipe"][0]["peak_bytes"]


# ---------------------------------------------------------------- checkpoints
def _save_and_resume(config: ParityConfig, directory: str) -> dict:
    def run(max_epochs: int, ckpt_path: str | None) -> dict[str, torch.Tensor]:
        L.seed_everything(config.seed, verbose=False)
        module = ParityModule(config.lr)
        trainer = make_trainer(config, pipeline(micro_batches=2), devices=2, max_epochs=max_epochs)
        trainer.fit(module, train_loader(config), ckpt_path=ckpt_path)
        if max_epochs == 1:
            trainer.save_checkpoint(f"{directory}/epoch1.ckpt")
        return {k: v.detach().clone() for k, v in module.net.state_dict().items()}

    run(1, None)
    resumed = run(2, f"{directory}/epoch1.ckpt")
    straight = run(2, None)
    return {"resumed": resumed, "straight": straight}


LAYOUT = dict(strategy="pipeline_scratch", stages=2, replicas=1, balance=[3, 3], schedule="1f1b", micro_batches=2)
"""The ``"parallel_layout"`` of the checkpoints of ``_save_and_resume``'s and the ``sharded`` fixture's runs."""


def test_checkpoint_is_the_whole_model_and_resumes_exactly(tmp_path):
    results = run_workers(_save_and_resume, 2, CONFIG, str(tmp_path), timeout=180)
    for result in results:
        assert max_abs_diff(result["resumed"], result["straight"]) == 0.0
    checkpoint = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)
    assert checkpoint["parallel_layout"] == LAYOUT
    assert set(checkpoint["state_dict"]) == {f"net.{k}" for k in make_net().state_dict()}
    plain = make_net()
    plain.load_state_dict({k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items()})
    optimizer_state = checkpoint["optimizer_states"][0]["state"]
    assert sorted(optimizer_state) == list(range(len(list(plain.parameters()))))  # every stage's parameters


class SaveAtEpochEnd(L.Callback):
    """At the end of the first epoch, while the stages are split: the sharded checkpoint ``epoch1`` and the same state
    as a full file ``epoch1.ckpt``, counting the object gathers of each save."""

    def __init__(self, directory: str) -> None:
        self.directory, self.gathers = directory, {}

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        for kind, name in (("sharded", "epoch1"), ("full", "epoch1.ckpt")):
            strategy.state_dict_type, before = kind, comm.LEDGER.calls("gather_object")
            trainer.save_checkpoint(f"{self.directory}/{name}")
            self.gathers[kind] = comm.LEDGER.calls("gather_object") - before
        strategy.state_dict_type = "sharded"


def _fit_sharded(
    config: ParityConfig, max_epochs: int, ckpt_path: str | None, callbacks=(), devices: int = 2, **kwargs
) -> dict:
    """A fit under ``state_dict_type="sharded"`` (``kwargs`` override the strategy's settings): the whole weights (every
    rank holds them after the fit) and this rank's optimizer state, keyed by parameter name."""
    L.seed_everything(config.seed, verbose=False)
    module = ParityModule(config.lr)
    strategy = pipeline(**{"micro_batches": 2, "state_dict_type": "sharded", **kwargs})
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    trainer = make_trainer(
        config,
        strategy,
        devices=devices,
        max_epochs=max_epochs,
        callbacks=list(callbacks),
        enable_checkpointing=checkpointing,
    )
    trainer.fit(module, train_loader(config), ckpt_path=ckpt_path)
    names = {p: name for name, p in module.net.named_parameters()}
    return {
        "weights": {k: v.detach().clone() for k, v in module.net.state_dict().items()},
        "optimizer": {names[p]: {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizers[0].state.items()},
    }


def _sharded_runs(config: ParityConfig, directory: str) -> dict:
    saver = SaveAtEpochEnd(directory)
    _fit_sharded(config, 1, None, [saver])
    epoch1 = f"{directory}/epoch1"
    top_1 = ModelCheckpoint(dirpath=f"{directory}/top1", save_top_k=1)  # removes each epoch's predecessor
    return {
        "gathers": saver.gathers,
        "straight": _fit_sharded(config, 2, None, [top_1]),
        "resumed": _fit_sharded(config, 2, epoch1),
        "resumed_balance": _fit_sharded(config, 2, epoch1, balance=[4, 2], state_dict_type="full"),
        # 1 stage x 2 replicas: other batches than above, so against the same resume from the full file
        "replicas": _fit_sharded(config, 2, epoch1, stages=1),
        "replicas_from_file": _fit_sharded(config, 2, f"{epoch1}.ckpt", stages=1),
    }


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sharded")
    return directory, run_workers(_sharded_runs, 2, CONFIG, str(directory), timeout=300)


def _optimizer_states_of_every_stage(results: list[dict], run: str) -> dict:
    return {name: state for result in results for name, state in result[run]["optimizer"].items()}


def _assert_states_close(ours: dict, expected: dict, tolerance: float) -> None:
    assert ours.keys() == expected.keys()
    for name, state in ours.items():
        for key, value in state.items():
            assert (value - expected[name][key]).abs().max().item() <= tolerance, (name, key)


def _no_decay() -> list[str]:
    return [k for k, v in make_net().named_parameters() if v.ndim < 2]


def test_sharded_checkpoint_resumes_exactly(sharded):
    directory, results = sharded
    for result in results:
        assert max_abs_diff(result["resumed"]["weights"], result["straight"]["weights"]) == 0.0
    straight = _optimizer_states_of_every_stage(results, "straight")
    assert len(straight) == 8  # every parameter's state, each on its stage's rank
    _assert_states_close(_optimizer_states_of_every_stage(results, "resumed"), straight, 0.0)
    meta = read_meta(directory / "epoch1")
    assert meta["parallel_layout"] == LAYOUT
    assert "state_dict" not in meta and "optimizer_states" not in meta and meta["lr_schedulers"]
    decay = ["net.0.weight", "net.3.weight", "net.5.weight"]  # the parity optimizer's groups, by name
    assert [g["params"] for g in meta["optimizer_param_groups"][0]] == [decay, [f"net.{k}" for k in _no_decay()]]
    # ModelCheckpoint(save_top_k=1) removed the first epoch's directory when it saved the second's
    assert sorted(p.name for p in (directory / "top1").iterdir()) == ["epoch=1-step=16.ckpt"]
    assert (directory / "top1" / "epoch=1-step=16.ckpt" / "meta.pt").is_file()


def test_sharded_checkpoint_resumes_at_another_layout(sharded):
    _, results = sharded
    for result in results:
        assert max_abs_diff(result["resumed_balance"]["weights"], result["straight"]["weights"]) < 1e-6
        assert max_abs_diff(result["replicas"]["weights"], result["replicas_from_file"]["weights"]) == 0.0
    straight = _optimizer_states_of_every_stage(results, "straight")
    _assert_states_close(_optimizer_states_of_every_stage(results, "resumed_balance"), straight, 1e-6)
    for result in results:  # each replica holds every parameter's state
        _assert_states_close(result["replicas"]["optimizer"], result["replicas_from_file"]["optimizer"], 0.0)
    assert results[0]["replicas"]["weights"].keys() == results[0]["straight"]["weights"].keys()


def test_sharded_save_gathers_nothing_and_each_rank_writes_its_stage(sharded):
    directory, results = sharded
    for result in results:
        assert result["gathers"] == {"sharded": 0, "full": 2}  # the full file gathers weights and optimizer state
    metadata = read_metadata(directory / "epoch1")
    params = list(make_net().state_dict())
    stage = {k: 0 if int(k.split(".")[0]) < 3 else 1 for k in params}  # balance [3, 3]
    states = ("exp_avg", "exp_avg_sq", "step")
    expected = {f"model.net.{k}": stage[k] for k in params}
    expected |= {f"optimizer_0.state.net.{k}.{s}": stage[k] for k in params for s in states}
    assert set(metadata.state_dict_metadata) == set(expected)
    files = [(index.fqn, info.relative_path) for index, info in metadata.storage_data.items()]
    assert sorted(fqn for fqn, _ in files) == sorted(expected)  # every tensor written once
    for fqn, file in files:
        assert file.startswith(f"__{expected[fqn]}_"), (fqn, file)  # by the rank of its stage


def _resume_damaged(config: ParityConfig, paths: list[str]) -> list[tuple[str, bool]]:
    """Each path refused: the error's message, and whether the weights are still the initial ones."""
    out = []
    for path in paths:
        L.seed_everything(config.seed, verbose=False)
        module = ParityModule(config.lr)
        trainer = make_trainer(config, pipeline(micro_batches=2, state_dict_type="sharded"), devices=2, max_epochs=2)
        with pytest.raises(CheckpointError) as error:
            trainer.fit(module, train_loader(config), ckpt_path=path)
        initial = make_net().state_dict()
        out.append((str(error.value), max_abs_diff(module.net.state_dict(), initial) == 0.0))
    return out


def test_damaged_sharded_checkpoint_is_refused_by_name(sharded, tmp_path):
    directory, _ = sharded
    no_meta, truncated = tmp_path / "no_meta", tmp_path / "truncated"
    shutil.copytree(directory / "epoch1", no_meta)
    (no_meta / "meta.pt").unlink()
    shutil.copytree(directory / "epoch1", truncated)
    shard = truncated / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    for (missing, kept_missing), (cut, kept_cut) in run_workers(
        _resume_damaged, 2, CONFIG, [str(no_meta), str(truncated)], timeout=120
    ):
        assert f"sharded checkpoint {no_meta} has no meta.pt" in missing and kept_missing
        assert "shard file __1_0.distcp is truncated (100 bytes" in cut and kept_cut


def _resume_on_four(config: ParityConfig, directory: str) -> dict:
    epoch1 = f"{directory}/epoch1"
    return {
        "stages": _fit_sharded(config, 2, epoch1, devices=4),
        "replicas": _fit_sharded(config, 2, epoch1, devices=4, stages=2),
        "replicas_from_file": _fit_sharded(config, 2, f"{epoch1}.ckpt", devices=4, stages=2),
    }


def test_sharded_checkpoint_of_two_ranks_resumes_on_four(sharded):
    directory, results = sharded
    resumed = run_workers(_resume_on_four, 4, CONFIG, str(directory), timeout=300)
    straight = results[0]["straight"]
    for result in resumed:
        assert max_abs_diff(result["stages"]["weights"], straight["weights"]) < 1e-6
        assert max_abs_diff(result["replicas"]["weights"], result["replicas_from_file"]["weights"]) == 0.0
    ours = _optimizer_states_of_every_stage(resumed, "stages")
    _assert_states_close(ours, _optimizer_states_of_every_stage(results, "straight"), 1e-6)


# ---------------------------------------------------------------- refusals (no processes)
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batches": 0}, "micro_batches=0 is invalid"),
        ({"schedule": "interleaved"}, "schedule='interleaved' is invalid"),
        ({"model_init": "auto"}, "model_init='auto' is invalid"),
        ({"state_dict_type": "x"}, "state_dict_type='x' is invalid: expected 'full' or 'sharded'"),
        ({"param_dtype": "bf16"}, "does not take ['param_dtype']"),
        ({"find_unused_parameters": True}, "does not take ['find_unused_parameters']"),
    ],
)
def test_invalid_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        lightning_zero.PipelineStrategy(**kwargs)


def test_16_mixed_wrong_balance_and_stages_refused_when_the_trainer_is_built():
    strategy = pipeline()  # on CPU the Trainer turns 16-mixed into bf16-mixed: the CUDA plugin, set by hand
    strategy.precision_plugin = MixedPrecision("16-mixed", "cuda", scaler=Mock())
    with pytest.raises(ValueError, match="does not run precision='16-mixed'"):
        strategy._check_before_launch()
    with pytest.raises(ValueError, match=r"balance=\[6\] has 1 entries: expected one per stage.* 2 stages"):
        quiet_trainer(pipeline(balance=[6]))
    with pytest.raises(ValueError, match="stages=3 is invalid: expected a divisor of the world size 2"):
        quiet_trainer(pipeline(stages=3))


def test_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["pipeline_scratch"]["strategy"] is lightning_zero.PipelineStrategy
    assert StrategyRegistry["pipeline_scratch_spawn"]["init_params"] == {"start_method": "spawn"}


class _OutsideParameter(ParityModule):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))


def _refused_module(kind: str) -> str:
    module = {"outside": _OutsideParameter, "batchnorm": BatchNormModule}.get(kind, ParityModule)()
    strategy = lightning_zero.PipelineStrategy(layers="missing") if kind == "missing" else pipeline(micro_batches=2)
    trainer = make_trainer(CONFIG, strategy, devices=2, max_epochs=1)
    try:
        trainer.fit(module, train_loader(CONFIG))
    except (ValueError, TypeError) as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("outside", "the trainable parameters ['scale'] are outside 'net'"),
        ("missing", "ParityModule.missing is NoneType: expected the nn.Sequential"),
        ("batchnorm", "['net.1', 'net.4'] normalize each micro-batch by its own statistics, so with micro_batches=2"),
    ],
)
def test_modules_the_pipeline_cannot_split_are_refused(kind, message):
    for error in run_workers(_refused_module, 2, kind, timeout=120):
        assert message in error


# ---------------------------------------------------------------- Lightning's own demo model, against its ddp
class SequentialBoringModel(BoringModel):
    """Lightning's ``BoringModel`` (dict outputs, SGD + StepLR, validation and test steps) with a two-Linear
    ``nn.Sequential`` as its ``layer``, and batches of 8."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 64), batch_size=8)

    val_dataloader = test_dataloader = train_dataloader


def _fit_boring(strategy_name: str, devices: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    L.seed_everything(0, verbose=False)
    module = SequentialBoringModel()
    strategy = lightning_zero.PipelineStrategy(layers="layer") if strategy_name == "pipeline" else strategy_name
    trainer = quiet_trainer(strategy, devices=devices, max_epochs=2, num_sanity_val_steps=2, limit_val_batches=2)
    trainer.fit(module)
    tested = trainer.test(module, verbose=False)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, tested


def test_lightning_boring_model_trains_as_under_lightning_ddp():
    ((ddp_weights, _),) = run_workers(_fit_boring, 1, "ddp", 1, timeout=120)
    for weights, tested in run_workers(_fit_boring, 2, "pipeline", 2, timeout=120):
        assert max_abs_diff(weights, ddp_weights) < 1e-5
        assert tested == [{}]  # BoringModel's test step logs nothing; it ran through the pipeline on every rank


# ---------------------------------------------------------------- launchers
@pytest.mark.slow  # 22 s for popen; the other multi-process tests here run the strategy in forked workers
@pytest.mark.parametrize("name", ["pipeline_scratch", "pipeline_scratch_spawn"])
def test_launched_as_a_script(tmp_path, name):
    """Lightning's popen launcher (the script re-run for rank 1) and the spawn launcher (rank 0's weights back in the
    launching process, whole after the fit)."""
    out = tmp_path / "params.pt"
    cmd = [sys.executable, "tests/scripts/train_parity.py", "--strategy", name, "--devices", "2", "--world-size", "1"]
    code, output = run_script([*cmd, "--out", str(out)], clean_env(), timeout=150)
    assert code == 0, output
    reference = reference_params(ParityConfig(world_size=1))
    assert max_abs_diff(torch.load(out), reference) < 1e-5
    if name == "pipeline_scratch":
        assert max_abs_diff(torch.load(f"{out}.rank1"), reference) < 1e-5
