"""The vocab-parallel cross entropy on 2 gloo ranks against ``F.cross_entropy`` on the full logits.

Each rank holds its half of the vocabulary's logits; the loss and the gradient of its half must equal
``F.cross_entropy``'s (mean reduction, ``ignore_index``), with logits large enough to overflow a naive ``exp``, and
the ledger must show three all-reduces of one value per token forward and nothing backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from lightning_zero.comm import collectives as comm
from lightning_zero.tensor_parallel import vocab_parallel_cross_entropy
from tests.helpers.workers import run_workers

WORLD, TOKENS, VOCAB = 2, 12, 10


def _case(name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(full logits, targets, upstream gradient of the loss)``."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, VOCAB, generator=g)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    targets[:2] = torch.tensor([0, VOCAB - 1])  # one target on each rank at least
    if name == "ignore_index":
        targets[[3, 7]] = -100
    if name == "large logits":  # exp(1000) overflows fp32: only a max-shifted softmax stays finite
        logits = logits * 1000
    if name == "all ignored":  # 0 / 0 = nan, as F.cross_entropy gives
        targets[:] = -100
    return logits, targets, 3.0


NAMES = ["plain", "ignore_index", "large logits", "all ignored"]


def _cross_entropy_worker() -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}
    for name in NAMES:
        logits, targets, upstream = _case(name)
        local = logits.tensor_split(WORLD, dim=-1)[rank].clone().requires_grad_()
        comm.LEDGER.reset()
        loss = vocab_parallel_cross_entropy(local, targets)
        forward = comm.LEDGER.summary()
        comm.LEDGER.reset()
        (loss * upstream).backward()
        out[name] = {"loss": loss.detach(), "grad": local.grad, "forward": forward, "backward": comm.LEDGER.summary()}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_cross_entropy_worker, WORLD, timeout=120)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_loss_and_gradient_equal_f_cross_entropy_on_the_full_logits(results, name):
    logits, targets, upstream = _case(name)
    logits.requires_grad_()
    loss = F.cross_entropy(logits, targets)
    (loss * upstream).backward()
    for rank, result in enumerate(results):
        ours = result[name]
        torch.testing.assert_close(ours["loss"], loss.detach(), rtol=0, atol=1e-6, equal_nan=True)
        expected_grad = logits.grad.tensor_split(WORLD, dim=-1)[rank]
        torch.testing.assert_close(ours["grad"], expected_grad, rtol=0, atol=1e-6, equal_nan=True)
    if name == "large logits":
        assert torch.isfinite(loss) and torch.isfinite(results[0][name]["grad"]).all()


@pytest.mark.timeout(120)
def test_three_small_all_reduces_forward_none_backward(results):
    for result in results:
        for name in NAMES:
            assert result[name]["forward"] == {("all_reduce", "tp"): (3, 3 * TOKENS * 4)}, name
            assert result[name]["backward"] == {}, name


def test_logits_and_targets_of_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match=r"local_logits of shape \(4, 5\) and targets of shape \(3,\)"):
        vocab_parallel_cross_entropy(torch.zeros(4, 5), torch.zeros(3, dtype=torch.long))
