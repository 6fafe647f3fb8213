"""``zero3_scratch`` on real gloo processes: parity, memory, communication, evaluation loops and bad input.

One set of worker processes per world size runs every fit the tests need; the tests then assert on the parts. Final
weights are read from the full checkpoint each fit saves. Most fits build the net in ``configure_model`` with
``model_init="meta"`` (module by module from the meta device: these nets initialise through ``reset_parameters()``
only), so parity also proves that building shard by shard gives the weights of a normal build; ``"full"`` variants
build it for real first (the default for a model that fits).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import DistributedSampler

from lightning_zero import ZeroStrategy
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage3.state import optimizer_state_dict
from tests.helpers.parity import (
    ParityConfig,
    ParityModule,
    assert_optimizer_states_equal,
    loss_fn,
    make_dataset,
    make_trainer,
    max_abs_diff,
    reference_params,
    train_loader,
)
from tests.helpers.probes import ModelStateProbe
from tests.helpers.workers import run_workers

SLOW = pytest.mark.slow  # the rest of a matrix: in the slow run (CI runs both)

TOLERANCE = 1e-5

# (model, grad_sync, accumulate_grad_batches, optimizer, build): AdamW + norm clipping on the MLP for every mode x g,
# SGD (which notices a gradient off by a constant factor), the tied-weight GPT, a frozen middle layer, a model with a
# root unit only, one model built in __init__; "meta" and "full" are configure_model with that model_init.
VARIANTS = [("mlp", sync, g, "adamw", "meta") for sync in ("microbatch", "boundary") for g in (1, 3)] + [
    ("mlp", "microbatch", 3, "sgd", "meta"),
    ("gpt", "microbatch", 3, "adamw", "meta"),
    ("gpt", "boundary", 1, "adamw", "full"),
    ("mlp_frozen", "boundary", 3, "adamw", "meta"),
    ("two_layer", "microbatch", 1, "adamw", "full"),
    ("mlp", "microbatch", 3, "adamw", "init"),
]


def _config(world_size: int, variant, **kwargs) -> ParityConfig:
    model, _, g, optimizer, _ = variant
    if optimizer == "sgd":
        return ParityConfig(world_size, g, optimizer="sgd", gradient_clip_val=None, lr=0.05, model=model, **kwargs)
    return ParityConfig(world_size, g, model=model, **kwargs)


def _full_params(ckpt: str) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    return {k.removeprefix("net."): v for k, v in state.items()}


def _fit(
    config: ParityConfig, strategy: ZeroStrategy, ckpt: str, build: str = "meta", callbacks=(), **trainer_kwargs
) -> ParityModule:
    import lightning as L

    L.seed_everything(config.seed, verbose=False)
    module = ParityModule(config.lr, config.optimizer, config.model, build_in_configure_model=build != "init")
    trainer = make_trainer(config, strategy, callbacks=list(callbacks), **trainer_kwargs)
    trainer.fit(module, train_loader(config))
    assert trainer.global_step == config.optimizer_steps
    trainer.save_checkpoint(ckpt)
    return module


class _WideModule(ParityModule):
    """Wider layers, so padding and AdamW's scalar step counters are < 0.1% of the model states."""

    def configure_model(self) -> None:
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 96), nn.LayerNorm(96), nn.Tanh(), nn.Linear(96, 96), nn.Linear(96, 3))


def _unsharded_bytes(engine: ShardedParams) -> int:
    """Bytes the engine holds beyond shards and their gradients right now: gathered flats, unsharded gradients,
    reductions in flight, buffers kept for reuse."""
    total = sum(s.full.untyped_storage().nbytes() for s in engine.segments)
    total += sum(s.grad_full.untyped_storage().nbytes() for s in engine.segments if s.grad_full is not None)
    total += sum(buffer.nbytes for free in engine._reducer.cache.values() for buffer in free)  # reusable in the step
    pending = engine._reducer.pending
    return total + sum(grad.nbytes + (out is not s.grad_acc) * out.nbytes for _, s, out, grad, _ in pending)


class _Probe(ModelStateProbe):
    """Model-state bytes between steps, the peak of unsharded bytes inside steps, and the ledger of every batch."""

    def on_train_start(self, trainer, pl_module):
        engine = trainer.strategy.engine
        self.peak = 0
        for owner, name in ((engine._gathers, "gather"), (engine, "_on_grad"), (engine, "_complete")):
            method = getattr(owner, name)

            def sampled(*args, _method=method, **kwargs):
                out = _method(*args, **kwargs)
                self.peak = max(self.peak, _unsharded_bytes(engine))
                return out

            setattr(owner, name, sampled)
        self.largest_unit = max(sum(s.nbytes for s in u.segments) for u in engine.units)
        self.padded_bytes = sum(s.nbytes for s in engine.segments)

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        engine = trainer.strategy.engine
        self.between_steps = _unsharded_bytes(engine)


