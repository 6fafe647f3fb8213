"""``zero1_scratch`` / ``zero2_scratch`` on real gloo processes: parity, memory floors, communication, checkpoints.

One set of worker processes per world size runs every fit the parity, memory and ledger tests need; the tests then
assert on the parts. N=3 exercises padding (the parity net's groups do not divide by 3).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.zero.stage12_state import full_state_dict
from tests.helpers.parity import (
    ParityConfig,
    ParityModule,
    assert_optimizer_states_equal,
    fit_lightning,
    make_trainer,
    max_abs_diff,
    reference_params,
    train_loader,
)
from tests.helpers.probes import ModelStateProbe
from tests.helpers.workers import run_workers

SLOW = pytest.mark.slow  # the rest of a matrix: in the slow run (CI runs both)

REPO_ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5
SMALL_BUCKET_MB = 1024 / 2**20  # 1 KiB: several buckets even on the small parity net

# (stage, grad_sync, accumulate_grad_batches, optimizer): every stage x mode x g with AdamW + norm clipping, and
# SGD without clipping, which (unlike AdamW) notices a gradient off by a constant factor.
VARIANTS = [(stage, sync, g, "adamw") for stage in (1, 2) for sync in ("boundary", "microbatch") for g in (1, 3)] + [
    (1, "boundary", 3, "sgd"),
    (2, "microbatch", 3, "sgd"),
]


# grad_reduction="reduce_scatter" ([Note: gradient reduction]): each bucket's pieces reduced into their owners.
REDUCE_SCATTER = [(2, "microbatch", 3, "adamw"), (2, "boundary", 3, "sgd"), (1, "microbatch", 1, "adamw")]


def _config(world_size: int, variant) -> ParityConfig:
    _, _, g, optimizer = variant
    if optimizer == "sgd":
        return ParityConfig(world_size, g, optimizer="sgd", gradient_clip_val=None, lr=0.05)
    return ParityConfig(world_size, g)


def _strategy(variant, **kwargs) -> ZeroStrategy:
    stage, sync, _, _ = variant
    return ZeroStrategy(stage=stage, grad_sync=sync, bucket_size_mb=SMALL_BUCKET_MB, **kwargs)


class _WideModule(ParityModule):
    """A wider net for the memory floors: padding and AdamW's scalar step counters are < 0.1% of its state."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 96), nn.LayerNorm(96), nn.Tanh(), nn.Linear(96, 96), nn.Linear(96, 3))


class _Probe(ModelStateProbe):
    """Memory at the end of fit (between steps), the ledger of every training batch, the layout."""

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        engine = trainer.strategy.engine
        self.padded = sum(g.layout.padded_numel for g in engine.groups)
        self.bucket_bytes = max(b.numel for b in engine.reducer.buckets) * 4
        self.state_numel = sum(
            v.numel() for s in trainer.optimizers[0].state.values() for v in s.values() if v.ndim > 0
        )


def _fit_probe(world_size: int, stage: int, grad_sync: str, g: int, module: ParityModule, **kwargs) -> dict:
    config = ParityConfig(world_size=world_size, accumulate_grad_batches=g, max_epochs=1)
    probe = _Probe()
    strategy = ZeroStrategy(stage=stage, grad_sync=grad_sync, bucket_size_mb=SMALL_BUCKET_MB, **kwargs)
    make_trainer(config, strategy, callbacks=[probe]).fit(module, train_loader(config))
    return vars(probe)


def _all_fits(world_size: int) -> dict:
    out = {}
    for variant in VARIANTS:
        out[variant] = fit_lightning(_config(world_size, variant), _strategy(variant))
    for stage in (1, 2):
        out[("memory", stage)] = _fit_probe(world_size, stage, None, 1, _WideModule())
        for sync in ("boundary", "microbatch"):
            out[("ledger", stage, sync)] = _fit_probe(world_size, stage, sync, 3, ParityModule())
    for variant in REDUCE_SCATTER:
        strategy = _strategy(variant, grad_reduction="reduce_scatter")
        out["reduce_scatter", variant] = fit_lightning(_config(world_size, variant), strategy)
    out["ledger", "reduce_scatter"] = _fit_probe(
        world_size, 2, "microbatch", 3, ParityModule(), grad_reduction="reduce_scatter"
    )
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"N{n}")
def fits(request):
    world_size = request.param
    return world_size, run_workers(_all_fits, world_size, world_size, timeout=500)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"stage{v[0]}-{v[1]}-g{v[2]}-{v[3]}")
