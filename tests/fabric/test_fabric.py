"""Every strategy under Lightning Fabric (``lightning_zero/fabric/``) against Fabric's own ``ddp`` and a
single-process reference.

One pair of gloo worker processes runs the same Fabric loop under each strategy: gradient accumulation through
``fabric.no_backward_sync``, ``fabric.clip_gradients`` (global norm), AdamW and a ``StepLR`` scheduler. Each rank
reads its own slice of the data in a fixed order (no sampler). The reference sums the ranks' micro-batch gradients in
one process; the tolerance is float summation order.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.nn import functional as F

import lightning_zero
from lightning_zero.comm import collectives as comm
from tests.helpers.equivalence import max_diff
from tests.helpers.workers import run_workers

WORLD, ACCUM, STEPS, BATCH = 2, 2, 3, 4
CLIP, TOLERANCE = 0.3, 1e-5
OURS = ("ddp_scratch", "zero1_scratch", "zero2_scratch", "zero3_scratch")
# grad_sync="boundary" (ddp_scratch, stage 1's default) communicates nothing on non-boundary micro-batches;
# "microbatch" (stage 2 and 3's default) reduces every micro-batch into the gradient shard.
SILENT_WHEN_ACCUMULATING = {"ddp_scratch": True, "zero1_scratch": True, "zero2_scratch": False, "zero3_scratch": False}


def _net() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(rank: int, step: int, micro: int, world: int = WORLD) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch; the ranks of a world size other than ``WORLD`` read data of their own."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank + 100 * (world != WORLD))
    x = torch.randn(BATCH, 6, generator=g)
    return x, x[:, :1] * 2 - x[:, 1:2]


def _optimizer_and_scheduler(params) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _fabric_loop(strategy, world: int = WORLD) -> dict:
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()  # the workers are torchrun-like processes: nothing is launched
    optimizer, scheduler = _optimizer_and_scheduler((model := _net()).parameters())
    model, optimizer = fabric.setup(model, optimizer)
    silent = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            boundary = micro == ACCUM - 1
            comm.LEDGER.reset()
            x, y = _batch(fabric.global_rank, step, micro, world)
            with fabric.no_backward_sync(model, enabled=not boundary):
                fabric.backward(F.mse_loss(model(x), y) / ACCUM)
            if not boundary:
                # no gradient bytes by any collective (all-reduce, reduce-scatter, reduce to owners)
                silent.append(sum(nbytes for _, tag, nbytes in comm.LEDGER.records if tag == "grads") == 0)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    engine = getattr(fabric.strategy, "engine", None)
    with engine.summon_full_params() if hasattr(engine, "summon_full_params") else nullcontext():
        weights = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return {"weights": weights, "silent": silent, "strategy": type(fabric.strategy).__module__}


def _all_loops() -> dict:
    runs = {name: _fabric_loop(name) for name in ("ddp", *OURS)}
    runs["zero3_instance"] = _fabric_loop(lightning_zero.fabric.ZeroStrategy(stage=3, auto_wrap_policy={nn.Linear}))
    runs["zero2_checkpointed"] = _fabric_loop(
        lightning_zero.fabric.ZeroStrategy(stage=2, activation_checkpointing_policy={nn.Tanh, nn.Linear})
    )
    return runs


def _masters_fit(fabric: Fabric, steps: int, path: str | None = None, resume: str | None = None) -> dict:
    """``ddp_scratch`` under ``bf16-true`` (fp32 masters): ``steps`` optimizer steps, after loading ``resume`` and
    before saving to ``path``; returns the masters."""
    optimizer, _ = _optimizer_and_scheduler((model := _net()).parameters())
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume is not None:
        fabric.load(resume, state)
    for step in range(state["step"], state["step"] + steps):
        x, y = _batch(fabric.global_rank, step, 0)
        fabric.backward(F.mse_loss(model(x.bfloat16()).float(), y))
        optimizer.step()
        optimizer.zero_grad()
    state["step"] += steps
    if path is not None:
        fabric.save(path, state)
    return {"masters": [m.detach().clone() for _, m in fabric.strategy.engine.master_pairs]}


def _masters_resume(directory: str) -> dict:
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy="ddp_scratch", precision="bf16-true")
    fabric.launch()
    straight = _masters_fit(fabric, 3)
    _masters_fit(fabric, 2, path=f"{directory}/masters.ckpt")
    return {"straight": straight, "resumed": _masters_fit(fabric, 1, resume=f"{directory}/masters.ckpt")}


@pytest.mark.timeout(300)
def test_ddp_scratch_saves_and_resumes_its_fp32_masters(tmp_path):
    """``fabric.save`` carries each parameter's fp32 master in the optimizer state and ``fabric.load`` puts it back
    (not the bf16 weights' rounded value): 2 steps, save, a fresh setup, load, 1 step equals 3 steps."""
    for rank_run in run_workers(_masters_resume, WORLD, str(tmp_path), timeout=240):
        straight, resumed = rank_run["straight"]["masters"], rank_run["resumed"]["masters"]
        assert straight and all(m.dtype == torch.float32 for m in straight)
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


@pytest.fixture(scope="module")
def runs():
    return run_workers(_all_loops, WORLD, timeout=300)


def _reference(worlds: tuple[int, ...] = (WORLD,) * STEPS) -> dict[str, torch.Tensor]:
    """One process; step ``i`` sums the micro-batches of ``worlds[i]`` ranks (see :func:`_batch`)."""
    model = _net()
    optimizer, scheduler = _optimizer_and_scheduler(model.parameters())
    for step, world in enumerate(worlds):
        for rank in range(world):
            for micro in range(ACCUM):
                x, y = _batch(rank, step, micro, world)
                (F.mse_loss(model(x), y) / ACCUM / world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [*OURS, "zero3_instance", "zero2_checkpointed"])
def test_fabric_loop_equals_fabric_ddp_and_the_reference(runs, name):
    reference = _reference()
    for rank_runs in runs:
        assert rank_runs[name]["strategy"].startswith("lightning_zero.fabric")
        assert max_diff(rank_runs[name]["weights"], rank_runs["ddp"]["weights"]) <= TOLERANCE
        assert max_diff(rank_runs[name]["weights"], reference) <= TOLERANCE
    assert max_diff(runs[0]["ddp"]["weights"], {k: v * 0 for k, v in reference.items()}) > 1e-2  # it trained


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", OURS)
def test_no_backward_sync_communicates_nothing_where_the_strategy_says(runs, name):
    for rank_runs in runs:
        assert rank_runs[name]["silent"] == [SILENT_WHEN_ACCUMULATING[name]] * STEPS


@pytest.mark.parametrize("name", ["ddp_scratch", "zero1_scratch", "zero2_scratch", "zero3_scratch"])
def test_names_are_registered_with_fabric(name):
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    assert STRATEGY_REGISTRY[name]["strategy"].__module__.startswith("lightning_zero.fabric")
    assert f"{name}_spawn" in STRATEGY_REGISTRY


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, "stage=4 is invalid: expected 1, 2 or 3"),
        ({"grad_sync": "sometimes"}, "grad_sync='sometimes' is invalid"),
        ({"stage": 1, "auto_wrap_policy": {nn.Linear}}, "auto_wrap_policy apply to stage=3 only: got stage=1"),
        ({"process_group_backend": "smoke"}, "process_group_backend='smoke' is invalid"),
        ({"param_dtype": "int8"}, "param_dtype='int8' is invalid"),
    ],
)
def test_bad_settings_raise_the_trainer_strategies_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lightning_zero.fabric.ZeroStrategy(**kwargs)
    with pytest.raises(ValueError, match=message):
        lightning_zero.ZeroStrategy(**kwargs)