def _probe_fit(world_size: int, module: ParityModule, g: int = 1, **strategy_kwargs) -> dict:
    config = ParityConfig(world_size, g, max_epochs=1)
    probe = _Probe()
    trainer = make_trainer(config, ZeroStrategy(stage=3, **strategy_kwargs), callbacks=[probe])
    trainer.fit(module, train_loader(config))
    fields = ("batches", "peak", "largest_unit", "padded_bytes", "memory", "psi", "between_steps")
    return {k: getattr(probe, k) for k in fields}


def _build_peak(world_size: int) -> dict:
    """Largest real parameter bytes (shards + full tensors) while the engine builds a meta-device model."""
    peak, original = [0], ShardedParams._load_param

    def sampled(engine, p):
        original(engine, p)
        full = {id(q): q for q in engine.module.parameters() if not q.is_meta and q.untyped_storage().nbytes() > 4}
        total = sum(q.untyped_storage().nbytes() for q in full.values())
        peak[0] = max(peak[0], total + sum(s.shard.nbytes for s in engine.segments))

    ShardedParams._load_param = sampled
    try:
        with torch.device("meta"):
            module = _WideModule()
            module.configure_model()
        engine = ShardedParams(module)
    finally:
        ShardedParams._load_param = original
    return {"peak": peak[0], "largest_unit": max(sum(s.nbytes for s in u.segments) for u in engine.units)}


def _all_fits(world_size: int, tmp: str) -> dict:
    out = {}
    for n, variant in enumerate(VARIANTS):
        _, sync, _, _, build = variant
        ckpt = f"{tmp}/parity{n}.ckpt"
        init = "meta" if build == "meta" else "full"
        strategy = ZeroStrategy(stage=3, grad_sync=sync, state_dict_type="full", model_init=init)
        _fit(_config(world_size, variant), strategy, ckpt, build)
        out[variant] = _full_params(ckpt)
    ckpt = f"{tmp}/keep.ckpt"
    strategy = ZeroStrategy(stage=3, reshard_after_forward=False, state_dict_type="full")
    _fit(_config(world_size, VARIANTS[1]), strategy, ckpt)
    out["keep_gathered"] = _full_params(ckpt)
    out["memory"] = _probe_fit(world_size, _WideModule(build_in_configure_model=True))
    for reshard in (True, False):
        module = ParityModule(build_in_configure_model=True)
        out[("ledger", reshard)] = _probe_fit(world_size, module, reshard_after_forward=reshard)
    out[("ledger", "boundary")] = _probe_fit(world_size, ParityModule(), 3, grad_sync="boundary")
    out["build"] = _build_peak(world_size)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"N{n}")
def fits(request, tmp_path_factory):
    world_size = request.param
    tmp = tmp_path_factory.mktemp(f"zero3_N{world_size}")
    return world_size, run_workers(_all_fits, world_size, world_size, str(tmp), timeout=600)[0]


@pytest.mark.timeout(700)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_parity_with_single_process_reference(fits, variant):
    world_size, result = fits
    reference = reference_params(_config(world_size, variant))
    assert max_abs_diff(result[variant], reference) <= TOLERANCE
    initial = dict(ParityModule(model=variant[0]).net.state_dict())
    assert max_abs_diff(result[variant], initial) > 1e3 * TOLERANCE  # training moved the weights
    if variant[0] == "mlp_frozen":
        assert max_abs_diff({"w": result[variant]["3.weight"]}, {"w": initial["3.weight"]}) == 0.0


@pytest.mark.timeout(700)
def test_parity_keeping_units_gathered_until_backward(fits):
    world_size, result = fits
    assert max_abs_diff(result["keep_gathered"], reference_params(_config(world_size, VARIANTS[1]))) <= TOLERANCE


