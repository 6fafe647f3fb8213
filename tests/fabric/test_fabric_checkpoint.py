"""``fabric.save`` / ``fabric.load`` under every strategy (``lightning_zero/fabric/checkpoint.py``,
``lightning_zero/zero/checkpointing.py``): resume bit-identically, at another world size, ``fabric.load_raw``,
checkpoints shared with the Trainer strategies, and ``fabric.init_module(empty_init=True)`` under ZeRO-3.

The loop is the one of ``tests/fabric/test_fabric.py`` (accumulation through ``no_backward_sync``, global-norm
clipping, AdamW and StepLR). Resuming is compared with the straight run exactly, and with Fabric's own ``ddp`` and a
single-process reference within float summation order.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import lightning_zero
from tests.fabric.test_fabric import ACCUM, CLIP, TOLERANCE, WORLD, _batch, _optimizer_and_scheduler, _reference
from tests.helpers.equivalence import max_diff
from tests.helpers.parity import quiet_trainer
from tests.helpers.workers import run_workers

STEPS, SAVED_AT = 3, 2
CASES = [
    ("ddp_scratch", "full"),
    ("zero1_scratch", "sharded"),
    ("zero1_scratch", "full"),
    ("zero2_scratch", "sharded"),
    ("zero2_scratch", "full"),
    ("zero3_scratch", "sharded"),
    ("zero3_scratch", "full"),
    ("robust_ddp_scratch", "full"),
    ("robust_momentum", "full"),  # worker momentum: rows that only the checkpoint carries across
]


def _strategy(name: str, state_dict_type: str = "sharded"):
    if name in ("ddp", "ddp_scratch", "robust_ddp_scratch"):
        return name
    if name == "robust_momentum":
        return lightning_zero.fabric.RobustDDPStrategy("median", worker_momentum=0.5)
    return lightning_zero.fabric.ZeroStrategy(stage=int(name[4]), state_dict_type=state_dict_type)


def _net() -> nn.Module:  # test_fabric's net, seeded by the caller: a meta-device build replays that random state
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _weights(fabric: Fabric, model: nn.Module) -> dict[str, torch.Tensor]:
    engine = fabric.strategy.engine if hasattr(fabric.strategy, "engine") else None
    with engine.summon_full_params() if hasattr(engine, "summon_full_params") else nullcontext():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(fabric: Fabric, steps: int, path: str | None = None, resume: str | None = None, empty_init: bool = False):
    """A fresh model, optimizer and scheduler set up; ``resume`` loaded; ``steps`` more optimizer steps; saved to
    ``path``. Returns the weights, the LR and what ``fabric.load`` left."""
    torch.manual_seed(7)
    with fabric.init_module(empty_init=empty_init):
        model = _net()
    optimizer, scheduler = _optimizer_and_scheduler(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    remainder = fabric.load(resume, state) if resume is not None else {}
    for step in range(state["step"], state["step"] + steps):
        for micro in range(ACCUM):
            x, y = _batch(fabric.global_rank, step, micro, fabric.world_size)
            with fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                fabric.backward(F.mse_loss(model(x), y) / ACCUM)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    state["step"] += steps
    if path is not None:
        fabric.save(path, state)
    return {"weights": _weights(fabric, model), "lr": optimizer.param_groups[0]["lr"], "remainder": remainder}


def straight_and_resumed(train, fabric: Fabric, path: str, steps: int = STEPS, saved_at: int = SAVED_AT) -> dict:
    """``train(fabric, steps, path=, resume=)`` straight for ``steps``, and for ``saved_at`` steps saved to ``path``,
    then loaded into a fresh setup and continued to ``steps``."""
    straight = train(fabric, steps)
    train(fabric, saved_at, path=path)
    return {"straight": straight, "resumed": train(fabric, steps - saved_at, resume=path)}


def _resume_every_strategy(directory: str) -> dict:
    out = {}
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy="ddp")
    fabric.launch()
    out["ddp"] = _train(fabric, STEPS)
    for name, kind in CASES:
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=_strategy(name, kind))
        fabric.launch()
        out[name, kind] = straight_and_resumed(_train, fabric, f"{directory}/{name}-{kind}.ckpt")
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return run_workers(_resume_every_strategy, WORLD, str(tmp_path_factory.mktemp("resume")), timeout=400)


@pytest.mark.timeout(450)
@pytest.mark.parametrize(("name", "kind"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_save_fresh_setup_load_continue_equals_the_straight_run(resumed, name, kind):
    reference = _reference((WORLD,) * STEPS)
    for rank_run in resumed:
        run = rank_run[name, kind]
        assert all(torch.equal(run["resumed"]["weights"][k], v) for k, v in run["straight"]["weights"].items())
        assert run["resumed"]["lr"] == run["straight"]["lr"] == pytest.approx(0.05 * 0.5**STEPS)
        assert run["resumed"]["remainder"] == {}  # every entry of the saved state went back into its object
        if name == "robust_momentum":
            continue  # worker momentum is not Fabric ddp's training
        assert max_diff(run["resumed"]["weights"], rank_run["ddp"]["weights"]) <= TOLERANCE
        assert max_diff(run["resumed"]["weights"], reference) <= TOLERANCE


def _save_at_two(directory: str) -> None:
    for name, kind in (("zero2_scratch", "sharded"), ("zero3_scratch", "sharded"), ("zero1_scratch", "full")):
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=_strategy(name, kind))
        fabric.launch()
        _train(fabric, SAVED_AT, path=f"{directory}/{name}-{kind}.ckpt")


def _resume_at_three(directory: str) -> dict:
    out = {}
    for name, kind in (("zero2_scratch", "sharded"), ("zero3_scratch", "sharded"), ("zero1_scratch", "full")):
        fabric = Fabric(accelerator="cpu", devices=3, strategy=_strategy(name, kind))
        fabric.launch()
        out[name] = _train(fabric, 1, resume=f"{directory}/{name}-{kind}.ckpt")
    return out


@pytest.mark.slow  # by default: the same ZeroCheckpointer resharding in tests/strategies/test_zero*.py (Trainer)
@pytest.mark.timeout(400)
def test_a_checkpoint_of_two_ranks_resumes_on_three(tmp_path):
    """Saved by 2 ranks (sharded, or full from stage 1), loaded by 3, one more step on 3 ranks' data: the single-process
    reference of that schedule, within float summation order."""
    run_workers(_save_at_two, WORLD, str(tmp_path), timeout=200)
    reference = _reference((WORLD,) * SAVED_AT + (3,))
    for rank_run in run_workers(_resume_at_three, 3, str(tmp_path), timeout=200):
        for name, run in rank_run.items():
            assert max_diff(run["weights"], reference) <= TOLERANCE, name


class _AdamBoring(BoringModel):
    """Lightning's demo model, with optimizer state to carry across (AdamW) and a scheduler."""

    def configure_optimizers(self):
        optimizer, scheduler = _optimizer_and_scheduler(self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _trainer(name: str, kind: str, steps: int) -> Trainer:
    return quiet_trainer(lightning_zero.ZeroStrategy(stage=int(name[4]), state_dict_type=kind), max_steps=steps)


def _fabric_boring(name: str, kind: str):
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=_strategy(name, kind))
    fabric.launch()
    model = _AdamBoring()
    optimizer, scheduler = _optimizer_and_scheduler(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer, scheduler


def _trainer_and_fabric(directory: str, name: str, kind: str) -> dict:
    """Trainer fit -> save -> Fabric load; Fabric steps -> save -> Trainer fit(ckpt_path) restores the same."""
    torch.manual_seed(0)
    module = _AdamBoring()
    trainer = _trainer(name, kind, steps=3)
    trainer.fit(module, DataLoader(RandomDataset(32, 64), batch_size=2))
    trainer.save_checkpoint(f"{directory}/trainer.ckpt")
    engine = trainer.strategy.engine
    with engine.summon_full_params() if hasattr(engine, "summon_full_params") else nullcontext():
        trainer_weights = {k: v.detach().clone() for k, v in module.state_dict().items()}

    fabric, model, optimizer, scheduler = _fabric_boring(name, kind)
    remainder = fabric.load(f"{directory}/trainer.ckpt", {"model": model, "optimizer": optimizer, "lr": scheduler})
    into_fabric = {"weights": _weights(fabric, model), "lr": optimizer.param_groups[0]["lr"], "step": remainder}
    loss = model(torch.randn(2, 32)).sum()  # one more step, then the other way
    fabric.backward(loss)
    optimizer.step()
    scheduler.step()
    fabric.save(f"{directory}/fabric.ckpt", {"model": model, "optimizer": optimizer, "lr": scheduler})
    fabric_weights, fabric_lr = _weights(fabric, model), optimizer.param_groups[0]["lr"]

    seen = {}

    class Probe(_AdamBoring):
        def on_train_start(self):  # after the checkpoint was restored, before any step
            engine = self.trainer.strategy.engine
            with engine.summon_full_params() if hasattr(engine, "summon_full_params") else nullcontext():
                seen["weights"] = {k: v.detach().clone() for k, v in self.state_dict().items()}
            seen["lr"] = self.trainer.optimizers[0].param_groups[0]["lr"]

    trainer = _trainer(name, kind, steps=1)
    trainer.fit(Probe(), DataLoader(RandomDataset(32, 64), batch_size=2), ckpt_path=f"{directory}/fabric.ckpt")
    return {
        "trainer": trainer_weights,
        "into_fabric": into_fabric,
        "fabric": {"weights": fabric_weights, "lr": fabric_lr},
        "into_trainer": seen,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("name", "kind"), [("zero2_scratch", "sharded"), pytest.param("zero3_scratch", "full", marks=pytest.mark.slow)]
)
def test_trainer_and_fabric_checkpoints_load_in_each_other(tmp_path, name, kind):
    for rank_run in run_workers(_trainer_and_fabric, WORLD, str(tmp_path), name, kind, timeout=240):
        into_fabric, fabric, into_trainer = rank_run["into_fabric"], rank_run["fabric"], rank_run["into_trainer"]
        assert all(torch.equal(into_fabric["weights"][k], v) for k, v in rank_run["trainer"].items())
        assert into_fabric["lr"] == pytest.approx(0.05 * 0.5**3)  # the scheduler's state came back
        assert into_fabric["step"]["global_step"] == 3  # the Trainer's own entries are returned to the loop
        assert max_diff(fabric["weights"], rank_run["trainer"]) > 0  # the Fabric step changed them
        assert all(torch.equal(into_trainer["weights"][k], v) for k, v in fabric["weights"].items())
        assert into_trainer["lr"] == fabric["lr"]


def _load_raw_and_bad_input(directory: str) -> dict:
    torch.manual_seed(3)
    source = _net()
    torch.save(source.state_dict(), f"{directory}/plain.pt")
    out = {"source": {k: v.clone() for k, v in source.state_dict().items()}}
    for name in ("zero1_scratch", "zero3_scratch"):
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=_strategy(name))
        fabric.launch()
        torch.manual_seed(4)
        model = _net()
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
        fabric.load_raw(f"{directory}/plain.pt", model)
        out[name] = _weights(fabric, model)
        fabric.save(f"{directory}/{name}", {"model": model, "optimizer": optimizer})
        out[name, "errors"] = _errors(fabric, f"{directory}/{name}", model, optimizer)
    return out


