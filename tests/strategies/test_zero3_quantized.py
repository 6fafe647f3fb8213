"""``zero3_scratch`` with ZeRO++'s quantized communication (qwZ: ``quantized_weights``, qgZ: ``quantized_grads``).

On 2 gloo processes, the tied-weight GPT of ``tests/helpers/parity.py`` (three units: two blocks and the root unit
with the embeddings and the head) fits under every combination: the ranks compute with identical weights, the run
stays close to the exact one without equalling it, and every step's ledger bytes are the theory of
[Note: stage-3 traffic] (``lightning_zero/zero/stage3/traffic.py``). Checkpoints hold the exact fp32 masters, so a
resume is bit-identical. Bad settings fail before any process starts.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.fabric.zero import ZeroStrategy as FabricZeroStrategy
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage3.units import ROOT
from tests.helpers.parity import ParityConfig, ParityModule, make_trainer, max_abs_diff, train_loader
from tests.helpers.probes import LedgerPerBatch
from tests.helpers.workers import run_workers

OPTIONS = {
    "exact": {},
    "qwZ": {"quantized_weights": True},
    "qgZ": {"quantized_grads": True},
    "qwZ+qgZ": {"quantized_weights": True, "quantized_grads": True},
}
BLOCK = 64  # smaller than the shards of the larger segments, so some end in a short block
DRIFT = 0.02
"""How far (max abs) a quantized run may end from the exact one, relative to how far (max abs) the exact run moved
the weights; measured 0.2-0.3%. With SGD: AdamW turns any noise in a near-zero gradient into a full-size step (see
``tests/helpers/parity.py``), which says nothing about the quantization."""


class _Probe(LedgerPerBatch):
    """The ledger of every batch, the engine's theory, and the weights the ranks compute with after the fit (the
    fit then hands the masters back into the module)."""

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.engine
        self.theory = engine.step_nbytes()
        self.padded_numel = sum(s.layout.padded_numel for s in engine.segments)
        self.root_numel = sum(s.layout.padded_numel for u in engine.units if u.plan.name == ROOT for s in u.segments)
        with engine.summon_full_params():  # gathered as in training: dequantized under qwZ
            self.computed = {k: v.detach().clone() for k, v in pl_module.net.state_dict().items()}


def _fit(config: ParityConfig, ckpt: str = "", resume: str = "", **options) -> dict:
    import lightning as L

    L.seed_everything(config.seed, verbose=False)
    module = ParityModule(config.lr, config.optimizer, config.model, build_in_configure_model=True)
    probe = _Probe()
    strategy = ZeroStrategy(stage=3, quant_block_size=BLOCK, **options)
    trainer = make_trainer(config, strategy, callbacks=[probe])
    trainer.fit(module, train_loader(config), ckpt_path=resume or None)
    if ckpt:
        trainer.save_checkpoint(ckpt)
    masters = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    fields = ("batches", "theory", "padded_numel", "root_numel", "computed")
    return {"masters": masters, "steps": trainer.global_step, **{k: getattr(probe, k) for k in fields}}


def _all_options(world_size: int) -> dict:
    config = ParityConfig(world_size, model="gpt", max_epochs=1, optimizer="sgd", gradient_clip_val=None, lr=0.05)
    return {name: _fit(config, **options) for name, options in OPTIONS.items()}


@pytest.mark.timeout(300)
def test_quantized_zero3_is_applied_close_to_exact_identical_on_every_rank_and_counted():
    ranks = run_workers(_all_options, 2, 2, timeout=240)
    runs = ranks[0]
    initial = dict(ParityModule(model="gpt").net.state_dict())
    moved = max_abs_diff(runs["exact"]["masters"], initial)
    for name, run in runs.items():
        # every rank computes with the same weights (the dequantized gathers, each rank's own piece included) and
        # holds the same masters after the fit (the fit hands them back into the module)
        assert max_abs_diff(run["computed"], ranks[1][name]["computed"]) == 0.0, name
        assert max_abs_diff(run["masters"], ranks[1][name]["masters"]) == 0.0, name
        if name != "exact":  # applied (not the exact run), and close to it
            drift = max_abs_diff(run["masters"], runs["exact"]["masters"])
            assert 0.0 < drift <= DRIFT * moved, (name, drift, moved)
        quantized_weights = "qwZ" in name
        # the weights computed with are the masters (exact gather) or within half a step of their blocks (qwZ)
        assert (max_abs_diff(run["computed"], run["masters"]) > 0.0) == quantized_weights
        # ledger bytes of every step against the theory; exact: 8Ψ of gathers (the root unit's 4Ψ once), 4Ψ reduced
        theory = run["theory"]
        for records in run["batches"]:
            gathered = sum(b for op, tag, b in records if (op, tag) == ("all_gather", "params"))
            reduced = sum(b for op, tag, b in records if (op, tag) == ("reduce_scatter", "grads"))
            assert gathered == pytest.approx(theory["params"], rel=0.01) and gathered == theory["params"]
            assert reduced == pytest.approx(theory["grads"], rel=0.01) and reduced == theory["grads"]
        psi, root = run["padded_numel"], run["root_numel"]
        exact_params, exact_grads = 4 * (2 * psi - root), 4 * psi
        assert theory["params"] == exact_params if not quantized_weights else theory["params"] < 0.3 * exact_params
        assert theory["grads"] == exact_grads if "qgZ" not in name else theory["grads"] < 0.3 * exact_grads


def _save_resume(tmp: str) -> dict:
    options = OPTIONS["qwZ+qgZ"]
    straight = _fit(ParityConfig(2, model="gpt", batches_per_rank=3, max_epochs=2), **options)
    first = ParityConfig(2, model="gpt", batches_per_rank=3, max_epochs=1)
    saved = _fit(first, ckpt=f"{tmp}/epoch1.ckpt", **options)
    resumed = _fit(
        ParityConfig(2, model="gpt", batches_per_rank=3, max_epochs=2), resume=f"{tmp}/epoch1.ckpt", **options
    )
    return {"straight": straight, "saved": saved, "resumed": resumed}


@pytest.mark.timeout(300)
def test_save_and_resume_under_quantized_communication_is_bit_identical(tmp_path):
    """The checkpoint holds the exact fp32 masters (shards are never quantized), so resuming repeats the straight run
    bit for bit, the quantized gathers and reductions included."""
    result = run_workers(_save_resume, 2, str(tmp_path), timeout=240)[0]
    assert (result["straight"]["steps"], result["saved"]["steps"], result["resumed"]["steps"]) == (6, 3, 6)
    assert max_abs_diff(result["straight"]["masters"], result["resumed"]["masters"]) == 0.0
    assert max_abs_diff(result["straight"]["masters"], result["saved"]["masters"]) > 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 2, "quantized_weights": True}, "quantized_weights apply to stage=3 only: got stage=2"),
        ({"stage": 1, "quantized_grads": True}, "quantized_grads apply to stage=3 only: got stage=1"),
        ({"stage": 2, "quant_block_size": 128}, "quant_block_size apply to stage=3 only: got stage=2"),
        ({"stage": 3, "quant_block_size": 0}, "quant_block_size=0 is invalid: expected an integer >= 1"),
        ({"stage": 3, "quant_block_size": 2.5}, "quant_block_size=2.5 is invalid: expected an integer >= 1"),
        (
            {"stage": 3, "quantized_grads": True, "reduce_dtype": "bf16"},
            "reduce_dtype='bf16' conflicts with quantized_grads=True: qgZ sends int8 and reduces in fp32",
        ),
    ],
)
@pytest.mark.parametrize("front_end", [ZeroStrategy, FabricZeroStrategy], ids=["trainer", "fabric"])
def test_bad_quantization_settings_raise_one_clear_value_error(front_end, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        front_end(**kwargs)


def test_quantization_settings_are_accepted_and_reach_the_engine_arguments():
    strategy = ZeroStrategy(stage=3, quantized_grads=True, quant_block_size=256, reduce_dtype="fp32")
    assert (strategy.quantized_weights, strategy.quantized_grads, strategy.quant_block_size) == (False, True, 256)
    assert FabricZeroStrategy(stage=3, quantized_weights=True).quant_block_size == 512
    with pytest.raises(ValueError, match=r"reduce_dtype=torch\.bfloat16 conflicts with grad_block_size=8"):
        ShardedParams(nn.Sequential(nn.Linear(2, 2)), grad_block_size=8, reduce_dtype=torch.bfloat16)