def test_parity_with_single_process_reference(fits, variant):
    world_size, per_rank = fits
    ours = per_rank[0][variant]
    assert max_abs_diff(ours, reference_params(_config(world_size, variant))) <= TOLERANCE
    for rank_result in per_rank[1:]:
        assert max_abs_diff(rank_result[variant], ours) == 0.0
    assert max_abs_diff(ours, dict(ParityModule().net.state_dict())) > 1e3 * TOLERANCE


@pytest.mark.timeout(700)
@pytest.mark.parametrize("stage", [1, 2])
def test_model_state_bytes_at_the_floor(fits, stage):
    world_size, per_rank = fits
    for rank_result in per_rank:
        probe = rank_result[("memory", stage)]
        psi, memory = probe["psi"], probe["memory"]
        expected_grads = 4 * psi if stage == 1 else 4 * psi / world_size
        assert memory.params == pytest.approx(4 * psi, rel=0.01)
        assert memory.grads == pytest.approx(expected_grads, rel=0.01)
        assert memory.optimizer == pytest.approx(8 * psi / world_size, rel=0.01)
        floor = 4 * psi + expected_grads + 8 * psi / world_size
        assert memory.total - memory.strategy_buffers == pytest.approx(floor, rel=0.01)
        # persistent extras, reported separately: none for stage 1, the two-bucket pool for stage 2
        assert memory.strategy_buffers == (0 if stage == 1 else 2 * probe["bucket_bytes"])
    # AdamW's two moments per shard element: every rank holds the same count, the padded shard size
    counts = {r[("memory", stage)]["state_numel"] for r in per_rank}
    assert counts == {2 * per_rank[0][("memory", stage)]["padded"] // world_size}


@pytest.mark.timeout(700)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("grad_sync", ["boundary", "microbatch"])
def test_communication_per_optimizer_step(fits, stage, grad_sync):
    _, per_rank = fits
    g = 3
    for rank_result in per_rank:
        probe = rank_result[("ledger", stage, grad_sync)]
        padded_bytes = 4 * probe["padded"]
        batches = probe["batches"]
        for batch_idx, records in enumerate(batches):
            boundary = (batch_idx + 1) % g == 0 or batch_idx + 1 == len(batches)
            # grad_reduction="auto": each piece reduced into its owner where the buckets are transient (stage 2,
            # stage 1 with "microbatch"), the whole bucket all-reduced into stage 1's persistent flat gradient
            expected_op = "all_reduce" if (stage, grad_sync) == (1, "boundary") else "reduce"
            assert {op for op, tag, _ in records if tag == "grads"} <= {expected_op}
            grads = sum(b for op, tag, b in records if tag == "grads" and op == expected_op)
            params = sum(b for op, tag, b in records if tag == "params" and op == "all_gather")
            if grad_sync == "boundary":
                assert grads == (padded_bytes if boundary else 0)
            else:
                assert grads == padded_bytes  # every micro-batch reduces into the shard
            assert params == (padded_bytes if boundary else 0)
            assert 0 <= padded_bytes - 4 * probe["psi"] < 4 * 2 * len(per_rank)  # 4Ψ up to padding per group


@pytest.mark.timeout(700)
@pytest.mark.parametrize("variant", REDUCE_SCATTER, ids=lambda v: f"stage{v[0]}-{v[1]}-g{v[2]}-{v[3]}")
def test_reduce_scatter_to_owners_matches_the_reference(fits, variant):
    world_size, per_rank = fits
    ours = per_rank[0]["reduce_scatter", variant]
    assert max_abs_diff(ours, reference_params(_config(world_size, variant))) <= TOLERANCE
    for rank_result in per_rank[1:]:
        assert max_abs_diff(rank_result["reduce_scatter", variant], ours) == 0.0


@pytest.mark.timeout(700)
def test_reduce_scatter_reduces_each_piece_into_its_owner_only(fits):
    """Every micro-batch: ``reduce`` calls (one per piece of a bucket inside one shard) over exactly the padded
    flat bytes, and no gradient all-reduce; the shards are all-gathered at the boundary as before."""
    _, per_rank = fits
    for rank_result in per_rank:
        probe = rank_result["ledger", "reduce_scatter"]
        padded_bytes = 4 * probe["padded"]
        for batch_idx, records in enumerate(probe["batches"]):
            ops = {(op, tag) for op, tag, _ in records if tag in ("grads", "params")}
            boundary = (batch_idx + 1) % 3 == 0 or batch_idx + 1 == len(probe["batches"])
            assert ops == ({("reduce", "grads"), ("all_gather", "params")} if boundary else {("reduce", "grads")})
            assert sum(b for op, tag, b in records if (op, tag) == ("reduce", "grads")) == padded_bytes
            assert sum(1 for op, tag, _ in records if (op, tag) == ("reduce", "grads")) >= 2  # several pieces


# ----------------------------------------------------------------------------------------------- checkpoints
def _fit_and_save(world_size: int, stage: int, ckpt: str, epochs: int, state_dict_type: str = "sharded") -> dict:
    config = ParityConfig(world_size=world_size, batches_per_rank=3, max_epochs=epochs)
    module = ParityModule(config.lr)
    trainer = make_trainer(config, ZeroStrategy(stage=stage, state_dict_type=state_dict_type))
    trainer.fit(module, train_loader(config))
    if ckpt:
        trainer.save_checkpoint(ckpt)
    return {
        "params": {k: v.detach().clone() for k, v in module.net.state_dict().items()},
        "state": full_state_dict(trainer.strategy.engine.shards(0)),  # collective, after fit too
    }


class _CaptureOptimizerState(Callback):
    def on_train_start(self, trainer, pl_module):
        self.state = full_state_dict(trainer.strategy.engine.shards(0))


def _resume(world_size: int, stage: int, ckpt: str) -> dict:
    config = ParityConfig(world_size=world_size, batches_per_rank=3, max_epochs=2)
    module = ParityModule(config.lr)
    capture = _CaptureOptimizerState()
    trainer = make_trainer(config, ZeroStrategy(stage=stage), callbacks=[capture])  # reads either kind
    trainer.fit(module, train_loader(config), ckpt_path=ckpt)
    assert trainer.global_step == 6
    return {"params": {k: v.detach().clone() for k, v in module.net.state_dict().items()}, "state": capture.state}


def _straight_save_resume(stage: int, ckpt: str, state_dict_type: str) -> dict:
    straight = _fit_and_save(2, stage, "", epochs=2)
    saved = _fit_and_save(2, stage, ckpt, epochs=1, state_dict_type=state_dict_type)
    resumed = _resume(2, stage, ckpt)
    return {"straight": straight["params"], "saved_state": saved["state"], "resumed": resumed}


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("stage", "state_dict_type"),
    [(2, "sharded"), (1, "full"), pytest.param(1, "sharded", marks=SLOW), pytest.param(2, "full", marks=SLOW)],
)
def test_resume_is_bit_identical_and_reshards_to_another_world_size(tmp_path, stage, state_dict_type):
    ckpt = tmp_path / "epoch1.ckpt"
    result = run_workers(_straight_save_resume, 2, stage, str(ckpt), state_dict_type, timeout=300)[0]
    assert ckpt.is_dir() == (state_dict_type == "sharded")
    assert max_abs_diff(result["straight"], result["resumed"]["params"]) == 0.0
    saved_state = result["saved_state"]
    assert_optimizer_states_equal(result["resumed"]["state"], saved_state)
    if state_dict_type == "full":
        assert_optimizer_states_equal(torch.load(ckpt, weights_only=False)["optimizer_states"][0], saved_state)
    # N=2 -> N=3: the new world restores the same full optimizer state (gathered on rank 0 only), then trains on
    resharded = run_workers(_resume, 3, 3, stage, str(ckpt), timeout=300)
    assert_optimizer_states_equal(resharded[0]["state"], saved_state)
    for rank_result in resharded:
        assert rank_result is resharded[0] or rank_result["state"]["state"] == {}
        assert all(torch.isfinite(v).all() for v in rank_result["params"].values())


