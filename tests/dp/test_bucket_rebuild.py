"""The one rebuild of ``ddp_scratch``'s buckets by arrival order ([Note: bucket rebuild] in
``lightning_zero/dp/reducer.py``), against torch DDP's own rebuild in the same gloo processes: the same buckets (torch's
``rebuilt_per_bucket_param_indices``), rank 0's order on every rank, gradients unchanged by the move, and PowerSGD
bit for bit with torch's ``powerSGD_hook`` on several buckets of a module registered out of execution order."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_zero.comm.bucketing import DEFAULT_BUCKET_SIZE_MB, first_bucket_cap_bytes
from lightning_zero.comm.powersgd import PowerSGDCompressor
from lightning_zero.comm.powersgd_config import PowerSGDConfig
from lightning_zero.dp.reducer import GradientReducer
from tests.helpers.workers import run_workers

ITERATIONS = 5
POWERSGD = PowerSGDConfig(rank=2, start_iter=2, seed=7)
RELATIVE_TOLERANCE = 1e-6  # as tests/comm/test_powersgd.py: a BLAS or collective's summation order elsewhere


class _HeadFirst(nn.Module):
    """The head is registered first, and two parallel branches whose backward order depends on the rank (autograd
    runs the later-built branch first): reverse registration order is wrong, and the ranks' arrival orders differ."""

    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(width, 10)
        self.stem = nn.Linear(16, width)
        self.left, self.right = nn.Linear(width, width), nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        branches = (self.left, self.right) if dist.get_rank() == 0 else (self.right, self.left)
        h = branches[0](h) + branches[1](h)
        return self.head(self.norm(torch.tanh(h)))


def _input(iteration: int) -> torch.Tensor:
    return torch.randn(6, 16, generator=torch.Generator().manual_seed(100 * iteration + dist.get_rank()))


def _grads(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in net.named_parameters()}


def _torch_run(width: int, bucket_mb: float, powersgd: PowerSGDConfig | None) -> dict:
    """Torch DDP (its default ``bucket_cap_mb=None`` for our default size): gradients per iteration and its rebuilt
    buckets by parameter name."""
    net = _HeadFirst(width)
    ddp = DistributedDataParallel(net, bucket_cap_mb=None if bucket_mb == DEFAULT_BUCKET_SIZE_MB else bucket_mb)
    if powersgd is not None:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

        state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=powersgd.rank,
            start_powerSGD_iter=powersgd.start_iter,
            random_seed=powersgd.seed,
        )

        def one_bucket_at_a_time(state, bucket):
            # torch's hook chains each bucket's P, Q all-reduces as futures; with several buckets gloo then sees
            # them in another order on each rank (gloo: "Received data size doesn't match"). Waiting keeps one order.
            future = powerSGD_hook(state, bucket)
            future.wait()
            return future

        ddp.register_comm_hook(state, one_bucket_at_a_time)
    grads = []
    for iteration in range(ITERATIONS):
        net.zero_grad(set_to_none=True)
        ddp(_input(iteration)).square().sum().backward()
        grads.append(_grads(net))
    names = [n for n, _ in net.named_parameters()]
    rebuilt = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    buckets = [[names[int(i)] for i in bucket.split()] for bucket in rebuilt.split(",")]
    return {"grads": grads, "buckets": buckets}


def _our_run(width: int, bucket_mb: float, powersgd: PowerSGDConfig | None, keep_layout: bool = False) -> dict:
    net = _HeadFirst(width)
    compressor = PowerSGDCompressor(powersgd) if powersgd is not None else None
    reducer = GradientReducer.for_module(
        net,
        bucket_cap_bytes=int(bucket_mb * 2**20),
        first_bucket_cap_bytes=first_bucket_cap_bytes(bucket_mb),
        compressor=compressor,
    )
    if keep_layout:
        reducer.keep_layout()
    first_layout = reducer.bucket_param_names
    grads, views = [], []
    for iteration in range(ITERATIONS):
        net.zero_grad(set_to_none=True)
        net(_input(iteration)).square().sum().backward()
        grads.append(_grads(net))
        starts = {b.data_ptr() for b in reducer.buffers}
        ends = {b.data_ptr() + b.numel() * b.element_size() for b in reducer.buffers}
        views.append(all(any(s <= p.grad.data_ptr() < e for s, e in zip(starts, ends)) for p in net.parameters()))
    reducer.remove()
    return {"grads": grads, "buckets": reducer.bucket_param_names, "first_layout": first_layout, "views": views}


def _worker() -> dict:
    dist.init_process_group("gloo")
    out = {}
    # 600 wide: 2.9 MiB of gradients, so torch's 1 MiB first bucket shows; 0.01 MiB: one cap for every bucket
    for width, bucket_mb in ((600, DEFAULT_BUCKET_SIZE_MB), (64, 0.01)):
        out[("plain", bucket_mb)] = {
            "torch": _torch_run(width, bucket_mb, None),
            "ours": _our_run(width, bucket_mb, None),
        }
    out["powersgd"] = {
        "torch": _torch_run(64, 0.01, POWERSGD),
        "ours": _our_run(64, 0.01, POWERSGD),
        "kept": _our_run(64, 0.01, POWERSGD, keep_layout=True),
    }
    return out


@pytest.fixture(scope="module")
def runs():
    return run_workers(_worker, 2, timeout=180)


def _max_relative(ours: list[dict], theirs: list[dict]) -> float:
    return max(
        ((o[n] - t[n]).abs().max() / t[n].abs().max().clamp_min(1e-30)).item() for o, t in zip(ours, theirs) for n in t
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("bucket_mb", [DEFAULT_BUCKET_SIZE_MB, 0.01])
def test_rebuilt_buckets_are_torchs_and_rank_zeros(runs, bucket_mb):
    for rank_runs in runs:
        run = rank_runs[("plain", bucket_mb)]
        assert run["ours"]["buckets"] == run["torch"]["buckets"]
        assert run["ours"]["buckets"] != run["ours"]["first_layout"]  # the rebuild changed something
        assert len(run["torch"]["buckets"]) > 1
    # the ranks' arrival orders differed (the branches), both follow rank 0's
    assert runs[0][("plain", bucket_mb)]["ours"]["buckets"] == runs[1][("plain", bucket_mb)]["ours"]["buckets"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("bucket_mb", [DEFAULT_BUCKET_SIZE_MB, 0.01])
def test_gradients_move_into_the_new_buckets_unchanged(runs, bucket_mb):
    for rank_runs in runs:
        run = rank_runs[("plain", bucket_mb)]
        assert _max_relative(run["ours"]["grads"], run["torch"]["grads"]) <= RELATIVE_TOLERANCE
        assert all(run["ours"]["views"])  # p.grad is a view of a live bucket, before and after the rebuild


@pytest.mark.timeout(240)
def test_powersgd_on_rebuilt_buckets_is_torchs_powersgd_hook(runs):
    for rank_runs in runs:
        run = rank_runs["powersgd"]
        assert run["ours"]["buckets"] == run["torch"]["buckets"]
        assert _max_relative(run["ours"]["grads"], run["torch"]["grads"]) <= RELATIVE_TOLERANCE
        # on the first layout, the Q draws meet other tensors: far from torch once compression starts
        assert (
            _max_relative(run["kept"]["grads"][POWERSGD.start_iter :], run["torch"]["grads"][POWERSGD.start_iter :])
            > 1e-3
        )