def _errors(fabric: Fabric, path: str, model: nn.Module, optimizer) -> list[str | None]:
    errors = []
    for call in (
        lambda: fabric.load(path, {"model": model, "optimizer": optimizer, "epoch": 0}),
        lambda: fabric.load(path),
        lambda: fabric.save(f"{path}-filtered", {"model": model}, filter={"model": lambda k, v: True}),
        lambda: fabric.save(f"{path}-reserved", {"state_dict": model}),
    ):
        try:
            call()
            errors.append(None)
        except (KeyError, ValueError) as error:
            errors.append(str(error))
    return errors


@pytest.mark.timeout(300)
def test_load_raw_of_a_plain_module_file_and_clear_errors(tmp_path):
    for rank_run in run_workers(_load_raw_and_bad_input, WORLD, str(tmp_path), timeout=240):
        for name in ("zero1_scratch", "zero3_scratch"):
            assert all(torch.equal(rank_run[name][k], v) for k, v in rank_run["source"].items())
            missing, whole, filtered, reserved = rank_run[name, "errors"]
            assert "has nothing for the state's ['epoch']: pass strict=False" in missing
            assert "is a sharded checkpoint: it loads into objects" in whole
            assert "fabric.save(filter=...) writes full checkpoints only" in filtered
            assert "the state key 'state_dict' is reserved by the checkpoint layout" in reserved


