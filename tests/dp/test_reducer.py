"""The gradient engine alone (no Lightning) on real gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.comm import collectives as comm
from lightning_zero.dp.reducer import GradientReducer
from lightning_zero.training.memory import model_state_bytes
from tests.helpers.workers import run_workers


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_unused: bool = False) -> torch.Tensor:
        out = self.frozen(self.layers(x))
        return out + self.unused(out) if use_unused else out


def _data(rank: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + rank))


def _grads(net: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()}


def _reducer_worker() -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict = {}

    # 1. overlap, views, averaging; with a parameter that gets no gradient anywhere -> clear error
    net = _Net()
    seen_at_last_grad = []
    # layers.0.weight is registered first, so its gradient is ready last; this hook runs before the reducer's.
    first = net.layers[0].weight
    first.register_post_accumulate_grad_hook(lambda p: seen_at_last_grad.append(comm.LEDGER.calls(tag="grads")))
    reducer = GradientReducer.for_module(net, bucket_cap_bytes=32 * 33 * 4)  # about one Linear per bucket
    out["bucket_names"] = reducer.bucket_param_names
    comm.LEDGER.reset()
    try:
        net(_data(rank)).square().sum().backward()
    except RuntimeError as error:
        out["unused_error"] = str(error)

    # 2. the same with every parameter used: averaged gradients, living in the buckets
    for p in net.parameters():
        p.grad = None
    comm.LEDGER.reset()
    seen_at_last_grad.clear()
    out["n_buckets"] = len(reducer.buffers)  # this pass's; the reducer rebuilds its buckets once it has drained
    net(_data(rank), use_unused=True).square().sum().backward()
    out["launched_before_backward_ended"] = seen_at_last_grad[0]
    out["calls_after_backward"] = comm.LEDGER.calls(tag="grads")
    out["grads"] = _grads(net)
    trainable = [p for p in net.parameters() if p.requires_grad]
    out["grad_bytes"] = model_state_bytes(trainable, (), reducer.buffers)
    out["psi"] = sum(p.numel() for p in trainable)
    reducer.remove()

    # 3. find_unused_parameters: used only on rank 1 -> averaged with rank 0's zeros; unused everywhere -> None
    net = _Net()
    reducer = GradientReducer.for_module(net, bucket_cap_bytes=1 << 20, find_unused_parameters=True)
    net(_data(rank), use_unused=rank == 1).square().sum().backward()
    out["find_unused_rank1_only"] = _grads(net)
    for p in net.parameters():
        p.grad = None
    net(_data(rank)).square().sum().backward()
    out["find_unused_nowhere"] = _grads(net)
    return out


def _local_grads(rank: int, use_unused: bool) -> dict[str, torch.Tensor | None]:
    net = _Net()
    net(_data(rank), use_unused=use_unused).square().sum().backward()
    return _grads(net)


@pytest.fixture(scope="module")
def results():
    return run_workers(_reducer_worker, 2, timeout=180)


@pytest.mark.timeout(240)
def test_unused_parameter_is_named_in_the_error(results):
    for r in results:
        assert "2 trainable parameter(s) received no gradient" in r["unused_error"]
        assert "'unused.weight'" in r["unused_error"] and "'unused.bias'" in r["unused_error"]
        assert "find_unused_parameters=True" in r["unused_error"]


@pytest.mark.timeout(240)
def test_buckets_skip_frozen_parameters_and_follow_reverse_order(results):
    names = results[0]["bucket_names"]
    flat = [n for bucket in names for n in bucket]
    assert not any(n.startswith("frozen") for n in flat)
    assert flat[0].startswith("unused") and flat[-1] == "layers.0.weight"
    assert len(names) > 2


@pytest.mark.timeout(240)
def test_all_reduce_overlaps_backward_and_grads_are_averaged_views(results):
    reference = [_local_grads(rank, use_unused=True) for rank in (0, 1)]
    for r in results:
        # when the last gradient arrived, every other bucket had already been launched
        assert r["launched_before_backward_ended"] == r["n_buckets"] - 1
        assert r["calls_after_backward"] == r["n_buckets"]
        for name, grad in r["grads"].items():
            if name.startswith("frozen"):
                assert grad is None
            else:
                torch.testing.assert_close(grad, (reference[0][name] + reference[1][name]) / 2)
        # gradients are the bucket buffers themselves: 4 bytes per trainable element, no second copy
        assert r["grad_bytes"].grads == 4 * r["psi"]
        assert r["grad_bytes"].strategy_buffers == 0


@pytest.mark.timeout(240)
def test_find_unused_parameters_matches_single_process_semantics(results):
    rank1_used = _local_grads(1, use_unused=True)
    for r in results:
        grads = r["find_unused_rank1_only"]
        torch.testing.assert_close(grads["unused.weight"], rank1_used["unused.weight"] / 2)
        nowhere = r["find_unused_nowhere"]
        assert nowhere["unused.weight"] is None and nowhere["unused.bias"] is None
        assert nowhere["layers.0.weight"] is not None