@pytest.mark.timeout(700)
def test_model_state_bytes_at_the_floor_and_bounded_peak(fits):
    world_size, result = fits
    probe = result["memory"]
    psi, memory = probe["psi"], probe["memory"]
    assert memory.params == pytest.approx(4 * psi / world_size, rel=0.01)  # shards (+ one 4-byte placeholder)
    assert memory.grads == pytest.approx(4 * psi / world_size, rel=0.01)
    assert memory.optimizer == pytest.approx(8 * psi / world_size, rel=0.01)
    assert memory.total == pytest.approx(16 * psi / world_size, rel=0.01)
    assert probe["between_steps"] == 0  # no full parameter or gradient left behind
    assert 0 < probe["peak"] <= 4 * probe["largest_unit"]
    build = result["build"]  # building from the meta device: shards + one module's parameters at most
    assert build["peak"] <= 4 * psi / world_size + 4 * world_size + build["largest_unit"]


@pytest.mark.timeout(700)
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard_after_forward", "keep_until_backward"])
def test_communication_per_optimizer_step(fits, reshard):
    world_size, result = fits
    probe = result[("ledger", reshard)]
    padded = probe["padded_bytes"]
    assert 0 <= padded - 4 * probe["psi"] < 4 * world_size * 16  # 4Ψ up to padding (< N per segment)
    for records in probe["batches"]:
        gathered = sum(b for op, tag, b in records if (op, tag) == ("all_gather", "params"))
        reduced = sum(b for op, tag, b in records if (op, tag) == ("reduce_scatter", "grads"))
        assert gathered == (2 if reshard else 1) * padded  # 8Ψ (forward + backward) or 4Ψ
        assert reduced == padded  # 4Ψ


@pytest.mark.timeout(700)
def test_boundary_mode_reduces_only_at_the_boundary(fits):
    _, result = fits
    probe = result[("ledger", "boundary")]
    batches = probe["batches"]
    for batch_idx, records in enumerate(batches):
        boundary = (batch_idx + 1) % 3 == 0 or batch_idx + 1 == len(batches)
        reduced = sum(b for op, tag, b in records if (op, tag) == ("reduce_scatter", "grads"))
        assert reduced == (probe["padded_bytes"] if boundary else 0)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_parity_and_memory(tmp_path):
    """One process on one GPU (NCCL): device placement of shards, gathers and gradients, parity and memory floor."""
    variant = ("gpt", "microbatch", 3, "adamw", "meta")
    config = _config(1, variant)
    ckpt = str(tmp_path / "cuda.ckpt")
    probe = _Probe()
    strategy = ZeroStrategy(stage=3, state_dict_type="full")
    _fit(config, strategy, ckpt, callbacks=[probe], accelerator="cuda", devices=1)
    assert strategy.root_device.type == "cuda" and strategy.process_group_backend == "nccl"
    assert all(s.shard.is_cuda for s in strategy.engine.segments)
    difference = max_abs_diff(_full_params(ckpt), reference_params(config))
    print(f"cuda parity max abs diff {difference:.3g}; model states {probe.memory}; psi {probe.psi}")
    assert difference <= TOLERANCE
    assert probe.memory.total == pytest.approx(16 * probe.psi, rel=0.01)
    assert probe.between_steps == 0


