"""``robust_ddp_scratch`` under Lightning Fabric (``lightning_zero/fabric/robust.py``), on the engine of the Trainer
strategy (``lightning_zero/robust/engine.py``).

One pair of gloo processes runs the Fabric loop of ``test_fabric.py`` (accumulation through
``fabric.no_backward_sync``, ``fabric.clip_gradients``, AdamW, ``StepLR``) under Fabric's ``ddp``, under
``robust_ddp_scratch`` with ``mean`` (it must train as ``ddp``), and with ``trimmed_mean`` over ``n = 2 x 2`` workers
fed by ``fabric.strategy.worker_batches``, with worker momentum and a simulated sign flip. A single process computes
that run's reference: every worker's accumulated gradient on its chunk, stacked in global worker order, momentum, and
:class:`~lightning_zero.robust.aggregation.RobustAggregator` on the stack.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from torch.nn import functional as F

import lightning_zero
from lightning_zero.robust.aggregation import RobustAggregator
from lightning_zero.robust.engine import CHECKPOINT_KEY, build_engine
from tests.fabric.test_fabric import (
    ACCUM,
    CLIP,
    STEPS,
    TOLERANCE,
    WORLD,
    _batch,
    _fabric_loop,
    _net,
    _optimizer_and_scheduler,
    _reference,
)
from tests.helpers.equivalence import max_diff
from tests.helpers.workers import run_workers

K = 2  # workers per rank: n = 4
BETA = 0.5  # worker momentum
RULE = dict(aggregator="trimmed_mean", f=1, attack="sign_flip", attack_kwargs={"scale": 2.0})
BYZANTINE = [1]  # rank 0's second worker: the stack's row order matters


def _robust_loop(sharded: bool = False) -> dict:
    """The rule case under Fabric, then the error of a plain ``fabric.backward`` and the checkpoint state."""
    strategy = lightning_zero.fabric.RobustDDPStrategy(
        **RULE, byzantine_workers=BYZANTINE, workers_per_rank=K, worker_momentum=BETA, sharded_aggregation=sharded
    )
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    optimizer, scheduler = _optimizer_and_scheduler((model := _net()).parameters())
    model, optimizer = fabric.setup(model, optimizer)
    metrics = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            with fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                for x, y in fabric.strategy.worker_batches(_batch(fabric.global_rank, step, micro)):
                    fabric.backward(F.mse_loss(model(x), y) / ACCUM)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        metrics.append(fabric.strategy.metrics)
        fabric.log_dict(fabric.strategy.metrics)
    out = {"weights": {k: v.detach().clone() for k, v in model.module.state_dict().items()}, "metrics": metrics}
    x, y = _batch(fabric.global_rank, 0, 0)
    try:
        fabric.backward(F.mse_loss(model(x), y))
    except ValueError as error:
        out["error"] = str(error)
    checkpoint = {**fabric.strategy._strategy_state(), "step": STEPS}
    state = dict(checkpoint[CHECKPOINT_KEY])
    rows = strategy.engine.grads.momentum_rows
    saved_rows = rows.clone()
    rows.zero_()
    fabric.strategy._load_strategy_state(checkpoint)
    out.update(state=state, saved_rows=saved_rows, loaded_rows=rows.clone(), rest=checkpoint)
    fabric.strategy.teardown()
    return out


def _all_loops() -> dict:
    loops = {"ddp": _fabric_loop("ddp"), "mean": _fabric_loop("robust_ddp_scratch"), "rule": _robust_loop()}
    return {**loops, "rule_sharded": _robust_loop(sharded=True)}


@pytest.fixture(scope="module")
def runs():
    return run_workers(_all_loops, WORLD, timeout=240)


def _worker_gradient(model: torch.nn.Module, worker: int, step: int) -> torch.Tensor:
    """Global worker ``worker`` (row ``worker % K`` of rank ``worker // K``): its gradient accumulated over the
    window, on its chunk of each of its rank's micro-batches."""
    model.zero_grad()
    for micro in range(ACCUM):
        x, y = (t.tensor_split(K)[worker % K] for t in _batch(worker // K, step, micro))
        (F.mse_loss(model(x), y) / ACCUM).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _rule_reference(byzantine: list[int]) -> dict[str, torch.Tensor]:
    """One process: every worker's gradient in global worker order, their momenta, the rule on that stack; the
    aggregate is clipped and stepped."""
    model = _net()
    params = list(model.parameters())
    optimizer, scheduler = _optimizer_and_scheduler(params)
    rule = RobustAggregator(
        RULE["aggregator"], RULE["f"], attack=RULE["attack"], attack_kwargs=RULE["attack_kwargs"], byzantine=byzantine
    )
    rule.validate(WORLD * K)
    momentum = torch.zeros(WORLD * K, sum(p.numel() for p in params))
    for step in range(STEPS):
        rows = torch.stack([_worker_gradient(model, worker, step) for worker in range(WORLD * K)])
        momentum = BETA * momentum + (1 - BETA) * rows
        for p, part in zip(params, rule(momentum).vector.split([p.numel() for p in params])):
            p.grad = part.view_as(p).clone()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        scheduler.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.mark.timeout(300)
def test_mean_equals_fabric_ddp_and_the_reference(runs):
    reference = _reference()
    for rank_runs in runs:
        assert max_diff(rank_runs["mean"]["weights"], rank_runs["ddp"]["weights"]) <= TOLERANCE
        assert max_diff(rank_runs["mean"]["weights"], reference) <= TOLERANCE
        assert rank_runs["mean"]["strategy"] == "lightning_zero.fabric.robust"


@pytest.mark.timeout(300)
def test_trimmed_mean_over_worker_batches_equals_the_rule_on_the_worker_stack(runs):
    reference = _rule_reference(BYZANTINE)
    for rank_runs in runs:
        assert max_diff(rank_runs["rule"]["weights"], reference) <= TOLERANCE
    assert max_diff(runs[1]["rule"]["weights"], runs[0]["rule"]["weights"]) == 0.0  # the replicas agree exactly
    # the rule, the attack and the worker order matter: neither mean nor another Byzantine worker gives this run
    assert max_diff(runs[0]["rule"]["weights"], runs[0]["mean"]["weights"]) > 1e-3
    assert max_diff(runs[0]["rule"]["weights"], _rule_reference([2])) > 1e-4


@pytest.mark.timeout(300)
def test_sharded_aggregation_under_fabric_gives_the_same_fit_and_metrics(runs):
    for rank_runs in runs:
        sharded, unsharded = rank_runs["rule_sharded"], rank_runs["rule"]
        assert max_diff(sharded["weights"], unsharded["weights"]) <= TOLERANCE
        for got, want in zip(sharded["metrics"], unsharded["metrics"], strict=True):
            assert got.keys() == want.keys()
            assert got["robust/honest_distance"] == pytest.approx(want["robust/honest_distance"], rel=1e-5)
            assert got["robust/comm_bytes"] < want["robust/comm_bytes"]  # half the stack's columns
        torch.testing.assert_close(sharded["state"]["worker_momentum"], unsharded["state"]["worker_momentum"])


@pytest.mark.timeout(300)
def test_metrics_of_every_step(runs):
    psi = sum(p.numel() for p in _net().parameters())
    for rank_runs in runs:
        metrics = rank_runs["rule"]["metrics"]
        assert len(metrics) == STEPS
        for step in metrics:
            assert set(step) == {
                "robust/honest_distance", "robust/nonfinite_dropped", "robust/aggregation_ms", "robust/comm_bytes"
            }  # fmt: skip
            assert step["robust/comm_bytes"] == 4.0 * psi * WORLD * K  # the fp32 (n, d) stack this rank gathered
            assert step["robust/honest_distance"] > 0 and step["robust/nonfinite_dropped"] == 0


@pytest.mark.timeout(300)
def test_backward_outside_worker_batches_with_several_workers_says_how(runs):
    for rank_runs in runs:
        assert "workers_per_rank=2 runs one backward per worker" in rank_runs["rule"]["error"]
        assert "fabric.strategy.worker_batches(batch)" in rank_runs["rule"]["error"]


@pytest.mark.timeout(300)
def test_strategy_state_holds_every_workers_momentum_and_loads_this_ranks_rows(runs):
    psi = sum(p.numel() for p in _net().parameters())
    states = [rank_runs["rule"]["state"] for rank_runs in runs]
    for rank, rank_runs in enumerate(runs):
        state = rank_runs["rule"]["state"]
        assert state["num_workers"] == WORLD * K and state["worker_momentum"].shape == (WORLD * K, psi)
        assert torch.equal(state["worker_momentum"], states[0]["worker_momentum"])  # gathered: the same everywhere
        assert torch.equal(state["worker_momentum"][rank * K : (rank + 1) * K], rank_runs["rule"]["saved_rows"])
        assert torch.equal(rank_runs["rule"]["loaded_rows"], rank_runs["rule"]["saved_rows"])
        assert rank_runs["rule"]["rest"] == {"step": STEPS}  # the entry is taken out, the rest left
    assert states[0]["worker_momentum"].abs().sum() > 0


def test_worker_chunks_flip_the_byzantine_workers_labels():
    engine = build_engine("mean", f=1, workers_per_rank=2, attack="label_flip", attack_kwargs={"num_classes": 3})
    engine.validate(world_size=1)  # no process group: rank 0 of 1, worker 1 Byzantine
    x, y = torch.arange(8.0).view(4, 2), torch.tensor([0, 1, 2, 0])
    (x0, y0), (x1, y1) = engine.worker_chunks((x, y))
    assert torch.equal(x0, x[:2]) and torch.equal(x1, x[2:])
    assert torch.equal(y0, y[:2]) and torch.equal(y1, torch.tensor([0, 2]))


def test_names_are_registered_with_fabric():
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    assert STRATEGY_REGISTRY["robust_ddp_scratch"]["strategy"] is lightning_zero.fabric.RobustDDPStrategy
    assert STRATEGY_REGISTRY["robust_ddp_scratch_spawn"]["init_params"] == {"start_method": "spawn"}


def _error(build) -> str:
    with pytest.raises(ValueError) as error:
        build()
    return str(error.value)


# The Trainer strategy's bad settings (tests/strategies/test_robust.py): Fabric's raises the same message.
BAD_SETTINGS = [
    dict(aggregator="kurm"), dict(aggregator="median", aggregator_kwargs={"m": 3}), dict(pre_aggregators=["nmm"]),
    dict(attack="sign-flip", f=1), dict(workers_per_rank=0), dict(worker_momentum=1.0), dict(f=-1),
    dict(process_group_backend="smoke"),
]  # fmt: skip
BAD_FOR_N = [
    dict(aggregator="krum", f=2, workers_per_rank=2), dict(aggregator="bulyan", f=2, workers_per_rank=4),
    dict(attack="sign_flip"), dict(master_weights=True), dict(reduce_dtype="bf16"),
]  # fmt: skip


@pytest.mark.parametrize("kwargs", BAD_SETTINGS)
def test_bad_settings_raise_the_trainer_strategys_errors(kwargs):
    message = _error(lambda: lightning_zero.RobustDDPStrategy(**kwargs))
    assert _error(lambda: lightning_zero.fabric.RobustDDPStrategy(**kwargs)) == message


@pytest.mark.parametrize("kwargs", BAD_FOR_N)
def test_bad_combinations_raise_when_fabric_is_built_as_when_the_trainer_is(kwargs):
    strategy = lightning_zero.RobustDDPStrategy(**kwargs)
    message = _error(lambda: L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False))
    fabric_strategy = lightning_zero.fabric.RobustDDPStrategy(**kwargs)
    assert _error(lambda: Fabric(accelerator="cpu", devices=2, strategy=fabric_strategy)) == message
    assert not torch.distributed.is_initialized()  # nothing started