def _collectives() -> dict:
    out = {}
    for name in (*OURS, "robust_ddp_scratch"):
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=name)
        fabric.launch()
        rank = torch.tensor([float(fabric.global_rank + 1)])
        fabric.barrier()
        out[name] = {
            "sum": fabric.all_reduce(rank.clone(), reduce_op="sum"),
            "mean": fabric.all_reduce(rank.clone(), reduce_op="mean"),
            "gathered": fabric.all_gather({"r": rank, "pair": torch.stack([rank, rank * 10])}),
            "tensor": fabric.broadcast(rank.clone(), src=1),
            "object": fabric.broadcast({"from": fabric.global_rank}, src=0),
        }
    return out


@pytest.mark.timeout(300)
def test_fabric_collectives_on_every_strategy():
    for rank_runs in run_workers(_collectives, WORLD, timeout=240):
        for name, got in rank_runs.items():
            assert got["sum"].item() == 3.0 and got["mean"].item() == 1.5, name
            assert torch.equal(got["gathered"]["r"], torch.tensor([[1.0], [2.0]])), name
            assert torch.equal(got["gathered"]["pair"][:, :, 0], torch.tensor([[1.0, 10.0], [2.0, 20.0]])), name
            assert got["tensor"].item() == 2.0 and got["object"] == {"from": 0}, name


def _separate_setup_value_clip(name: str, clip: bool = True) -> dict:
    """``fabric.setup_module``, then the optimizer built over the set-up module and ``fabric.setup_optimizers`` (the
    order FSDP asks for), and clipping by value."""
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=name)
    fabric.launch()
    model = fabric.setup_module(_net())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    for step in range(2):
        x, y = _batch(fabric.global_rank, step, 0)
        fabric.backward(F.mse_loss(model(x), y))
        if clip:
            fabric.clip_gradients(model, optimizer, clip_val=0.01)
        optimizer.step()
        optimizer.zero_grad()
    engine = getattr(fabric.strategy, "engine", None)
    with engine.summon_full_params() if hasattr(engine, "summon_full_params") else nullcontext():
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _separate_setups() -> dict:
    runs = {name: _separate_setup_value_clip(name) for name in ("ddp", *OURS, "robust_ddp_scratch")}
    return {**runs, "unclipped": _separate_setup_value_clip("ddp", clip=False)}


@pytest.mark.timeout(300)
def test_setup_module_then_optimizers_and_clipping_by_value():
    for rank_runs in run_workers(_separate_setups, WORLD, timeout=240):
        for name in (*OURS, "robust_ddp_scratch"):
            assert max_diff(rank_runs[name], rank_runs["ddp"]) <= TOLERANCE, name
        assert max_diff(rank_runs["ddp"], rank_runs["unclipped"]) > 1e-2  # the clipping mattered