# ----------------------------------------------------------------------------------------------- evaluation loops
class _Evaluated(ParityModule):
    def __init__(self) -> None:
        super().__init__(build_in_configure_model=True)
        import torchmetrics

        self.mse = torchmetrics.MeanSquaredError()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.mse.update(self.net(x), y)
        self.log("val_mse", self.mse, on_epoch=True)
        self.log("val_loss", loss_fn(self.net, x, y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


def _evaluate(world_size: int) -> dict:
    config = ParityConfig(world_size, max_epochs=1)
    module = _Evaluated()
    trainer = make_trainer(config, ZeroStrategy(stage=3))
    dataset = make_dataset(config)
    loader = torch.utils.data.DataLoader(dataset, batch_size=config.batch_size)
    trainer.fit(module, loader, loader)
    metrics = trainer.validate(module, loader, verbose=False)[0]
    predictions = torch.cat(trainer.predict(module, loader))
    # A new Trainer (and strategy) on the same processes shards the model anew from the weights the last run left.
    again = make_trainer(config, ZeroStrategy(stage=3)).validate(module, loader, verbose=False)[0]
    assert again == metrics, (again, metrics)
    # What every rank evaluated: the non-shuffling DistributedSampler's indices (one padded repeat).
    indices = [list(DistributedSampler(dataset, world_size, r, shuffle=False)) for r in range(world_size)]
    with trainer.strategy.engine.summon_full_params(), torch.no_grad():
        x, y = dataset.tensors
        everyone = [i for rank_indices in indices for i in rank_indices]
        expected_mse = nn.functional.mse_loss(module.net(x[everyone]), y[everyone]).item()
        predicted = [i for batch in trainer.predict_dataloaders.batch_sampler for i in batch]  # not padded
        expected_predictions = module.net(x[predicted])
    return {
        "metrics": metrics,
        "expected_mse": expected_mse,
        "predictions": predictions,
        "expected": expected_predictions,
    }


@pytest.mark.timeout(300)
def test_validate_predict_log_and_torchmetrics_use_gathered_weights():
    for rank_result in run_workers(_evaluate, 2, 2, timeout=250):
        assert rank_result["metrics"]["val_mse"] == pytest.approx(rank_result["expected_mse"], rel=1e-4)
        assert torch.allclose(rank_result["predictions"], rank_result["expected"], atol=1e-6)


# ----------------------------------------------------------------------------------------------- checkpoints
class _CaptureOptimizerState(Callback):
    def on_train_start(self, trainer, pl_module):
        self.state = optimizer_state_dict(trainer.strategy.engine, sharded=False)


def _checkpoint_fit(
    world_size: int, ckpt: str, epochs: int, state_dict_type: str = "sharded", resume: str = ""
) -> dict:
    """Fit the tied-weight GPT; save to ``ckpt`` if given; return full weights and the full optimizer state (rank 0)
    after fit, and the optimizer state right after a restore."""
    import lightning as L

    config = ParityConfig(world_size, batches_per_rank=3, max_epochs=epochs, model="gpt")
    L.seed_everything(config.seed, verbose=False)
    module = ParityModule(config.lr, model="gpt", build_in_configure_model=True)
    capture = _CaptureOptimizerState()
    trainer = make_trainer(config, ZeroStrategy(stage=3, state_dict_type=state_dict_type), callbacks=[capture])
    trainer.fit(module, train_loader(config), ckpt_path=resume or None)
    assert trainer.global_step == 3 * epochs
    if ckpt:
        trainer.save_checkpoint(ckpt)
    engine = trainer.strategy.engine
    with engine.summon_full_params():
        params = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    return {"params": params, "state": optimizer_state_dict(engine, sharded=False), "restored": capture.state}


def _straight_save_resume(ckpt: str, state_dict_type: str) -> dict:
    straight = _checkpoint_fit(2, "", 2)
    saved = _checkpoint_fit(2, ckpt, 1, state_dict_type)
    resumed = _checkpoint_fit(2, "", 2, resume=ckpt)
    return {"straight": straight, "saved": saved, "resumed": resumed}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("state_dict_type", ["sharded", pytest.param("full", marks=SLOW)])
def test_resume_is_bit_identical_and_reshards_to_another_world_size(tmp_path, state_dict_type):
    ckpt = tmp_path / "epoch1.ckpt"
    result = run_workers(_straight_save_resume, 2, str(ckpt), state_dict_type, timeout=300)[0]
    assert ckpt.is_dir() == (state_dict_type == "sharded")
    assert max_abs_diff(result["straight"]["params"], result["resumed"]["params"]) == 0.0
    saved_state = result["saved"]["state"]
    assert_optimizer_states_equal(result["resumed"]["restored"], saved_state)
    # N=2 -> N=3: the restored full optimizer state is identical, and training goes on
    resharded = run_workers(_checkpoint_fit, 3, 3, "", 2, "sharded", str(ckpt), timeout=300)
    assert_optimizer_states_equal(resharded[0]["restored"], saved_state)
    assert max_abs_diff(resharded[0]["params"], result["saved"]["params"]) > 0.0
    assert all(torch.isfinite(v).all() for v in resharded[0]["params"].values())


@pytest.mark.timeout(300)
def test_sharded_checkpoint_consolidates_into_a_plain_checkpoint(tmp_path):
    ckpt, plain = tmp_path / "sharded.ckpt", tmp_path / "plain.ckpt"
    saved = run_workers(_checkpoint_fit, 2, 2, str(ckpt), 1, timeout=200)[0]
    assert (ckpt / "meta.pt").is_file()
    command = [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(ckpt)]
    out = subprocess.run([*command, "--output_file", str(plain)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    checkpoint = torch.load(plain, weights_only=False)
    module = ParityModule(model="gpt")
    module.load_state_dict(checkpoint["state_dict"])  # strict: every key, every shape
    assert max_abs_diff(dict(module.net.state_dict()), saved["params"]) == 0.0
    assert module.net.head.weight is module.net.wte.weight


# ----------------------------------------------------------------------------------------------- bad input
class _Diverging(ParityModule):
    """From optimizer step ``from_step`` on, rank 1 skips ``net.3``: the gather sequences differ between ranks."""

    def __init__(self, from_step: int) -> None:
        super().__init__()
        self.from_step = from_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        for i, layer in enumerate(self.net):
            if not (self.global_rank == 1 and i == 3 and self.global_step >= self.from_step):
                x = layer(x)
        return nn.functional.mse_loss(x, y)


class _StepClock(Callback):
    """When the optimizer step ``step`` started on this rank."""

    def __init__(self, step: int) -> None:
        self.step, self.started = step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self.started is None:
            self.started = time.monotonic()


def _diverge(world_size: int, from_step: int, collective_timeout: float) -> tuple[str, float]:
    """The error of a fit that diverges at ``from_step``, and the seconds from the start of that step to it."""
    config = ParityConfig(world_size, max_epochs=1)
    strategy = ZeroStrategy(stage=3, collective_timeout=collective_timeout)
    clock = _StepClock(from_step)
    try:
        make_trainer(config, strategy, callbacks=[clock]).fit(_Diverging(from_step), train_loader(config))
    except Exception as error:  # the message is what the test checks
        # The process group goes as the failing process would take it when exiting: that ends the peer's wait.
        torch.distributed.destroy_process_group()
        return f"{type(error).__name__}: {error}", time.monotonic() - clock.started
    return "no error", 0.0


@pytest.mark.timeout(200)
def test_diverging_unit_sequence_raises_an_error_naming_the_units():
    """In the first step no sequence is planned yet: every collective is checked before it is launched, and both
    ranks name both units at once, long before any timeout."""
    results = run_workers(_diverge, 2, 2, 0, 60, timeout=150)
    for message, seconds in results:
        assert "collective sequence diverged" in message, message
        assert "'net.3'" in message, message
        assert seconds < 30, seconds


@pytest.mark.timeout(200)
def test_diverging_after_the_order_is_planned_fails_within_the_collective_timeout_naming_everything():
    """From step 2 the collectives follow the previous step's order unchecked ([Note: gather sequence check]): the
    rank that leaves it (rank 1) waits in a check that rank 0 never joins, and rank 0 waits on a collective of the
    plan. Rank 1 fails after ``collective_timeout`` ([Note: collective watchdog]) naming its wait, the unit, the step,
    and what rank 0 was waiting in; rank 0 fails at once after it, naming its own collective and the step. No hang,
    no 30-minute wait."""
    results = run_workers(_diverge, 2, 2, 2, 10, timeout=150)
    (zero, zero_s), (one, one_s) = results
    assert one.startswith("CollectiveTimeout: lightning_zero: rank 1 waited 10 s in all_gather 'gather_check'"), one
    assert "the ZeRO-3 sequence check before gathering unit 'net." in one and "(training step 2, epoch 0)" in one
    assert re.search(r"Meanwhile rank 0: (reduce_scatter 'grads'|all_gather 'params') of \d+ bytes; ZeRO-3", one), one
    assert re.search(r"ZeRO-3 .* of unit 'net\.\d' \(training step 2, epoch 0\)", zero), zero
    assert 10 <= one_s < 25 and zero_s < 25, (zero_s, one_s)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 2, "auto_wrap_policy": {nn.Linear}}, "auto_wrap_policy apply to stage=3 only: got stage=2"),
        ({"stage": 1, "reshard_after_forward": False}, "reshard_after_forward apply to stage=3 only"),
        ({"stage": 3, "auto_wrap_policy": {"Block"}}, "auto_wrap_policy: cannot import 'Block'"),
        ({"stage": 3, "auto_wrap_policy": nn.Linear}, "auto_wrap_policy=.* is invalid: expected a set of nn.Module"),
        ({"stage": 3, "min_num_params": 0}, "min_num_params=0 is invalid: expected an integer >= 1"),
        ({"stage": 3, "auto_wrap_policy": {nn.Linear}, "min_num_params": 5}, "exclusive"),
    ],
)
def test_bad_stage3_settings_raise_one_clear_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroStrategy(**kwargs)


def test_meta_module_without_reset_parameters_fails_clearly():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        module = nn.Sequential(nn.Linear(3, 3), Custom())
    with pytest.raises(TypeError, match=r"module '1' \(Custom\) has tensors on the meta device but no reset_param"):
        ShardedParams(module)
