"""Hybrid sharding (``shard_size``) on 4 real gloo processes, 2 shard groups x 2: parity with Lightning's ``ddp`` and
the single-process reference, model-state bytes at the ZeRO formulas with N = the group size, communication per step
against its theory, and checkpoints that resume bit-identically and load into a run without hybrid sharding.

One set of 4 workers runs every fit; the tests assert on the parts.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import lightning as L
import pytest

import lightning_zero
from lightning_zero import ZeroStrategy
from lightning_zero.zero.hybrid import check_shard_size, hybrid_ranks
from lightning_zero.zero.settings import ZeroSettings
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage3.state import optimizer_state_dict
from lightning_zero.zero.stage12_state import full_state_dict
from tests.fabric.test_fabric import STEPS as FABRIC_STEPS
from tests.fabric.test_fabric import _fabric_loop
from tests.fabric.test_fabric import _reference as _fabric_reference
from tests.helpers.equivalence import Recorder, make_strategy, max_diff, state_of
from tests.helpers.parity import (
    ParityConfig,
    ParityModule,
    assert_optimizer_states_equal,
    fit_lightning,
    make_trainer,
    max_abs_diff,
    quiet_trainer,
    reference_params,
    train_loader,
)
from tests.helpers.probes import ModelStateProbe
from tests.helpers.workers import run_workers
from tests.strategies.test_equivalence import TransformerModule, _loader, _tokens
from tests.strategies.test_zero import SMALL_BUCKET_MB, _WideModule
from tests.strategies.test_zero3 import _WideModule as _WideModule3

WORLD, SHARD = 4, 2
TOLERANCE = 1e-5
CONFIG = ParityConfig(world_size=WORLD, accumulate_grad_batches=3)  # a short last window in every epoch
STAGES = (1, 2, 3)


def _hybrid(stage: int, **kwargs) -> ZeroStrategy:
    return ZeroStrategy(stage=stage, shard_size=SHARD, bucket_size_mb=SMALL_BUCKET_MB, **kwargs)


# ---------------------------------------------------------------- pure
def test_groups_are_consecutive_ranks_and_their_replicas():
    assert hybrid_ranks(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert hybrid_ranks(8, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert hybrid_ranks(4, 1) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])  # pure replication
    assert hybrid_ranks(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])  # plain ZeRO
    for world, shard in ((6, 3), (12, 4), (8, 2)):
        shard_groups, replicate_groups = hybrid_ranks(world, shard)
        assert sorted(r for g in shard_groups for r in g) == list(range(world))
        assert sorted(r for g in replicate_groups for r in g) == list(range(world))
        assert all(len(set(s) & set(r)) == 1 for s in shard_groups for r in replicate_groups)


@pytest.mark.parametrize(
    ("shard_size", "world_size", "message"),
    [
        (3, 4, r"shard_size=3 does not divide the world size 4: expected one of \[1, 2, 4\] or None"),
        (0, None, r"shard_size=0 is invalid: expected an integer >= 1 or None"),
        (True, None, r"shard_size=True is invalid"),
        ("2", None, r"shard_size='2' is invalid"),
    ],
)
def test_bad_shard_size_is_refused_with_the_numbers(shard_size, world_size, message):
    with pytest.raises(ValueError, match=message):
        check_shard_size(shard_size, world_size)
    if world_size is None:  # checked when the strategy is built, before any process starts
        with pytest.raises(ValueError, match=message):
            ZeroStrategy(stage=2, shard_size=shard_size)
    check_shard_size(None, 4)
    assert ZeroSettings.check(stage=3, shard_size=2).shard_size == 2


# ---------------------------------------------------------------- 4 processes
class _Probe(ModelStateProbe):
    """Model-state bytes at the end of fit, the ledger of every training batch, the layout and its traffic theory."""

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        engine = trainer.strategy.engine
        if isinstance(engine, ShardedParams):
            self.padded = sum(s.layout.padded_numel for s in engine.segments)
            self.theory = engine.step_nbytes()
            self.bucket_bytes = 0
        else:
            self.padded = sum(g.layout.padded_numel for g in engine.groups)
            self.bucket_bytes = max(b.numel for b in engine.reducer.buckets) * 4
            self.theory = None


def _probe(stage: int, **kwargs) -> dict:
    config = ParityConfig(world_size=WORLD, max_epochs=1)
    probe = _Probe()
    module = _WideModule() if stage < 3 else _WideModule3()  # the same wide net; stage 3 builds it in configure_model
    make_trainer(config, _hybrid(stage, **kwargs), callbacks=[probe]).fit(module, train_loader(config))
    return {k: getattr(probe, k) for k in ("memory", "psi", "padded", "bucket_bytes", "batches", "theory")}


def _transformer(name: str, **strategy_kwargs) -> dict:
    L.seed_everything(7, verbose=False)
    module, recorder = TransformerModule(), Recorder()
    trainer = quiet_trainer(
        make_strategy(name, **strategy_kwargs), devices=WORLD, max_epochs=1, gradient_clip_val=0.5, callbacks=[recorder]
    )
    trainer.fit(module, _loader(_tokens()))
    return {"state": state_of(module), "steps": recorder.steps, "norms": module.norms}


class _CaptureOptimizerState(L.Callback):
    def on_train_start(self, trainer, pl_module):
        engine = trainer.strategy.engine
        sharded_params = isinstance(engine, ShardedParams)
        if sharded_params:
            self.state = optimizer_state_dict(engine, sharded=False)
        else:
            self.state = full_state_dict(engine.shards(0))


def _checkpoints(stage: int, tmp: str) -> dict:
    config = ParityConfig(world_size=WORLD, batches_per_rank=3, max_epochs=2)
    ckpt = str(Path(tmp) / f"stage{stage}.ckpt")

    def fit(epochs: int, strategy: ZeroStrategy, ckpt_path: str | None = None, save: bool = False) -> dict:
        L.seed_everything(config.seed, verbose=False)
        module, capture = ParityModule(config.lr), _CaptureOptimizerState()
        trainer = make_trainer(config, strategy, max_epochs=epochs, callbacks=[capture])
        trainer.fit(module, train_loader(config), ckpt_path=ckpt_path)
        if save:
            trainer.save_checkpoint(ckpt)
        engine = trainer.strategy.engine
        with engine.summon_full_params() if isinstance(engine, ShardedParams) else nullcontext():
            params = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
        saved = capture.state if ckpt_path else None
        at_end = optimizer_state_dict(engine, False) if stage == 3 else full_state_dict(engine.shards(0))
        return {"params": params, "state_at_start": saved, "state_at_end": at_end}

    straight = fit(2, _hybrid(stage))
    saved = fit(1, _hybrid(stage), save=True)
    resumed = fit(2, _hybrid(stage), ckpt_path=ckpt)
    unhybrid = fit(2, ZeroStrategy(stage=stage), ckpt_path=ckpt)  # sharded 4 ways, from 2 x 2
    return {"straight": straight, "saved": saved, "resumed": resumed, "unhybrid": unhybrid}


def _all_fits(tmp: str) -> dict:
    out = {"ddp": fit_lightning(CONFIG, "ddp"), ("fabric", "ddp"): _fabric_loop("ddp", WORLD)}
    for stage in STAGES:
        out["fabric", stage] = _fabric_loop(lightning_zero.fabric.ZeroStrategy(stage=stage, shard_size=SHARD), WORLD)
    for stage in STAGES:
        out[stage] = fit_lightning(CONFIG, _hybrid(stage))
        out[("probe", stage)] = _probe(stage)
    out["2-reduce_scatter"] = fit_lightning(CONFIG, _hybrid(2, grad_reduction="reduce_scatter"))
    out["probe", "qwZ+qgZ"] = _probe(3, quantized_weights=True, quantized_grads=True, quant_block_size=64)
    out["transformer", "ddp"] = _transformer("ddp")
    for stage in (2, 3):
        out["transformer", stage] = _transformer(f"zero{stage}_scratch", shard_size=SHARD)
    for stage in (1, 3):
        out["checkpoint", stage] = _checkpoints(stage, tmp)
    return out


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    return run_workers(_all_fits, WORLD, str(tmp_path_factory.mktemp("hybrid")), timeout=900)


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("stage", [*STAGES, "2-reduce_scatter"])
def test_parity_with_ddp_and_the_reference(fits, stage):
    ours, ddp = fits[0][stage], fits[0]["ddp"]
    assert max_abs_diff(ours, reference_params(CONFIG)) <= TOLERANCE
    assert max_abs_diff(ours, ddp) <= TOLERANCE
    for rank_result in fits[1:]:
        assert max_abs_diff(rank_result[stage], ours) == 0.0  # every rank, both groups, the same weights
    assert max_abs_diff(ours, dict(ParityModule().net.state_dict())) > 1e3 * TOLERANCE


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("stage", STAGES)
def test_fabric_loop_matches_fabric_ddp_and_the_reference(fits, stage):
    """Fabric with accumulation (``no_backward_sync``), clipping and a scheduler (``tests/fabric/test_fabric.py``)."""
    reference = _fabric_reference((WORLD,) * FABRIC_STEPS)
    for rank_result in fits:
        ours, ddp = rank_result["fabric", stage]["weights"], rank_result["fabric", "ddp"]["weights"]
        assert max_diff(ours, ddp) <= TOLERANCE
        assert max_diff(ours, reference) <= TOLERANCE


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("stage", (2, 3))
def test_lightning_demo_transformer_matches_ddp(fits, stage):
    """Weights and buffers on every rank, the logged loss and lightning_zero.grad_norm (summed over the shard group
    only: a sum over every rank would count each shard twice) after each step, with norm clipping."""
    for rank_result in fits:
        ours, ddp = rank_result["transformer", stage], rank_result["transformer", "ddp"]
        assert max_diff(ours["state"], ddp["state"]) <= TOLERANCE
        assert len(ours["steps"]) == len(ddp["steps"]) == 4
        for a, b in zip(ours["steps"], ddp["steps"]):
            assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], abs=TOLERANCE) for k in a)
        assert len(ours["norms"]) == len(ddp["norms"]) == 4
        for a, b in zip(ours["norms"], ddp["norms"]):
            assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6) for k in a)


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("stage", STAGES)
def test_model_state_bytes_follow_the_formula_at_the_group_size(fits, stage):
    for rank_result in fits:
        probe = rank_result["probe", stage]
        psi, memory = probe["psi"], probe["memory"]
        params = 4 * psi if stage < 3 else 4 * psi / SHARD
        grads = {1: 4 * psi, 2: 4 * psi / SHARD, 3: 4 * psi / SHARD}[stage]
        assert memory.params == pytest.approx(params, rel=0.01)
        assert memory.grads == pytest.approx(grads, rel=0.01)
        assert memory.optimizer == pytest.approx(8 * psi / SHARD, rel=0.01)  # not / WORLD: two copies of each shard
        assert memory.total - memory.strategy_buffers == pytest.approx(params + grads + 8 * psi / SHARD, rel=0.01)


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("stage", [*STAGES, "qwZ+qgZ"])
def test_communication_per_step_matches_its_theory(fits, stage):
    """Stage 1: the whole gradient all-reduced over the 4 ranks, the shards all-gathered in the group of 2. Stage 2
    (``grad_reduction="auto"``: reduce to owners): each bucket's pieces reduced into their owners in the group of 2,
    each owned piece all-reduced across the replicas, the shards all-gathered in the group. Stage 3: gathers and
    reduce-scatters in the group of 2 (int8 blocks with qwZ/qgZ), plus one all-reduce of each reduced shard across
    the replicas: what ``step_nbytes`` computes."""
    for rank_result in fits:
        probe = rank_result["probe", stage]
        padded_bytes = 4 * probe["padded"]
        assert 0 <= padded_bytes - 4 * probe["psi"] < 4 * SHARD * 16
        for records in probe["batches"]:
            summary: dict[tuple[str, str], int] = {}
            for op, tag, nbytes in records:
                if tag in ("params", "grads"):
                    summary[op, tag] = summary.get((op, tag), 0) + nbytes
            if stage == 1:
                assert summary == {("all_reduce", "grads"): padded_bytes, ("all_gather", "params"): padded_bytes}
                continue
            if stage == 2:
                assert summary == {
                    ("reduce", "grads"): padded_bytes,  # this rank's contribution to every piece of its group
                    ("all_reduce", "grads"): padded_bytes // SHARD,  # its owned pieces, across the replicas
                    ("all_gather", "params"): padded_bytes,
                }
                continue
            assert summary[("all_reduce", "grads")] == padded_bytes // SHARD  # one fp32 shard per rank
            tagged = {tag: sum(b for (_, t), b in summary.items() if t == tag) for tag in ("params", "grads")}
            assert tagged == probe["theory"]
            if stage == 3:
                assert summary[("reduce_scatter", "grads")] == padded_bytes


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("stage", (1, 3))
def test_sharded_checkpoint_resumes_bit_identically_and_loads_without_hybrid(fits, stage):
    for rank_result in fits:
        result = rank_result["checkpoint", stage]
        assert max_abs_diff(result["resumed"]["params"], result["straight"]["params"]) == 0.0
        assert max_abs_diff(result["unhybrid"]["params"], result["straight"]["params"]) <= TOLERANCE
    saved = fits[0]["checkpoint", stage]["saved"]["state_at_end"]
    for key in ("resumed", "unhybrid"):  # the full optimizer state back, each replicated shard written once
        assert_optimizer_states_equal(fits[0]["checkpoint", stage][key]["state_at_start"], saved)
