"""Sharded and replicated aggregation of :class:`lightning_zero.robust.engine.RobustEngine` on real gloo processes:
the all-to-all, the per-round totals, the digests, what is received and held per rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.comm.collectives import LEDGER
from lightning_zero.robust.engine import RobustEngine, build_engine
from lightning_zero.robust.exchange import AggregationMismatchError
from tests.helpers.workers import run_workers

CASES = {
    "trimmed_mean+nnm+momentum/sign_flip": dict(
        aggregator="trimmed_mean", f=1, pre_aggregators=["nnm"], worker_momentum=0.9, attack="sign_flip",
        attack_kwargs={"scale": 3.0},
    ),
    "centered_clipping+bucketing/gaussian": dict(
        aggregator="centered_clipping", f=1, aggregator_kwargs={"tau": 0.3}, pre_aggregators=[{"name": "bucketing",
        "s": 2}], attack="gaussian", attack_kwargs={"std": 2.0},
    ),
    "krum/ipm": dict(aggregator="krum", f=1, attack="ipm", attack_kwargs={"eps": 4.0}),
    "geometric_median+clip/alie": dict(
        aggregator="geometric_median", f=1, pre_aggregators=[{"name": "clip", "c": 0.5}], attack="alie",
        attack_kwargs={"z": 1.0},
    ),
}  # fmt: skip
WORKERS = 6  # n: 3 per rank on 2 ranks, 2 per rank on 3


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # d = 42 + 24 = 66 (3 ranks: 22 each)


def _steps(engine: RobustEngine, steps: int = 3) -> dict:
    """``steps`` SGD steps of the module under ``engine``: each worker's loss on its own data; the aggregates, the
    metrics and this rank's ledger of the steps."""
    module = _module()
    world = dist.get_world_size()
    engine.validate(world)
    engine.attach(module, find_unused_parameters=False)
    aggregates, metrics = [], []
    LEDGER.reset()
    for step in range(steps):
        for j in range(engine.workers_per_rank):
            g = torch.Generator().manual_seed(1000 * step + engine.first_worker + j)
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            with engine.worker_backward(j):
                nn.functional.mse_loss(module(x), y).backward()
        metrics.append(engine.aggregate())
        aggregates.append(torch.cat([p.grad.reshape(-1) for p in module.parameters()]).clone())
        with torch.no_grad():
            for p in module.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    ledger = {(op, tag): (LEDGER.calls(op, tag), LEDGER.bytes(op, tag)) for op, tag in LEDGER.summary()}
    buffers = sum(t.numel() * t.element_size() for t in engine.buffers)
    return {"aggregates": aggregates, "metrics": metrics, "ledger": ledger, "buffers": buffers,
            "state": engine.robust_state_dict()}  # fmt: skip