def _empty_init() -> dict:
    from lightning_zero.zero.stage3.engine import ShardedParams

    peak, original = [0], ShardedParams._load_param

    def sampled(engine, p):  # real parameter bytes while the engine builds the model: shards + full tensors
        original(engine, p)
        full = {id(q): q for q in engine.module.parameters() if not q.is_meta and q.untyped_storage().nbytes() > 4}
        total = sum(q.untyped_storage().nbytes() for q in full.values())
        peak[0] = max(peak[0], total + sum(s.shard.nbytes for s in engine.segments))

    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy="zero3_scratch")
    fabric.launch()
    normal = _train(fabric, 1)
    ShardedParams._load_param = sampled
    try:
        empty = _train(fabric, 1, empty_init=True)
    finally:
        ShardedParams._load_param = original
    return {"normal": normal["weights"], "empty": empty["weights"], "peak": peak[0]}


@pytest.mark.timeout(300)
def test_init_module_empty_init_builds_zero3_without_a_whole_model():
    """``fabric.init_module(empty_init=True)``: the model is built on the meta device and materialised unit by unit,
    with the weights of a normal build (every module initialises through ``reset_parameters()``); no rank ever holds
    more than its shards plus one module's full parameters."""
    psi = sum(p.numel() for p in _net().parameters())
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in _net().modules()) * 4
    for rank_run in run_workers(_empty_init, WORLD, timeout=240):
        assert all(torch.equal(rank_run["empty"][k], v) for k, v in rank_run["normal"].items())
        assert 0 < rank_run["peak"] <= 4 * psi / WORLD + 4 * WORLD + largest_module
        assert rank_run["peak"] < 4 * psi  # never the whole model
