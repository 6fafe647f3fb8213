"""The Byzantine ranks mode under Lightning Fabric (``lightning_zero/fabric/robust.py`` with
``lightning_zero/byzantine/front_end.py``): 4 gloo processes, f = 1.

Without a faulty rank the loop trains as ``sharded_aggregation=True`` of the same rule; an equivocating rank 3 is
proven and evicted after step 0, the honest ranks' weights bit-identical after every step; the strategy's collectives
(``fabric.all_reduce``, ``fabric.barrier``, a checkpoint's state) run over the signed transport once the protocol does.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from lightning.fabric import Fabric
from torch.nn import functional as F

import lightning_zero
from lightning_zero.robust.engine import CHECKPOINT_KEY
from tests.fabric.test_fabric import _batch, _net, _optimizer_and_scheduler
from tests.helpers.equivalence import max_diff
from tests.helpers.workers import run_workers

pytest.importorskip("cryptography")
WORLD, STEPS = 4, 3
RULE = dict(aggregator="centered_clipping", f=1, aggregator_kwargs={"tau": 0.5}, worker_momentum=0.5)
BYZANTINE = {"byzantine_ranks": 1, "byzantine_timeout": 20.0}
MODES = {
    "sharded": {"sharded_aggregation": True},
    "byzantine": BYZANTINE,
    "equivocate": {**BYZANTINE, "byzantine_rank_behaviour": "equivocate"},
}


def _digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(v.detach().numpy().tobytes() for v in model.state_dict().values())).hexdigest()


def _loop(mode: dict) -> dict:
    strategy = lightning_zero.fabric.RobustDDPStrategy(**RULE, **mode)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    optimizer, scheduler = _optimizer_and_scheduler((model := _net()).parameters())
    model, optimizer = fabric.setup(model, optimizer)
    digests, metrics, losses = [], [], []
    for step in range(STEPS):
        x, y = _batch(fabric.global_rank, step, 0, WORLD)
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.3)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        digests.append(_digest(model.module))
        metrics.append(fabric.strategy.metrics)
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())  # over the signed transport
    fabric.barrier()
    state = fabric.strategy._strategy_state()[CHECKPOINT_KEY]
    exchange = strategy.byzantine_exchange
    out = {
        "weights": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
        "digests": digests,
        "metrics": metrics,
        "losses": losses,
        "evictions": [] if exchange is None else [(s, r) for s, r, _ in exchange.evictions],
        "checkpoint_members": None if exchange is None else state["byzantine"]["protocol"]["members"],
    }
    fabric.strategy.teardown()
    return out


def _loops() -> dict:
    return {name: _loop(mode) for name, mode in MODES.items()}


@pytest.mark.timeout(600)
def test_byzantine_ranks_under_fabric_train_as_sharded_aggregation_and_evict_an_equivocating_rank():
    ranks = run_workers(_loops, WORLD, timeout=500)
    for r in ranks:
        assert max_diff(r["byzantine"]["weights"], r["sharded"]["weights"]) <= 1e-6  # up to float sum order
        assert r["byzantine"]["evictions"] == [] and r["byzantine"]["metrics"][-1]["byzantine/members"] == 4.0
    honest = ranks[:3]
    for r in honest:
        run = r["equivocate"]
        assert run["digests"] == honest[0]["equivocate"]["digests"]  # safety after every step
        assert run["evictions"] == [(0, 3)] and run["metrics"][-1]["byzantine/members"] == 3.0
        assert run["checkpoint_members"] == [0, 1, 2]
        assert run["losses"] == honest[0]["equivocate"]["losses"]  # one value of the tolerant all-reduce
    assert max_diff(honest[0]["equivocate"]["weights"], honest[0]["byzantine"]["weights"]) > 1e-4


def test_bad_byzantine_settings_are_refused_when_fabric_is_built():
    strategy = lightning_zero.fabric.RobustDDPStrategy("median", f=1, byzantine_ranks=1)
    with pytest.raises(ValueError, match=r"byzantine_ranks=1 needs at least 3f \+ 1 = 4 processes, got 3"):
        Fabric(accelerator="cpu", devices=3, strategy=strategy)
    with pytest.raises(ValueError, match=r"byzantine_ranks needs a robust rule"):
        lightning_zero.fabric.RobustDDPStrategy("mean", byzantine_ranks=1)


def test_the_byzantine_mode_launches_without_lightnings_child_process_observer():
    from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from lightning_zero.byzantine.launcher import FabricLauncher

    def launcher(**kwargs):
        strategy = lightning_zero.fabric.RobustDDPStrategy("median", f=1, **kwargs)
        return Fabric(accelerator="cpu", devices=4, strategy=strategy).strategy.launcher

    assert type(launcher(byzantine_ranks=1)) is FabricLauncher
    assert type(launcher()) is _SubprocessScriptLauncher
