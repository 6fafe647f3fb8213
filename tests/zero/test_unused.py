"""``lightning_zero/zero/unused.py``: parameters no rank used are left untouched by a ZeRO step, as torch DDP leaves
them (pure: one process, a flat shard built by hand)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.zero.partition import flat_layout
from lightning_zero.zero.unused import HeldPieces, param_pieces


def _flat(values: list[torch.Tensor]) -> tuple[nn.Parameter, list]:
    """One flat shard over ``values`` (world size 1) and its parameters' pieces."""
    layout = flat_layout([v.numel() for v in values], 1)
    shard = nn.Parameter(torch.cat([v.reshape(-1) for v in values]))
    return shard, param_pieces(["a", "b"], shard, layout, 0)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_an_unused_parameter_is_left_as_an_optimizer_with_grad_none_leaves_it(optimizer):
    a0, b0 = torch.randn(3), torch.randn(2)
    make = {
        "adamw": lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.5),
        "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.5),
    }[optimizer]
    grads = [(torch.randn(3), torch.randn(2)), (torch.randn(3), None), (torch.randn(3), None)]

    a, b = nn.Parameter(a0.clone()), nn.Parameter(b0.clone())  # reference: separate parameters, b.grad = None
    reference = make([a, b])
    shard, params = _flat([a0, b0])
    sharded = make([shard])
    held = HeldPieces(sharded)
    for grad_a, grad_b in grads:
        a.grad, b.grad = grad_a.clone(), None if grad_b is None else grad_b.clone()
        reference.step()
        shard.grad = torch.cat([grad_a, torch.zeros(2) if grad_b is None else grad_b])
        held.hold(params, {"b"} if grad_b is None else set())
        sharded.step()
        held.restore()
        torch.testing.assert_close(shard.detach(), torch.cat([a.detach(), b.detach()]), rtol=0, atol=1e-7)
    assert not torch.equal(b.detach(), b0)  # the first step moved b; the later ones left it alone
    moment = "exp_avg" if optimizer == "adamw" else "momentum_buffer"
    torch.testing.assert_close(sharded.state[shard][moment][3:], reference.state[b][moment])


def test_a_parameter_used_again_after_a_skipped_adam_step_is_refused():
    shard, params = _flat([torch.randn(3), torch.randn(2)])
    optimizer = torch.optim.AdamW([shard], lr=0.1)
    held = HeldPieces(optimizer)
    shard.grad = torch.randn(5)
    held.hold(params, {"b"})  # b skipped while Adam's step count of the shard goes on
    optimizer.step()
    held.restore()
    held.hold(params, {"b"})  # still unused: fine
    with pytest.raises(RuntimeError, match=r"parameter 'b' gets a gradient again .* one step count per flat shard"):
        held.hold(params, set())


def test_sgd_keeps_no_step_count_so_a_parameter_may_come_back():
    shard, params = _flat([torch.randn(3), torch.randn(2)])
    optimizer = torch.optim.SGD([shard], lr=0.1, momentum=0.9)
    held = HeldPieces(optimizer)
    shard.grad = torch.randn(5)
    held.hold(params, {"b"})
    optimizer.step()
    held.restore()
    held.hold(params, set())
