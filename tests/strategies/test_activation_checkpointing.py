"""``activation_checkpointing_policy`` on every strategy (``lightning_zero/training/activation_checkpointing.py``).

One pair of gloo worker processes fits the tied-embedding GPT of ``tests/helpers/parity.py`` under every strategy with
and without checkpointing its ``Block``s (under ZeRO-3 also with the whole ``TinyGPT`` checkpointed, which makes the
recompute gather the nested ``Block`` units again inside backward). Recomputing a forward is deterministic, so the
weights after the fit must be equal; the bytes autograd keeps for backward (counted with ``saved_tensors_hooks``
around each training step) must fall.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import lightning as L
import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.data import DataLoader

from lightning_zero import ZeroStrategy
from tests.helpers.equivalence import OURS, make_strategy, max_diff, state_of
from tests.helpers.parity import Block, ParityConfig, ParityModule, TinyGPT, make_dataset, quiet_trainer
from tests.helpers.workers import run_workers

CONFIG = ParityConfig(model="gpt", batches_per_rank=4, max_epochs=1, gradient_clip_val=None)


@contextmanager
def saved_bytes() -> Iterator[list[int]]:
    """Inside, the bytes of the tensors autograd saves for backward add up in the yielded one-element list."""
    total = [0]

    def pack(tensor):
        total[0] += tensor.numel() * tensor.element_size()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        yield total


class SavedBytes(ParityModule):
    """Counts the bytes of the tensors autograd saves for backward in each training step."""

    def __init__(self) -> None:
        super().__init__(CONFIG.lr, model="gpt")
        self.saved: list[int] = []

    def training_step(self, batch, batch_idx):
        with saved_bytes() as total:
            loss = super().training_step(batch, batch_idx)
        self.saved.append(total[0])
        return loss


def _fit(name: str, policy: set[type] | None) -> dict:
    L.seed_everything(CONFIG.seed, verbose=False)
    module = SavedBytes()
    kwargs = {"activation_checkpointing_policy": policy} if policy else {}
    if name == "zero3_scratch":
        kwargs["auto_wrap_policy"] = {Block}
    trainer = quiet_trainer(make_strategy(name, **kwargs), max_epochs=CONFIG.max_epochs)
    trainer.fit(module, DataLoader(make_dataset(CONFIG), batch_size=CONFIG.batch_size))
    restored = all("forward" not in vars(m) for m in module.modules())
    return {"state": state_of(module), "saved": module.saved, "restored": restored}


def _all_fits() -> dict:
    runs = {}
    for name in OURS:
        runs[(name, None)] = _fit(name, None)
        runs[(name, "block")] = _fit(name, {Block})
    runs[("zero3_scratch", "whole")] = _fit("zero3_scratch", {TinyGPT})  # units nested in the recomputed module
    return runs


@pytest.fixture(scope="module")
def runs():
    return run_workers(_all_fits, 2, timeout=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", OURS)
def test_checkpointing_blocks_trains_the_same_and_keeps_fewer_activations(runs, name):
    for rank_runs in runs:
        plain, checkpointed = rank_runs[(name, None)], rank_runs[(name, "block")]
        assert max_diff(checkpointed["state"], plain["state"]) <= 1e-6
        assert len(checkpointed["saved"]) == len(plain["saved"]) > 0
        assert max(checkpointed["saved"]) < 0.6 * min(plain["saved"]), (checkpointed["saved"], plain["saved"])
        assert checkpointed["restored"]  # the module's own forwards are back after the fit


@pytest.mark.timeout(700)
def test_zero3_recompute_regathers_nested_units(runs):
    """The whole net checkpointed: its recompute runs the Block units' hooks inside backward (a gather and a free
    each, the same on every rank, so the gather-order check passes) and the result is unchanged."""
    for rank_runs in runs:
        plain, whole = rank_runs[("zero3_scratch", None)], rank_runs[("zero3_scratch", "whole")]
        assert max_diff(whole["state"], plain["state"]) <= 1e-6
        assert max(whole["saved"]) < max(rank_runs[("zero3_scratch", "block")]["saved"])


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"Block"}, "activation_checkpointing_policy: cannot import 'Block'"),
        ({"torch.nn.NoSuchLayer"}, "cannot import 'torch.nn.NoSuchLayer'"),
        (set(), r"activation_checkpointing_policy=set\(\) is invalid: it is empty"),
        ({int}, "is not a nn.Module class"),
        (Block, "activation_checkpointing_policy=.* is invalid: expected a set of nn.Module classes"),
    ],
)
def test_bad_policy_is_refused(policy, message):
    with pytest.raises(ValueError, match=message):
        ZeroStrategy(stage=3, activation_checkpointing_policy=policy)


def test_policy_by_import_path_as_a_hydra_config_gives_it():
    from omegaconf import OmegaConf

    paths = OmegaConf.create(["torch.nn.TransformerEncoderLayer", "torch.nn.Linear"])
    strategy = ZeroStrategy(stage=3, activation_checkpointing_policy=paths, auto_wrap_policy=paths)
    assert strategy.activation_checkpointing_policy == strategy.auto_wrap_policy
    assert strategy.auto_wrap_policy == {torch.nn.TransformerEncoderLayer, torch.nn.Linear}


def test_saved_bytes_counter_sees_activations():
    """The measurement itself: a plain forward saves tensors, a checkpointed one only its inputs."""
    torch.manual_seed(0)
    net = TinyGPT()
    idx = torch.randint(0, 13, (2, 8))
    counts = []
    for wrap in (False, True):
        with saved_bytes() as total:
            out = torch.utils.checkpoint.checkpoint(net, idx, use_reentrant=False) if wrap else net(idx)
        out.sum().backward()
        counts.append(total[0])
    assert 0 < counts[1] < counts[0]