def _compare_modes(case: str) -> dict:
    dist.init_process_group("gloo")
    k = WORKERS // dist.get_world_size()
    out = {}
    for name, sharding in {"unsharded": {}, "sharded": {"sharded_aggregation": True},
                           "replicated": {"sharded_aggregation": True, "aggregation_replicas": 2}}.items():  # fmt: skip
        out[name] = _steps(build_engine(workers_per_rank=k, **CASES[case], **sharding))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_and_replicated_aggregation_equal_the_unsharded_one(case, world):
    per_rank = run_workers(_compare_modes, world, case, timeout=90)
    for rank, out in enumerate(per_rank):
        for step, want in enumerate(out["unsharded"]["aggregates"]):
            torch.testing.assert_close(out["sharded"]["aggregates"][step], want, rtol=1e-5, atol=1e-6)
            # round 0 of the replicated mode is the sharded mode: the same sums in the same order
            assert torch.equal(out["replicated"]["aggregates"][step], out["sharded"]["aggregates"][step])
            assert torch.equal(out["sharded"]["aggregates"][step], per_rank[0]["sharded"]["aggregates"][step])
            for key, value in out["unsharded"]["metrics"][step].items():
                if key in ("robust/honest_distance", "robust/byzantine_selected", "robust/nonfinite_dropped"):
                    assert out["sharded"]["metrics"][step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (rank, key)
        # the checkpoint state moves between the modes: the same centre, momentum rows and generator
        for name in ("sharded", "replicated"):
            state, want = out[name]["state"], out["unsharded"]["state"]
            assert torch.equal(state["generator"], want["generator"])
            for key in ("center", "worker_momentum"):
                if want[key] is None:
                    assert state[key] is None
                else:
                    torch.testing.assert_close(state[key], want[key], rtol=1e-5, atol=1e-6)


def _received_and_held(_: int) -> dict:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    out = {}
    for sharded in (False, True):
        engine = build_engine("median", f=1, workers_per_rank=8 // world, sharded_aggregation=sharded)
        result = _steps(engine, steps=2)
        out[sharded] = {"ledger": result["ledger"], "stacks": sum(t.numel() for t in engine.received)}
    return out


@pytest.mark.timeout(120)
def test_what_a_rank_receives_and_holds_of_the_workers_vectors_falls_as_one_over_n():
    d, n = 66, 8
    for world in (2, 4):
        out = run_workers(_received_and_held, world, 0, timeout=90)[0]
        shard = -(-d // world)
        # unsharded: the (n, d) stack all-gathered, every step
        assert out[False]["ledger"][("all_gather", "worker_grads")] == (2, 2 * 4 * n * d)
        assert out[False]["stacks"] == n * d
        # sharded: n x d / N values by the all-to-all (one call per local worker), then d by the aggregate's gather
        assert out[True]["ledger"][("all_to_all", "worker_grads")] == (2 * n // world, 2 * 4 * n * shard)
        assert out[True]["ledger"][("all_gather", "aggregate")] == (2, 2 * 4 * shard * world)
        assert out[True]["stacks"] == n * shard
        assert ("all_gather", "worker_grads") not in out[True]["ledger"]


class _CorruptRoundOne:
    """A faulty aggregating rank: adds 1e-6 to what it computes for shard 0 (in its round 1 on rank 1)."""

    def __init__(self, aggregator) -> None:
        self.inner = aggregator

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, stack, shard):
        result = self.inner(stack, shard)
        if shard.index == 0:
            result.vector.add_(1e-6)
        return result


def _one_rank_corrupts(_: int) -> dict:
    dist.init_process_group("gloo")
    engine = build_engine("median", f=1, workers_per_rank=2, sharded_aggregation=True, aggregation_replicas=2)
    if dist.get_rank() == 1:
        engine.aggregator = _CorruptRoundOne(engine.aggregator)
    module = _module()
    initial = [p.detach().clone() for p in module.parameters()]
    engine.validate(dist.get_world_size())
    engine.attach(module, find_unused_parameters=False)
    for j in range(2):
        with engine.worker_backward(j):
            module(torch.randn(4, 5)).square().mean().backward()
    with pytest.raises(AggregationMismatchError) as caught:
        engine.aggregate()
    return {
        "message": str(caught.value),
        "grads": [p.grad for p in module.parameters()],
        "unchanged": all(torch.equal(p, q) for p, q in zip(module.parameters(), initial)),
    }


@pytest.mark.timeout(120)
def test_a_corrupt_aggregating_rank_stops_every_rank_before_the_step():
    per_rank = run_workers(_one_rank_corrupts, 3, 0, timeout=90)
    messages = {out["message"] for out in per_rank}
    assert len(messages) == 1  # the same error on every rank
    (message,) = messages
    assert "shard 0 (columns [0, 22))" in message
    assert "ranks [0] gave" in message and "ranks [1] gave" in message
    assert "No rank applied this step" in message
    for out in per_rank:
        assert out["grads"] == [None] * 4 and out["unchanged"]
