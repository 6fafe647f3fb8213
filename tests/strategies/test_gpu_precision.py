"""Mixed precision on one CUDA device with NCCL (``python -m pytest -m gpu``; every test skips without CUDA).

Each of ``ddp_scratch``, ``zero1_scratch``, ``zero2_scratch`` and ``zero3_scratch`` fits the regression MLP of
``tests/strategies/test_mixed_precision.py`` on one GPU (``accelerator="gpu", devices=1``: the strategies pick NCCL on
CUDA), one epoch of its 24 samples (:data:`GPU_STEPS` AdamW steps, clipped), and is compared with that file's
single-process reference, run on CUDA too, which applies the same precision rules (:func:`rules_of`): fp32 master
weights, the values forward sees rounded to ``param_dtype`` (held in it under ``-true``), gradients accumulated and
reduced in fp32. At world size 1 the collectives of ``lightning_zero.comm.collectives`` copy locally (NCCL is
initialised, the process group is NCCL's, but no NCCL kernel runs): what these tests cover is the CUDA placement of the
shards, masters, gradients and scaler state, and the CUDA arithmetic of every precision path. The parity of the
collectives across ranks is covered on gloo by ``test_mixed_precision.py``.

Tolerance (:data:`GPU_TOLERANCE`, on the fp32 master weights): the CPU tests replay the strategies' arithmetic to 2e-6
because on one CPU thread the kernels sum in one fixed order. On CUDA the reference and the strategies call the same
kernels on the same shapes, but not always on the same memory: a ZeRO parameter is a view into a flat buffer at some
offset, a cast copy under autocast is not, and cuBLAS picks its algorithm (and so the order of the fp32 accumulation
inside a bf16/fp16 matmul) by alignment among other things; it is not bitwise reproducible against a different call
pattern. A last-bit fp32 difference becomes a one-ulp bf16 difference (2^-8 relative) wherever it crosses a rounding
boundary, and AdamW carries it into every later step. Measured on CPU, with these tests pointed at the CPU and gloo:
on one thread the strategies agree with the reference to 1.2e-7, while two threads, which change the summation order of
LayerNorm's weight gradient, alone move these masters by up to 1.5e-4 after the 6 steps; the masters themselves
move by about 6e-2 from their initial values, and one skipped or doubled AdamW step moves them by about the learning
rate, 1e-2. :data:`GPU_TOLERANCE` = 1e-3 is about 7x the summation-order effect and under a tenth of one step. The
measured difference is printed (``-s``) so a GPU log shows the margin. The byte counts of the communication ledger
check the dtypes exactly: parameters gathered in bf16 (2 bytes), gradients reduced in fp32 (4 bytes).

``16-mixed``: on CUDA Lightning builds the ``GradScaler`` itself (``init_scale`` 2^16) and the strategies replace it
with :class:`~lightning_zero.training.precision.ShardedGradScaler`. An inf put into the averaged gradient at one step
(rank 0: ZeRO's gradient shard, ``ddp_scratch``'s parameter gradient) makes that step a skipped one and halves the
scale, as the reference that injects the same inf does. The step is chosen where the reference's scale does not back off
by
itself: 2^16 overflows fp16 in the first steps of this model, and those natural overflows are replayed too.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from lightning_zero.training.precision import ShardedGradScaler
from tests.helpers.equivalence import max_diff
from tests.strategies.test_mixed_precision import (
    BATCH,
    STRATEGIES,
    Rules,
    _data,
    _fit,
    _net,
    reference,
    rules_of,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE, BACKEND = "cuda", "nccl"
GPU_STEPS = len(_data()) // BATCH  # one epoch at world size 1: 6 optimizer steps
GPU_TOLERANCE = 1e-3  # see the module docstring
LIGHTNING_INIT_SCALE = inspect.signature(torch.amp.GradScaler).parameters["init_scale"].default  # 2**16
PARAM_BYTES = 2  # ZeRO gathers in param_dtype: bf16 under both bf16 precisions
GATHERS_PER_STEP = {"zero1_scratch": 1, "zero2_scratch": 1, "zero3_scratch": 2}  # ZeRO-3: forward and backward


def _trainer_kwargs(precision: str) -> dict:
    """One GPU, Lightning's own precision plugin (and, for ``16-mixed``, its own ``GradScaler``), one epoch."""
    return {"accelerator": "gpu", "devices": 1, "precision": precision, "plugins": None, "max_epochs": 1}


def _gpu_fit(name: str, precision: str, **kwargs) -> dict:
    return _fit(name, precision, trainer_kwargs=_trainer_kwargs(precision), **kwargs)


def _reference(rules: Rules, inject_step: int | None = None, steps: int = GPU_STEPS) -> dict:
    return reference(rules, inject_step, world=1, steps=steps, device=DEVICE, init_scale=LIGHTNING_INIT_SCALE)


def _on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu() for k, v in tensors.items()}


@pytest.fixture
def nccl_env(monkeypatch):
    """A world of one in this process: Lightning's launcher starts nothing; the strategy initialises the group."""
    from tests.helpers.workers import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("name", STRATEGIES)
