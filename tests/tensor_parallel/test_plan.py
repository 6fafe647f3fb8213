"""``parallelize`` with ``GPT_PLAN`` on the demo ``CharGPT`` against the single-process model, the ledger against
Megatron-LM's count, and the plan's refusals.

Parity: both models are built from one seed; the parallel one trains with the vocab-parallel cross entropy, the
reference with ``F.cross_entropy``, both with AdamW (an elementwise update, so each rank's slice of a parameter moves
as that slice of the full one). The losses and the weights gathered with ``full_state_dict`` agree within float
summation order.

Ledger (Shoeybi et al. 2019, section 3): a transformer block under tensor parallelism all-reduces the activation
``(batch, seq, n_embd)`` exactly twice forward (g after the attention's output projection and after the MLP) and
twice backward (f before the q/k/v projection and before the MLP), whatever the group size. The whole model adds
one forward all-reduce of the same size (the vocab-parallel embedding's g), one backward (the head's f), and the
loss's three forward all-reduces of one value per token (max, target logit, sum of exp).
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from lightning_zero.comm import collectives as comm
from lightning_zero.demo.model import Block, CharGPT
from lightning_zero.tensor_parallel import (
    GPT_PLAN,
    ColwiseParallel,
    RowwiseParallel,
    TensorParallelModule,
    full_state_dict,
    parallelize,
    vocab_parallel_cross_entropy,
)
from tests.helpers.workers import run_workers

WORLD, VOCAB, BLOCK_SIZE, LAYERS, HEADS, EMBD = 2, 16, 8, 2, 4, 16
BATCH, STEPS, TOLERANCE = 4, 4, 1e-5
ACTIVATION_BYTES = BATCH * BLOCK_SIZE * EMBD * 4  # one fp32 (batch, seq, n_embd) activation
TOKEN_BYTES = BATCH * BLOCK_SIZE * 4  # one fp32 value per token


def _gpt(vocab: int = VOCAB, n_head: int = HEADS, n_embd: int = EMBD) -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(vocab, BLOCK_SIZE, LAYERS, n_head, n_embd, dropout=0.0)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    """``CharGPTModule.configure_optimizers``'s groups (no weight decay on vectors), with ``eps=1e-4``.

    Some gradients are exactly zero in exact arithmetic, so both models compute rounding noise of ~1e-9 for them:
    the key bias (adding ``q . b`` to every score of a query leaves its softmax unchanged), and a few MLP weights at
    the first step. Adam divides by ``sqrt(v) + eps``, which turns noise of either sign into steps of up to ``lr``;
    ``eps=1e-4`` keeps such steps below 1e-7 while the real gradients (~1e-3) still take Adam's normalised steps.
    """
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-3, eps=1e-4)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randint(0, VOCAB, (2, BATCH, BLOCK_SIZE), generator=g)
    y[0, :2] = -100  # F.cross_entropy's default ignore_index
    return x, y


def _block_step() -> dict:
    """One forward and backward of a single block under the block part of ``GPT_PLAN``, with its ledger."""
    torch.manual_seed(1)
    ref = nn.Sequential(Block(EMBD, HEADS))
    plan = {key.replace("blocks.*", "0"): style for key, style in GPT_PLAN.items() if key.startswith("blocks.*")}
    block = parallelize(copy.deepcopy(ref), plan)
    x = torch.randn(BATCH, BLOCK_SIZE, EMBD, generator=torch.Generator().manual_seed(2))
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.sum().backward()
    comm.LEDGER.reset()
    y = block(x_tp)
    forward = list(comm.LEDGER.records)
    comm.LEDGER.reset()
    y.sum().backward()
    ledger = (forward, list(comm.LEDGER.records))
    return {"y": (y.detach(), y_ref.detach()), "x.grad": (x_tp.grad, x_ref.grad), "ledger": ledger}


def _gpt_worker() -> dict:
    dist.init_process_group("gloo")
    ref, tp = _gpt(), parallelize(_gpt(), GPT_PLAN)
    optimizers = _adamw(ref), _adamw(tp)
    losses, ledgers = {"ref": [], "tp": []}, []
    for step in range(STEPS):
        x, y = _batch(step)
        loss_ref = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        loss_ref.backward()
        comm.LEDGER.reset()
        loss = vocab_parallel_cross_entropy(tp(x).flatten(0, 1), y.flatten())
        forward = list(comm.LEDGER.records)
        comm.LEDGER.reset()
        loss.backward()
        ledgers.append((forward, list(comm.LEDGER.records)))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        losses["ref"].append(loss_ref.item())
        losses["tp"].append(loss.item())
    return {
        "losses": losses,
        "ledgers": ledgers,
        "state": full_state_dict(tp),
        "ref_state": ref.state_dict(),
        "local_shapes": {key: tuple(value.shape) for key, value in tp.state_dict().items()},
        "n_head": [block.n_head for block in tp.blocks],
        "block": _block_step(),
    }


@pytest.fixture(scope="module")
def gpt_results() -> list[dict]:
    return run_workers(_gpt_worker, WORLD, timeout=120)


@pytest.mark.timeout(120)
def test_gpt_plan_trains_like_the_single_process_model(gpt_results):
    for rank, result in enumerate(gpt_results):
        losses = result["losses"]
        torch.testing.assert_close(losses["tp"], losses["ref"], rtol=0, atol=TOLERANCE, msg=f"rank {rank} losses")
        assert result["state"].keys() == result["ref_state"].keys()
        for key, value in result["ref_state"].items():
            torch.testing.assert_close(result["state"][key], value, rtol=0, atol=TOLERANCE, msg=f"rank {rank} {key}")
        assert result["n_head"] == [HEADS // WORLD] * LAYERS
        shapes = result["local_shapes"]  # this rank's slices, by the plan
        assert shapes["wte.weight"] == (VOCAB // WORLD, EMBD) and shapes["wpe.weight"] == (BLOCK_SIZE, EMBD)
        assert shapes["blocks.0.qkv.weight"] == (3 * EMBD // WORLD, EMBD)
        assert shapes["blocks.0.proj.weight"] == (EMBD, EMBD // WORLD) and shapes["blocks.0.proj.bias"] == (EMBD,)
        assert shapes["blocks.0.mlp.0.weight"] == (4 * EMBD // WORLD, EMBD)
        assert shapes["blocks.0.mlp.2.weight"] == (EMBD, 4 * EMBD // WORLD)
        assert shapes["head.weight"] == (VOCAB // WORLD, EMBD) and shapes["ln_f.weight"] == (EMBD,)


@pytest.mark.timeout(120)
def test_a_block_all_reduces_its_activation_twice_forward_and_twice_backward(gpt_results):
    for result in gpt_results:
        block = result["block"]
        for name in ("y", "x.grad"):
            ours, ref = block[name]
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6, msg=name)
        forward, backward = block["ledger"]
        assert forward == [("all_reduce", "tp", ACTIVATION_BYTES)] * 2
        assert backward == [("all_reduce", "tp", ACTIVATION_BYTES)] * 2


@pytest.mark.timeout(120)
def test_a_gpt_step_adds_the_embedding_head_and_loss_all_reduces(gpt_results):
    expected_forward = Counter({ACTIVATION_BYTES: 2 * LAYERS + 1, TOKEN_BYTES: 3})  # + embedding g; + loss
    expected_backward = Counter({ACTIVATION_BYTES: 2 * LAYERS + 1})  # + head f
    for result in gpt_results:
        for forward, backward in result["ledgers"]:
            assert {op for op, _, _ in forward + backward} == {"all_reduce"}
            assert {tag for _, tag, _ in forward + backward} == {"tp"}
            assert Counter(nbytes for _, _, nbytes in forward) == expected_forward
            assert Counter(nbytes for _, _, nbytes in backward) == expected_backward


def _unchanged(model: CharGPT, reference: CharGPT) -> bool:
    """Nothing replaced, no head count divided, no weight changed."""
    return (
        not any(isinstance(sub, TensorParallelModule) for sub in model.modules())
        and [b.n_head for b in model.blocks] == [b.n_head for b in reference.blocks]
        and all(torch.equal(value, reference.state_dict()[key]) for key, value in model.state_dict().items())
    )


REFUSED_SIZES = {  # name: (model arguments, plan, message)
    "heads": (
        {"n_head": 3, "n_embd": 12},
        GPT_PLAN,
        "plan key 'blocks.*', module 'blocks.0' (Block): n_head=3 is not divisible by the tensor-parallel size 2",
    ),
    "vocab": (
        {"vocab": 15},
        GPT_PLAN,
        "plan key 'wte', module 'wte' (Embedding): num_embeddings=15 is not divisible by the tensor-parallel size 2",
    ),
    "fused": (
        {"n_head": 1, "n_embd": 9},
        {"head": ColwiseParallel(), "blocks.*.qkv": ColwiseParallel(chunks=3)},
        "plan key 'blocks.*.qkv', module 'blocks.0.qkv' (Linear): out_features=27 is not divisible by chunks=3 x "
        "the tensor-parallel size 2 = 6",
    ),
    "row": (
        {"n_head": 1, "n_embd": 9},
        {"blocks.*.proj": RowwiseParallel()},
        "plan key 'blocks.*.proj', module 'blocks.0.proj' (Linear): in_features=9 is not divisible by the "
        "tensor-parallel size 2",
    ),
}


def _refused_sizes_worker() -> dict:
    dist.init_process_group("gloo")
    out = {}
    for name, (arguments, plan, _) in REFUSED_SIZES.items():
        model = _gpt(**arguments)
        try:
            parallelize(model, plan)
        except ValueError as err:
            out[name] = (str(err), _unchanged(model, _gpt(**arguments)))
    return out


@pytest.mark.timeout(120)
def test_sizes_that_do_not_divide_are_refused_naming_module_and_numbers_and_change_nothing():
    for result in run_workers(_refused_sizes_worker, WORLD, timeout=120):
        assert result.keys() == REFUSED_SIZES.keys()
        for name, (_, _, message) in REFUSED_SIZES.items():
            assert result[name] == (message, True), name


@pytest.mark.parametrize(
    ("plan", "error", "message"),
    [
        (
            {"head": ColwiseParallel(), "blocks.*.attn": ColwiseParallel()},
            ValueError,
            "plan key 'blocks.*.attn' matches no module of CharGPT (names: 'wte', 'wpe', 'blocks', 'blocks.0', "
            "'blocks.0.ln_1', 'blocks.0.qkv', ...)",
        ),
        (
            {"head": ColwiseParallel(), "wte": ColwiseParallel()},
            TypeError,
            "plan key 'wte', module 'wte' (Embedding): ColwiseParallel applies to Linear modules only",
        ),
        (
            {"blocks.*": RowwiseParallel()},
            TypeError,
            "plan key 'blocks.*', module 'blocks.0' (Block): RowwiseParallel applies to Linear modules only",
        ),
        (
            {"blocks.*.qkv": ColwiseParallel(chunks=3), "blocks.0.*": RowwiseParallel()},
            ValueError,
            "module 'blocks.0.qkv' is matched by plan keys 'blocks.*.qkv' and 'blocks.0.*'",
        ),
        (
            {"head": "colwise"},
            TypeError,
            "plan key 'head' maps to 'colwise': expected a Style such as ColwiseParallel()",
        ),
    ],
    ids=["unmatched_key", "embedding_as_linear", "block_as_linear", "matched_twice", "not_a_style"],
)
def test_bad_plans_are_refused_before_anything_changes(plan, error, message):
    model = _gpt()  # no process group: a group of one rank, so only the sizes could not be refused
    with pytest.raises(error) as info:
        parallelize(model, plan)
    assert str(info.value) == message
    assert _unchanged(model, _gpt())


def test_a_plan_over_one_rank_changes_no_number():
    ref, model = _gpt(), parallelize(_gpt(), GPT_PLAN)
    x, y = _batch(0)
    assert torch.equal(model(x), ref(x))
    torch.testing.assert_close(
        vocab_parallel_cross_entropy(model(x).flatten(0, 1), y.flatten()),
        F.cross_entropy(ref(x).flatten(0, 1), y.flatten()),
    )
    assert comm.LEDGER.records == []
