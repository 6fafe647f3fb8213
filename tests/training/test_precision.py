"""The precision policy, its defaults and bad input, the shard-aware scaler's arithmetic, and the ZeRO paper's memory
accounting, without processes (``lightning_zero/training/precision.py``, ``lightning_zero/training/memory.py``)."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.training.memory import zero_model_state_bytes
from lightning_zero.training.precision import (
    MasterWeights,
    PrecisionPolicy,
    ShardedGradScaler,
    cast_floats,
    parse_dtype,
    resolve_policy,
    unified_precision,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    ("precision", "sharded", "expected"),
    [
        ("32-true", True, PrecisionPolicy()),
        ("32-true", False, PrecisionPolicy()),
        ("bf16-mixed", True, PrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, master_dtype=FP32)),
        ("bf16-mixed", False, PrecisionPolicy(reduce_dtype=FP32)),
        ("16-mixed", True, PrecisionPolicy(param_dtype=FP16, reduce_dtype=FP32, master_dtype=FP32)),
        ("bf16-true", True, PrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, master_dtype=FP32)),
        ("bf16-true", False, PrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, master_dtype=FP32)),
        ("16-true", False, PrecisionPolicy(param_dtype=FP16, reduce_dtype=FP32, master_dtype=FP32)),
    ],
)
def test_defaults_follow_the_trainer_precision(precision, sharded, expected):
    assert resolve_policy(precision, sharded=sharded) == expected


def test_settings_override_the_defaults():
    assert resolve_policy("bf16-mixed", sharded=True, param_dtype=None) == PrecisionPolicy(reduce_dtype=FP32)
    assert resolve_policy("bf16-mixed", sharded=True, reduce_dtype="bf16").reduce_dtype == BF16
    assert resolve_policy("32-true", sharded=False, reduce_dtype="bf16") == PrecisionPolicy(reduce_dtype=BF16)
    assert resolve_policy("bf16-true", sharded=True, master_weights=False).master_dtype is None
    cast = resolve_policy("bf16-mixed", sharded=False, cast_module=True)
    assert (cast.param_dtype, cast.cast_dtype, cast.master_dtype, cast.casts_module) == (BF16, BF16, FP32, True)
    assert resolve_policy("bf16-mixed", sharded=True, cast_module=True, master_weights=False).master_dtype is None


@pytest.mark.parametrize(
    ("precision", "settings", "message"),
    [
        ("32-true", {"param_dtype": "bf16"}, "param_dtype=torch.bfloat16 needs a low-precision Trainer precision"),
        ("32-true", {"cast_module": True}, "cast_module=True needs a low-precision Trainer precision"),
        ("bf16-mixed", {"param_dtype": "fp16"}, "param_dtype=torch.float16 conflicts with precision='bf16-mixed'"),
        ("bf16-true", {"param_dtype": "fp32"}, "conflicts with precision='bf16-true': expected torch.bfloat16"),
        ("bf16-mixed", {"param_dtype": None, "cast_module": True}, "cast_module=True casts the module"),
        ("bf16-mixed", {"sharded": False, "param_dtype": "bf16"}, "this strategy gathers none"),
        ("bf16-mixed", {"master_weights": False}, "would round only the other ranks' shards"),
    ],
)
def test_conflicting_settings_fail_with_the_numbers(precision, settings, message):
    settings = {"sharded": True, **settings}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_policy(precision, **settings)


@pytest.mark.parametrize("value", ["bfloat", "int8", 16, torch.int32])
def test_bad_dtype_names_are_refused(value):
    with pytest.raises(ValueError, match=r"reduce_dtype=.* is invalid: expected 'auto', one of \['bf16'"):
        parse_dtype("reduce_dtype", value)


def test_dtype_spellings_and_legacy_precisions():
    assert parse_dtype("x", "bfloat16") is BF16 and parse_dtype("x", torch.float16) is FP16
    assert parse_dtype("x", None) is None and parse_dtype("x", "auto") == "auto"
    assert [unified_precision(v) for v in ("bf16", 16, 32, "bf16-true")] == [
        "bf16-mixed",
        "16-mixed",
        "32-true",
        "bf16-true",
    ]


def test_cast_floats_leaves_integer_tensors():
    batch = {"x": torch.ones(2), "ids": torch.arange(3), "pair": (torch.zeros(1), 7)}
    out = cast_floats(batch, BF16)
    assert out["x"].dtype == BF16 and out["ids"].dtype == torch.int64 and out["pair"][0].dtype == BF16


def test_sharded_scaler_keeps_settings_and_state_and_skips_alone_without_a_group():
    """One process (no group): the sharded scaler behaves as GradScaler; ``like`` copies settings and state."""
    plain = torch.amp.GradScaler("cpu", init_scale=256.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=5)
    plain.scale(torch.ones(()))  # creates the scale tensor
    sharded = ShardedGradScaler.like(plain)
    assert sharded.get_scale() == 256.0 and sharded.get_growth_factor() == 3.0
    assert sharded.get_backoff_factor() == 0.25 and sharded.get_growth_interval() == 5
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([w], lr=1.0)
    sharded.scale(torch.ones(()))
    w.grad = torch.tensor([1.0, float("inf"), 1.0])
    sharded.unscale_(optimizer)
    sharded.step(optimizer)
    sharded.update()
    assert torch.equal(w.detach(), torch.ones(3)) and sharded.get_scale() == 64.0  # skipped, backed off


def test_the_zero_papers_worked_example():
    """Rajbhandari et al. 2020, figure 1: Ψ = 7.5B, N = 64, mixed-precision Adam (K = 12)."""
    gb = [zero_model_state_bytes(stage, 7.5e9, 64) / 1e9 for stage in (0, 1, 2, 3)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.88], abs=0.06)


def test_fp32_floors_and_bad_stage():
    psi, n = 1000, 4
    fp32 = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}
    floors = [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n]
    assert [zero_model_state_bytes(s, psi, n, **fp32) for s in range(4)] == floors
    with pytest.raises(ValueError, match="stage=4 is invalid: expected 0 \\(DDP\\), 1, 2 or 3"):
        zero_model_state_bytes(4, psi, n)


def test_master_weights_take_over_the_state_an_optimizer_made_in_its_constructor():
    """Adagrad makes its sums when built: over bf16 parameters they move to the fp32 masters the optimizer then steps,
    as Adagrad over fp32 copies of the parameters steps."""
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3, 4, generator=g).to(BF16))
    grad = torch.randn(3, 4, generator=g)
    reference = torch.nn.Parameter(weight.detach().float())
    optimizer = torch.optim.Adagrad([weight], lr=0.1, initial_accumulator_value=0.5)
    masters = MasterWeights(optimizer, FP32, {})
    (master,) = optimizer.param_groups[0]["params"]
    assert weight not in optimizer.state and optimizer.state[master]["sum"].dtype == FP32
    reference.grad, master.grad = grad.clone(), grad.clone()
    torch.optim.Adagrad([reference], lr=0.1, initial_accumulator_value=0.5).step()
    optimizer.step()
    masters.after_step()
    assert torch.equal(master.detach(), reference.detach())
    assert torch.equal(weight.detach(), reference.detach().to(BF16))