def test_matches_a_same_rules_reference_on_cuda(nccl_env, name, precision):
    """The fp32 masters (on the GPU) equal the CUDA reference's within :data:`GPU_TOLERANCE`; the module holds them
    after fit in its own dtype; the ledger shows bf16 gathers and fp32 gradient reductions."""
    run = _gpu_fit(name, precision)
    assert dist.is_initialized() and dist.get_backend() == BACKEND
    devices = {m.device.type for m in run["masters"].values()}
    assert devices == {DEVICE}, devices  # shards and masters live on the GPU
    assert len(run["losses"]) == GPU_STEPS and all(torch.isfinite(torch.tensor(run["losses"]))), run["losses"]

    expected = _reference(rules_of(name, precision))
    ours, theirs = _on_cpu(run["masters"]), _on_cpu(expected["masters"])
    difference = max_diff(ours, theirs)
    initial = {k: v.detach().to(rules_of(name, precision).compute).float() for k, v in _net().named_parameters()}
    moved = max_diff(theirs, initial)
    print(f"{name} {precision} on CUDA: max |masters - reference| {difference:.3g} (masters moved {moved:.3g})")
    assert moved > 10 * GPU_TOLERANCE, moved  # the comparison can tell a trained model from an untrained one
    assert difference <= GPU_TOLERANCE, (name, precision, difference)

    dtype = torch.float32 if precision.endswith("mixed") else torch.bfloat16
    assert set(run["dtypes"].values()) == {dtype}, run["dtypes"]
    assert max_diff(_on_cpu(run["state"]), {k: v.to(dtype).float() for k, v in ours.items()}) == 0

    def sent(op: str, tag: str) -> int:
        return run["ledger"].get((op, tag), (0, 0))[1]

    psi = run["psi"]
    reduced = sum(sent(op, "grads") for op in ("all_reduce", "reduce_scatter", "reduce"))  # reduce: to owners
    assert reduced == GPU_STEPS * 4 * psi, (reduced, psi)  # fp32: 4 bytes per gradient element, once per step
    if name in GATHERS_PER_STEP:  # world size 1: nothing to pad
        gathered = sent("all_gather", "params")
        assert gathered == GPU_STEPS * GATHERS_PER_STEP[name] * PARAM_BYTES * psi, (gathered, psi)


def _quiet_step(rules: Rules) -> int:
    """The first step from 2 on at which the reference's scale does not back off by itself (no natural overflow)."""
    scales = [LIGHTNING_INIT_SCALE] + [_reference(rules, steps=k)["scale"] for k in range(1, GPU_STEPS + 1)]
    quiet = [s for s in range(2, GPU_STEPS - 1) if scales[s + 1] == scales[s]]
    assert quiet, f"the fp16 reference overflows by itself at every step from 2 on: scales {scales}"
    return quiet[0]


@pytest.mark.parametrize("name", STRATEGIES)
def test_16_mixed_overflow_skips_the_step_and_halves_the_scale(nccl_env, monkeypatch, name):
    """Lightning's CUDA ``GradScaler`` replaced by the shard-aware one; an inf in the averaged gradient at one step:
    that step is skipped (the masters equal the reference that skips it, and differ from the run without the inf)
    and the scale ends at half the run without it."""
    unscaled = []
    original = ShardedGradScaler.unscale_

    def counting(self, optimizer):
        unscaled.append(self)
        return original(self, optimizer)

    monkeypatch.setattr(ShardedGradScaler, "unscale_", counting)
    rules = rules_of(name, "16-mixed")
    step = _quiet_step(rules)
    plain = _gpu_fit(name, "16-mixed")
    assert len(unscaled) == GPU_STEPS, "Lightning's GradScaler was not replaced by ShardedGradScaler"
    assert unscaled[0].get_scale() == plain["scale"]
    assert unscaled[0]._scale.device.type == DEVICE
    injected = _gpu_fit(name, "16-mixed", inject=(step, 0))
    expected = _reference(rules, inject_step=step)
    expected_plain = _reference(rules)

    assert plain["scale"] == expected_plain["scale"], (plain["scale"], expected_plain["scale"])
    assert injected["scale"] == expected["scale"] == plain["scale"] / 2, (step, injected["scale"], plain["scale"])
    ours = _on_cpu(injected["masters"])
    difference = max_diff(ours, _on_cpu(expected["masters"]))
    skipped = max_diff(ours, _on_cpu(plain["masters"]))
    print(
        f"{name} 16-mixed on CUDA, inf at step {step}: max |masters - reference| {difference:.3g},"
        f" vs the run without the inf {skipped:.3g}; scales {plain['scale']} -> {injected['scale']}"
    )
    assert difference <= GPU_TOLERANCE, difference
    assert max_diff(_on_cpu(plain["masters"]), _on_cpu(expected_plain["masters"])) <= GPU_TOLERANCE
    assert skipped > 2 * GPU_TOLERANCE, skipped  # the step was skipped