@pytest.mark.timeout(300)
def test_full_checkpoint_loads_into_plain_pytorch_without_lightning_zero(tmp_path):
    ckpt = tmp_path / "plain.ckpt"
    run_workers(_fit_and_save, 2, 2, 2, str(ckpt), 1, "full", timeout=200)
    code = textwrap.dedent(
        f"""
        import sys, torch
        from tests.helpers.parity import ParityModule
        module = ParityModule.load_from_checkpoint({str(ckpt)!r})
        optimizer = module.configure_optimizers()["optimizer"]
        optimizer.load_state_dict(torch.load({str(ckpt)!r}, weights_only=False)["optimizer_states"][0])
        shapes = [tuple(s["exp_avg"].shape) for s in optimizer.state.values()]
        assert shapes == [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]], shapes
        # one step counter per parameter: AdamW increments each in place, so a shared one would count per parameter
        steps = [s["step"] for s in optimizer.state.values()]
        assert len({{t.data_ptr() for t in steps}}) == len(steps), "parameters share a step tensor"
        assert "lightning_zero" not in sys.modules
        print("loaded", len(shapes))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["loaded", str(len(list(ParityModule().parameters())))]


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, "stage=4 is invalid: expected 1, 2 or 3"),
        ({"stage": 0}, "stage=0 is invalid: expected 1, 2 or 3"),
        ({"grad_sync": "sometimes"}, "grad_sync='sometimes' is invalid: expected one of"),
        ({"bucket_size_mb": 0}, "bucket_size_mb=0 is invalid"),
        ({"state_dict_type": "zip"}, "state_dict_type='zip' is invalid"),
        ({"grad_accum_dtype": "int8"}, "grad_accum_dtype='int8' is invalid: expected 'auto', one of"),
        ({"stage": 3, "grad_accum_dtype": "bf16"}, "grad_accum_dtype='bf16' applies to stages 1 and 2 only"),
        ({"grad_reduction": "tree"}, "grad_reduction='tree' is invalid: expected one of"),
        ({"stage": 3, "grad_reduction": "all_reduce"}, "grad_reduction='all_reduce' applies to stages 1 and 2 only"),
        ({"stage": 1, "grad_reduction": "reduce_scatter"}, "grad_reduction='reduce_scatter' needs stage=2, or"),
        ({"stage": 2, "shard_size": 0}, "shard_size=0 is invalid: expected an integer >= 1 or None"),
    ],
)
def test_bad_settings_raise_one_clear_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroStrategy(**kwargs)


class _TwoOptimizers(ParityModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False  # Lightning itself needs this for two optimizers

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):  # the first layer in both: ZeRO shards each parameter's state once
        return torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.net[0].parameters(), lr=0.1)


class _LBFGS(ParityModule):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5)


class _WiderFirstLayer(ParityModule):
    def __init__(self) -> None:
        super().__init__()
        self.net[0] = nn.Linear(6, 17)


def _bad_fit(case: str, ckpt: str) -> str:
    config = ParityConfig(world_size=1, batches_per_rank=2, max_epochs=1, gradient_clip_val=None)
    module = {"two_optimizers": _TwoOptimizers, "lbfgs": _LBFGS, "shape": _WiderFirstLayer}[case]()
    try:
        make_trainer(config, ZeroStrategy(stage=2)).fit(module, train_loader(config), ckpt_path=ckpt or None)
    except Exception as error:  # the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("state_dict_type", ["sharded", pytest.param("full", marks=SLOW)])
def test_a_parameter_in_two_optimizers_lbfgs_and_mismatched_checkpoints_fail_clearly(tmp_path, state_dict_type):
    ckpt = str(tmp_path / "one.ckpt")
    run_workers(_fit_and_save, 1, 1, 2, ckpt, 1, state_dict_type, timeout=150)
    cases = [("two_optimizers", ""), ("lbfgs", ""), ("shape", ckpt)]
    two, lbfgs, shape = (run_workers(_bad_fit, 1, case, path)[0] for case, path in cases)
    assert "ValueError: parameters ['net.0.weight', 'net.0.bias'] are in more than one param group or optimizer" in two
    assert lbfgs.startswith("ValueError: LBFGS cannot be sharded by ZeRO: its step re-evaluates the closure")
    assert f"CheckpointError: checkpoint {ckpt} is of another model: tensor 'net.0.weight' has shape" in shape
