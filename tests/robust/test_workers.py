"""split_batch and WorkerGradients, on plain tensors and a small nn.Sequential (no Trainer).

Checked: ``split_batch`` on tuples, dicts and nested batches (chunk sizes differ by at most one, concatenating the
chunks restores the batch, non-tensor leaves are shared, ``k == 1`` returns the batch object itself) and its errors;
``WorkerGradients``: a worker's backward lands in its own row and equals autograd's gradient on a separate clone of
the model, ``p.grad`` is unbound afterwards, passes into one row sum, other rows stay untouched, worker momentum in
closed form, ``set_grads`` binding views of the aggregate, the constructor's errors and ``buffers``.
"""

from __future__ import annotations

import copy
from collections import namedtuple

import pytest
import torch
from torch import nn

from lightning_zero.robust.workers import WorkerGradients, split_batch

# --- split_batch ----------------------------------------------------------------------------------------------------


def _sizes(n: int, k: int) -> list[int]:
    """What a balanced split gives: the first n mod k chunks one larger."""
    return [n // k + (1 if j < n % k else 0) for j in range(k)]


@pytest.mark.parametrize(("n", "k"), [(10, 3), (8, 4), (7, 7), (9, 2), (5, 1)])
def test_split_batch_on_a_tuple(n, k):
    x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    y = torch.arange(n)
    chunks = split_batch((x, y), k)
    assert len(chunks) == k
    assert [c[0].shape[0] for c in chunks] == _sizes(n, k)
    assert [c[1].shape[0] for c in chunks] == _sizes(n, k)
    assert max(c[0].shape[0] for c in chunks) - min(c[0].shape[0] for c in chunks) <= 1
    assert all(isinstance(c, tuple) for c in chunks)
    assert torch.equal(torch.cat([c[0] for c in chunks]), x)
    assert torch.equal(torch.cat([c[1] for c in chunks]), y)


def test_split_batch_on_a_dict_shares_non_tensor_leaves():
    n, k = 11, 4
    meta = {"source": object()}
    batch = {"x": torch.randn(n, 2), "y": torch.arange(n), "name": "digits", "meta": meta, "lr": 0.5}
    chunks = split_batch(batch, k)
    assert [c["x"].shape[0] for c in chunks] == _sizes(n, k)
    assert torch.equal(torch.cat([c["x"] for c in chunks]), batch["x"])
    assert torch.equal(torch.cat([c["y"] for c in chunks]), batch["y"])
    for c in chunks:
        assert set(c) == set(batch)
        assert c["name"] is batch["name"]
        assert c["meta"]["source"] is meta["source"]
        assert c["lr"] == 0.5
    # the tensors of chunk j are rows of sample j's chunk in both keys: x and y stay aligned
    start = 0
    for c in chunks:
        size = c["y"].shape[0]
        assert torch.equal(c["y"], torch.arange(start, start + size))
        assert torch.equal(c["x"], batch["x"][start : start + size])
        start += size


def test_split_batch_on_a_nested_batch():
    n, k = 9, 2
    Pair = namedtuple("Pair", ["inputs", "targets"])
    marker = object()
    batch = {"pair": Pair(torch.randn(n, 3, 2), [torch.arange(n), marker]), "ids": (torch.arange(n) * 10,)}
    chunks = split_batch(batch, k)
    assert len(chunks) == k
    for c, size in zip(chunks, _sizes(n, k)):
        assert isinstance(c["pair"], Pair)
        assert c["pair"].inputs.shape == (size, 3, 2)
        assert c["pair"].targets[1] is marker
        assert isinstance(c["ids"], tuple)
    assert torch.equal(torch.cat([c["pair"].inputs for c in chunks]), batch["pair"].inputs)
    assert torch.equal(torch.cat([c["pair"].targets[0] for c in chunks]), batch["pair"].targets[0])
    assert torch.equal(torch.cat([c["ids"][0] for c in chunks]), batch["ids"][0])


def test_split_batch_with_k_1_returns_the_batch_itself():
    batch = {"x": torch.randn(3, 2), "name": "a"}
    out = split_batch(batch, 1)
    assert len(out) == 1
    assert out[0] is batch
    # even a batch the split would reject
    odd = (torch.randn(3), torch.randn(4))
    assert split_batch(odd, 1)[0] is odd


@pytest.mark.parametrize(
    ("batch", "pattern"),
    [
        ((torch.randn(4, 2), torch.arange(5)), r"leading sizes \[4, 5\]"),
        ({"x": torch.randn(4, 2), "s": torch.tensor(1.0)}, r"leading sizes"),
        (("just", "strings", 3), r"leading sizes \[\]"),
        ({}, r"leading sizes \[\]"),
    ],
)
def test_split_batch_rejects_batches_without_one_common_batch_dimension(batch, pattern):
    with pytest.raises(ValueError, match=pattern):
        split_batch(batch, 2)


@pytest.mark.parametrize(("n", "k"), [(2, 3), (3, 4), (0, 2)])
def test_split_batch_needs_at_least_k_samples(n, k):
    with pytest.raises(ValueError, match=rf"needs at least {k} samples per micro-batch, got {n}"):
        split_batch((torch.randn(n, 2), torch.arange(n)), k)


# --- WorkerGradients ------------------------------------------------------------------------------------------------


def _model(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)


def _batch(n: int = 5, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).square().mean()


def _reference_grad(model: nn.Module, *batches: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The flat gradient (summed over ``batches``) that plain autograd gives on a separate clone of ``model``."""
    clone = copy.deepcopy(model)
    clone.zero_grad(set_to_none=True)
    for b in batches:
        _loss(clone, b).backward()
    return torch.cat([p.grad.flatten() for p in clone.parameters()])


def test_a_workers_backward_lands_in_its_row_and_unbinds_grads():
    model = _model()
    params = list(model.parameters())
    wg = WorkerGradients(params, workers=3)
    d = sum(p.numel() for p in params)
    assert wg.rows.shape == (3, d)
    assert wg.workers == 3
    batch = _batch()
    expected = _reference_grad(model, batch)

    wg.bind(1)
    _loss(model, batch).backward()
    wg.collect(1)
    torch.testing.assert_close(wg.rows[1], expected, rtol=0, atol=0)
    assert all(p.grad is None for p in params)
    assert torch.count_nonzero(wg.rows[0]) == 0
    assert torch.count_nonzero(wg.rows[2]) == 0


def test_bind_points_grads_at_views_of_the_row():
    model = _model()
    params = list(model.parameters())
    wg = WorkerGradients(params, workers=2)
    wg.bind(1)
    offset = 0
    for p in params:
        assert p.grad.shape == p.shape
        assert p.grad.data_ptr() == wg.rows[1, offset:].data_ptr()
        offset += p.numel()
    wg.collect(1)


def test_passes_into_one_row_sum_and_other_rows_are_untouched():
    model = _model()
    params = list(model.parameters())
    wg = WorkerGradients(params, workers=3)
    b1, b2, b3 = _batch(seed=1), _batch(seed=2), _batch(seed=3)

    # two backward passes under one bind (micro-batches of an accumulation window)
    wg.bind(0)
    _loss(model, b1).backward()
    _loss(model, b2).backward()
    wg.collect(0)
    torch.testing.assert_close(wg.rows[0], _reference_grad(model, b1) + _reference_grad(model, b2))

    # worker 2 next: row 0 must not move
    row0 = wg.rows[0].clone()
    wg.bind(2)
    _loss(model, b3).backward()
    wg.collect(2)
    torch.testing.assert_close(wg.rows[2], _reference_grad(model, b3), rtol=0, atol=0)
    assert torch.equal(wg.rows[0], row0)
    assert torch.count_nonzero(wg.rows[1]) == 0

    # bind again later: the row keeps what it had and adds
    wg.bind(0)
    _loss(model, b3).backward()
    wg.collect(0)
    torch.testing.assert_close(wg.rows[0], row0 + _reference_grad(model, b3))
    assert all(p.grad is None for p in params)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
def test_collect_keeps_a_gradient_autograd_stored_out_of_place():
    model = _model()
    params = list(model.parameters())
    wg = WorkerGradients(params, workers=2)
    batch = _batch()
    expected = _reference_grad(model, batch)
    wg.bind(0)
    _loss(model, batch).backward(create_graph=True)  # autograd replaces .grad instead of accumulating in place
    assert any(p.grad.data_ptr() != v.data_ptr() for p, v in zip(params, wg._views[0]))
    wg.collect(0)
    torch.testing.assert_close(wg.rows[0], expected)
    assert all(p.grad is None for p in params)
    assert not wg.rows.requires_grad


def test_collect_keeps_a_gradient_assigned_elsewhere():
    # the non-autograd path of the same promise: a .grad that is not the row's view is copied into the row
    model = _model()
    params = list(model.parameters())
    wg = WorkerGradients(params, workers=2)
    wg.bind(1)
    replacements = [torch.full_like(p, float(i + 1)) for i, p in enumerate(params)]
    for p, r in zip(params, replacements):
        p.grad = r
    wg.collect(1)
    torch.testing.assert_close(wg.rows[1], torch.cat([r.flatten() for r in replacements]))
    assert all(p.grad is None for p in params)
    assert torch.count_nonzero(wg.rows[0]) == 0


def test_vectors_without_momentum_are_the_rows():
    wg = WorkerGradients(list(_model().parameters()), workers=2)
    assert wg.momentum_rows is None
    assert wg.vectors() is wg.rows
    assert wg.buffers == [wg.rows]
    assert len(wg.buffers) == 1


@pytest.mark.parametrize("beta", [0.5, 0.9])
def test_vectors_with_momentum_follow_the_ema(beta):
    model = _model()
    params = list(model.parameters())
    wg = WorkerGradients(params, workers=2, momentum=beta)
    assert len(wg.buffers) == 2
    assert wg.buffers[0] is wg.rows
    assert wg.buffers[1] is wg.momentum_rows
    assert wg.momentum_rows.shape == wg.rows.shape

    g1 = torch.randn(wg.rows.shape, generator=torch.Generator().manual_seed(0), dtype=wg.rows.dtype)
    g2 = torch.randn(wg.rows.shape, generator=torch.Generator().manual_seed(1), dtype=wg.rows.dtype)
    wg.rows.copy_(g1)
    m1 = wg.vectors().clone()
    torch.testing.assert_close(m1, (1 - beta) * g1)
    wg.rows.copy_(g2)
    m2 = wg.vectors().clone()
    torch.testing.assert_close(m2, beta * ((1 - beta) * g1) + (1 - beta) * g2)
    torch.testing.assert_close(wg.momentum_rows, m2)
    torch.testing.assert_close(wg.rows, g2)  # the rows themselves are not changed


def test_momentum_of_a_real_backward():
    beta = 0.8
    model = _model()
    params = list(model.parameters())
    wg = WorkerGradients(params, workers=1, momentum=beta)
    b1, b2 = _batch(seed=4), _batch(seed=5)
    wg.bind(0)
    _loss(model, b1).backward()
    wg.collect(0)
    m1 = wg.vectors().clone()
    wg.rows.zero_()  # a new accumulation window
    wg.bind(0)
    _loss(model, b2).backward()
    wg.collect(0)
    expected = beta * (1 - beta) * _reference_grad(model, b1) + (1 - beta) * _reference_grad(model, b2)
    torch.testing.assert_close(m1[0], (1 - beta) * _reference_grad(model, b1))
    torch.testing.assert_close(wg.vectors()[0], expected)


def test_set_grads_binds_views_of_the_aggregate():
    model = _model()
    params = list(model.parameters())
    wg = WorkerGradients(params, workers=2)
    v = torch.arange(wg.numel, dtype=torch.float64)
    wg.set_grads(v)
    lo, hi = v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()
    offset = 0
    for p in params:
        assert p.grad is not None
        assert p.grad.shape == p.shape
        assert lo <= p.grad.data_ptr() < hi
        assert p.grad.data_ptr() == v[offset:].data_ptr()
        assert torch.equal(p.grad.flatten(), v[offset : offset + p.numel()])
        offset += p.numel()
    assert offset == v.numel()
    # views: a change to v shows in the grads
    v.mul_(2)
    assert torch.equal(params[-1].grad.flatten(), v[-params[-1].numel() :])


def test_set_grads_on_a_non_contiguous_aggregate_gets_its_values():
    model = _model()
    params = list(model.parameters())
    wg = WorkerGradients(params, workers=2)
    base = torch.randn(wg.numel, 2, dtype=torch.float64)
    v = base[:, 1]
    assert not v.is_contiguous()
    wg.set_grads(v)
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in params]), v, rtol=0, atol=0)


def test_mixed_dtypes_raise():
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    with pytest.raises(ValueError, match=r"one dtype and device"):
        WorkerGradients(params, workers=2)


def test_no_parameters_raise():
    with pytest.raises(ValueError, match=r"no trainable parameters"):
        WorkerGradients([], workers=2)
    with pytest.raises(ValueError, match=r"no trainable parameters"):
        WorkerGradients(iter(()), workers=1)


def test_rows_take_the_parameters_dtype():
    wg = WorkerGradients(list(_model(dtype=torch.float32).parameters()), workers=4)
    assert wg.rows.dtype == torch.float32
    assert wg.numel == 3 * 4 + 4 + 4 * 2 + 2
    assert wg.rows.shape == (4, wg.numel)


def test_sparse_gradients_land_in_the_row_and_accumulate():
    embedding = nn.Embedding(10, 3, sparse=True)
    wg = WorkerGradients(list(embedding.parameters()), workers=2)
    for ids in ([1, 2], [2]):  # two backward passes of one worker
        wg.bind(0)
        embedding(torch.tensor(ids)).sum().backward()
        wg.collect(0)
    expected = torch.zeros(10, 3)
    expected[1], expected[2] = 1.0, 2.0
    assert torch.equal(wg.rows[0].view(10, 3), expected)
    assert torch.count_nonzero(wg.rows[1]) == 0
