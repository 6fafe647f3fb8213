"""The char GPT demo's pipeline view, its vocabulary padding, and a pipeline fit against one process."""

from __future__ import annotations

from unittest.mock import Mock

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero.demo.model import CharGPT, CharGPTModule
from lightning_zero.tensor_parallel import GPT_PLAN
from tests.helpers.parity import max_abs_diff, quiet_trainer
from tests.helpers.workers import run_workers

VOCAB, CONTEXT = 13, 8


def reference_forward(net: CharGPT, idx: torch.Tensor) -> torch.Tensor:
    """The network written out: embeddings, blocks, final norm, head."""
    x = net.wte(idx) + net.wpe(torch.arange(idx.shape[1]))
    for block in net.blocks:
        x = block(x)
    return net.head(net.ln_f(x))


def test_layers_is_a_view_of_the_network_in_order():
    torch.manual_seed(0)
    net = CharGPT(VOCAB, CONTEXT, n_layer=2, n_head=2, n_embd=8, dropout=0.0)
    keys = list(net.state_dict())
    idx = torch.randint(0, VOCAB, (3, CONTEXT))
    assert torch.equal(net(idx), reference_forward(net, idx))
    layers = net.layers
    assert len(layers) == 4 and layers[1] is net.blocks[0] and layers[0].wte is net.wte and layers[-1].head is net.head
    assert net.layers is layers and list(net.state_dict()) == keys  # cached, and no second name in the state dict
    net.head = nn.Linear(8, VOCAB, bias=False)  # a replaced module (as tensor parallelism does) rebuilds the view
    assert net.layers is not layers and net.layers[-1].head is net.head


def test_vocab_multiple_pads_the_embedding_and_head_only():
    module = CharGPTModule(vocab_size=VOCAB, block_size=CONTEXT, n_layer=1, n_head=2, n_embd=8, vocab_multiple=8)
    module.configure_model()
    assert module.padded_vocab_size == 16 and module.net.wte.num_embeddings == 16 and module.net.head.out_features == 16
    with pytest.raises(ValueError, match="vocab_multiple=0 is invalid: expected an integer >= 1"):
        CharGPTModule(vocab_size=VOCAB, vocab_multiple=0)


def test_the_module_plan_is_gpt_plan_under_net():
    assert dict(CharGPTModule.tensor_parallel_plan) == {f"net.{k}": v for k, v in GPT_PLAN.items()}


def _dataset() -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (32, CONTEXT + 1), generator=torch.Generator().manual_seed(3))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _sgd(groups: list[dict]) -> torch.optim.Optimizer:
    # Not AdamW: the key projection's bias has a zero gradient in exact arithmetic, and Adam's normalization would
    # turn the two runs' different rounding noise (micro-batches summed in another order) into opposite steps.
    return torch.optim.SGD(groups, lr=0.5, momentum=0.9)


def _module() -> CharGPTModule:
    torch.manual_seed(0)
    module = CharGPTModule(
        vocab_size=VOCAB, block_size=CONTEXT, n_layer=2, n_head=2, n_embd=8, warmup_steps=0, optimizer=_sgd
    )
    module.configure_model()
    return module


def _fit_pipeline() -> dict[str, torch.Tensor]:
    module = _module()
    trainer = quiet_trainer(lightning_zero.PipelineStrategy(micro_batches=2), devices=2, max_epochs=1)
    trainer.fit(module, DataLoader(_dataset(), batch_size=8))
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def test_the_demo_gpt_as_a_pipeline_matches_one_process():
    """Its ``pipeline_layers`` (embeddings | 2 blocks | head, cut 2 + 2) trained on 2 stages."""
    weights = run_workers(_fit_pipeline, 2, timeout=120)
    module = _module()
    module._trainer = Mock(estimated_stepping_batches=4)  # 32 samples in batches of 8, one epoch: the LR schedule
    optimizer = module.configure_optimizers()
    (opt,), (scheduler,) = [optimizer["optimizer"]], [optimizer["lr_scheduler"]["scheduler"]]
    indices = torch.randperm(32, generator=torch.Generator().manual_seed(0)).tolist()  # the sampler's epoch-0 order
    x, y = _dataset()[indices]
    for xb, yb in zip(x.split(8), y.split(8)):
        F.cross_entropy(module.net(xb).flatten(0, 1), yb.flatten()).backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
    for rank_weights in weights:
        assert max_abs_diff(rank_weights, module.net.state_dict()) < 1e-5
