"""``robust_ddp_scratch`` on real gloo processes: ``mean`` equals ``ddp_scratch``, the process layout does not matter,
and checkpoints carry the worker momentum and the rule's state.

Process-layout identity needs every global worker to see the same samples in both layouts, so those fits feed each
worker its own shard (:class:`lightning_zero.robust.sampling.WorkerBatchSampler`) instead of Lightning's
``DistributedSampler`` (which deals samples to ranks, not workers).
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_zero
from lightning_zero.robust.sampling import WorkerBatchSampler, worker_shards
from tests.helpers.parity import (
    ParityConfig,
    ParityModule,
    fit_lightning,
    make_dataset,
    make_trainer,
    max_abs_diff,
    reference_params,
)
from tests.helpers.probes import LedgerPerBatch
from tests.helpers.workers import free_port, run_workers

TOLERANCE = 1e-5
N_WORKERS = 8
PARITY = ParityConfig(world_size=2, accumulate_grad_batches=3)  # 8 batches per rank: a short last window

# Layout identity: robust rules, simulated attacks, randomness (bucketing, gaussian) and every stateful part.
LAYOUT_CASES = {
    "trimmed_mean+nnm+momentum/sign_flip": dict(
        aggregator="trimmed_mean", f=2, pre_aggregators=["nnm"], worker_momentum=0.9, attack="sign_flip",
        attack_kwargs={"scale": 3.0}, byzantine_workers=[1, 6],
    ),
    "centered_clipping+bucketing/gaussian": dict(
        aggregator="centered_clipping", f=1, aggregator_kwargs={"tau": 0.5}, pre_aggregators=[{"name": "bucketing",
        "s": 2}], worker_momentum=0.5, attack="gaussian", attack_kwargs={"std": 5.0},
    ),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------- mean == ddp_scratch
def _fit_mean_and_ddp_scratch(config: ParityConfig) -> dict:
    out = {"ddp_scratch": fit_lightning(config, "ddp_scratch")}
    for k, sharded in ((1, False), (2, False), (2, True)):
        recorder = LedgerPerBatch()
        strategy = lightning_zero.RobustDDPStrategy(workers_per_rank=k, sharded_aggregation=sharded)
        key = f"k{k}" + ("_sharded" if sharded else "")
        out[f"robust_{key}"] = fit_lightning(config, strategy, callbacks=[recorder])
        out[f"ledger_{key}"] = recorder.batches
    return out


@pytest.mark.timeout(400)
def test_mean_matches_ddp_scratch_and_reference_and_communicates_only_at_boundaries():
    per_rank = run_workers(_fit_mean_and_ddp_scratch, 2, PARITY, timeout=300)
    ours = per_rank[0]
    reference = reference_params(PARITY)
    psi = sum(p.numel() for p in ParityModule().net.parameters())
    for key, k in (("k1", 1), ("k2", 2), ("k2_sharded", 2)):
        assert max_abs_diff(ours[f"robust_{key}"], ours["ddp_scratch"]) <= TOLERANCE
        assert max_abs_diff(ours[f"robust_{key}"], reference) <= TOLERANCE
        assert max_abs_diff(per_rank[1][f"robust_{key}"], ours[f"robust_{key}"]) == 0.0  # replicas stay equal
        for batch_idx, records in enumerate(ours[f"ledger_{key}"]):
            in_epoch = batch_idx % PARITY.batches_per_rank + 1  # the recorder spans both epochs
            boundary = in_epoch % PARITY.accumulate_grad_batches == 0 or in_epoch == PARITY.batches_per_rank
            received = [(op, nbytes) for op, tag, nbytes in records if tag == "worker_grads"]
            if key.endswith("sharded"):  # per local worker: rank 0's ceil(d / 2) columns of both ranks' rows
                expected = [("all_to_all", 4 * 2 * -(-psi // 2))] * k
            else:  # one all-gather of every worker's fp32 gradient
                expected = [("all_gather", 4 * psi * 2 * k)]
            # per optimizer step, nothing in between
            assert received == (expected if boundary else []), (key, batch_idx, records)
            if not boundary:
                assert records == []
    initial = dict(ParityModule().net.state_dict())
    assert max_abs_diff(ours["robust_k1"], initial) > 1e3 * TOLERANCE


# ---------------------------------------------------------------------------- world_size=2 x 4 == world_size=1 x 8
class _WorkerShardModule(ParityModule):
    """The parity MLP fed by per-worker shards, so a global worker sees the same samples in any process layout."""

    def train_dataloader(self) -> DataLoader:
        trainer, k = self.trainer, self.trainer.strategy.workers_per_rank
        dataset = make_dataset(ParityConfig(world_size=1, batch_size=N_WORKERS * 2, batches_per_rank=4))
        shards = worker_shards(len(dataset), N_WORKERS, split="iid", seed=3)
        workers = range(trainer.global_rank * k, (trainer.global_rank + 1) * k)
        return DataLoader(dataset, batch_sampler=WorkerBatchSampler(shards, workers, batch_per_worker=2, seed=5))


def _fit_layout(world_size: int, case: str, ckpt_dir: str) -> dict:
    L.seed_everything(0, verbose=False)
    module = _WorkerShardModule()
    strategy = lightning_zero.RobustDDPStrategy(workers_per_rank=N_WORKERS // world_size, **LAYOUT_CASES[case])
    config = ParityConfig(world_size=world_size, accumulate_grad_batches=2, max_epochs=2, gradient_clip_val=None)
    trainer = make_trainer(config, strategy, use_distributed_sampler=False)
    trainer.fit(module)
    path = os.path.join(ckpt_dir, f"ws{world_size}.ckpt")
    trainer.save_checkpoint(path)
    net = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    return {"net": net, "steps": trainer.global_step, "selected": strategy.last_result.byzantine_selected}


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "case", [pytest.param(name, marks=pytest.mark.slow) if i else name for i, name in enumerate(LAYOUT_CASES)]
)  # the second case in the slow run (CI runs both)
def test_two_ranks_of_four_workers_equal_one_rank_of_eight(case, tmp_path):
    two = run_workers(_fit_layout, 2, 2, case, str(tmp_path), timeout=300)
    one = run_workers(_fit_layout, 1, 1, case, str(tmp_path), timeout=300)
    assert two[0]["steps"] == one[0]["steps"] == 4  # 2 epochs of 4 batches, 2 per window
    # Identical up to float rounding: the same per-worker gradients and the same rule on the same stack (measured:
    # parameters bit-identical or within 1e-7, momentum rows within one float32 ulp).
    assert max_abs_diff(two[0]["net"], one[0]["net"]) <= 1e-7
    assert max_abs_diff(two[1]["net"], two[0]["net"]) == 0.0  # the two ranks of one run agree exactly
    initial = dict(ParityModule().net.state_dict())
    assert max_abs_diff(one[0]["net"], initial) > 1e-3
    # The checkpoint holds all 8 workers' momentum rows (gathered from both ranks) and the rule's state, whatever
    # the layout.
    saved = [torch.load(tmp_path / f"ws{ws}.ckpt", weights_only=False)["robust_aggregation"] for ws in (2, 1)]
    assert saved[0]["num_workers"] == saved[1]["num_workers"] == N_WORKERS
    assert saved[0]["worker_momentum"].shape == (N_WORKERS, sum(v.numel() for v in initial.values()))
    torch.testing.assert_close(saved[0]["worker_momentum"], saved[1]["worker_momentum"], rtol=1e-6, atol=1e-7)
    assert saved[0]["worker_momentum"].abs().sum() > 0
    assert torch.equal(saved[0]["generator"], saved[1]["generator"])  # the same random draws in both layouts
    if saved[0]["center"] is not None:
        torch.testing.assert_close(saved[0]["center"], saved[1]["center"], rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------- sharded aggregation: the same fit, checkpoints move
def _fit_mode(world_size: int, tmp: str, mode: dict, epochs: int, resume: str | None = None, save: str | None = None):
    L.seed_everything(0, verbose=False)
    module = _WorkerShardModule()
    case = LAYOUT_CASES["centered_clipping+bucketing/gaussian"]  # momentum rows, a centre and a generator
    strategy = lightning_zero.RobustDDPStrategy(workers_per_rank=N_WORKERS // world_size, **mode, **case)
    config = ParityConfig(world_size=world_size, accumulate_grad_batches=2, max_epochs=epochs, gradient_clip_val=None)
    trainer = make_trainer(config, strategy, use_distributed_sampler=False, default_root_dir=tmp)
    trainer.fit(module, ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


SHARDED = {"sharded_aggregation": True}


def _two_rank_fits(tmp: str) -> dict:
    half = os.path.join(tmp, "sharded_half.ckpt")
    return {
        "unsharded": _fit_mode(2, tmp, {}, epochs=2),
        "sharded": _fit_mode(2, tmp, SHARDED, epochs=2),
        "replicated": _fit_mode(2, tmp, {**SHARDED, "aggregation_replicas": 2}, epochs=2),
        "half": _fit_mode(2, tmp, SHARDED, epochs=1, save=half),
        "sharded_resumed": _fit_mode(2, tmp, SHARDED, epochs=2, resume=half),
        "unsharded_resumed": _fit_mode(2, tmp, {}, epochs=2, resume=half),
    }


@pytest.mark.timeout(400)
def test_sharded_aggregation_trains_as_unsharded_and_its_checkpoints_move_between_modes_and_world_sizes(tmp_path):
    two = run_workers(_two_rank_fits, 2, str(tmp_path), timeout=300)[0]
    one = run_workers(_fit_mode, 1, 1, str(tmp_path), {}, 2, str(tmp_path / "sharded_half.ckpt"), timeout=300)[0]
    initial = dict(ParityModule().net.state_dict())
    assert max_abs_diff(two["sharded"], initial) > 1e-3
    assert max_abs_diff(two["sharded"], two["unsharded"]) <= 1e-6  # the same fit up to the order of float sums
    assert max_abs_diff(two["replicated"], two["sharded"]) == 0.0  # round 0 is the sharded mode
    assert max_abs_diff(two["sharded_resumed"], two["sharded"]) == 0.0  # resume is bit-identical
    # the sharded checkpoint resumed unsharded, on 2 ranks and on 1 rank of 8 workers
    assert max_abs_diff(two["unsharded_resumed"], two["sharded"]) <= 1e-6
    assert max_abs_diff(one, two["sharded"]) <= 1e-6
    assert max_abs_diff(two["half"], two["sharded"]) > 1e-4  # the resumed half mattered


# ------------------------------------------------------------------------------------------------ resume, in process
def _fit_in_process(tmp_path: Path, epochs: int, ckpt_path: Path | None = None, save: Path | None = None) -> dict:
    """One rank of 8 workers; ``centered_clipping`` with bucketing, momentum and a gaussian attack: every piece of
    robust state (momentum rows, the rule's centre, the generator) matters."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    L.seed_everything(0, verbose=False)
    module = _WorkerShardModule()
    case = LAYOUT_CASES["centered_clipping+bucketing/gaussian"]
    strategy = lightning_zero.RobustDDPStrategy(workers_per_rank=N_WORKERS, **case)
    config = ParityConfig(world_size=1, gradient_clip_val=None, max_epochs=epochs)
    trainer = make_trainer(config, strategy, use_distributed_sampler=False, default_root_dir=tmp_path)
    trainer.fit(module, ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    torch.distributed.destroy_process_group()
    return {"net": dict(module.net.state_dict()), "steps": trainer.global_step}


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    straight = _fit_in_process(tmp_path, epochs=2)
    half = tmp_path / "half.ckpt"
    assert _fit_in_process(tmp_path, epochs=1, save=half)["steps"] == 3  # 63 samples: 7 per shard, 3 batches of 2
    resumed = _fit_in_process(tmp_path, epochs=2, ckpt_path=half)
    assert resumed["steps"] == straight["steps"] == 6
    assert max_abs_diff(resumed["net"], straight["net"]) == 0.0
    # without the momentum rows, the rule's centre and the generator it is not the same run
    ckpt = torch.load(half, weights_only=False)
    del ckpt["robust_aggregation"]
    torch.save(ckpt, tmp_path / "stateless.ckpt")
    stateless = _fit_in_process(tmp_path, epochs=2, ckpt_path=tmp_path / "stateless.ckpt")
    assert max_abs_diff(stateless["net"], straight["net"]) > 1e-6


# ------------------------------------------------------------------------------------------------ bad input, names
@pytest.mark.parametrize(
    ("kwargs", "devices", "message"),
    [
        (dict(aggregator="krum", f=2, workers_per_rank=2), 2, r"aggregator='krum' with n=4, f=2 is invalid"),
        (dict(aggregator="bulyan", f=2, workers_per_rank=4), 2, r"n=8, f=2 is invalid: Bulyan needs n >= 4f\+3 = 11"),
        (dict(aggregator="median", f=1, pre_aggregators=[{"name": "bucketing", "s": 2}]), 2, r"n=1, f=1"),
        (dict(aggregator="multi_krum", f=1, aggregator_kwargs={"m": 6}, workers_per_rank=3), 2, "m=6"),
    ],
)
def test_invalid_n_f_rule_fails_when_the_trainer_is_built(kwargs, devices, message):
    strategy = lightning_zero.RobustDDPStrategy(**kwargs)
    with pytest.raises(ValueError, match=message):
        L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False)
    assert not torch.distributed.is_initialized()  # nothing started


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(aggregator="kurm"), r"aggregator='kurm' is invalid: expected one of \["),
        (dict(aggregator="median", aggregator_kwargs={"m": 3}), r"unknown parameters \['m'\]"),
        (dict(pre_aggregators=["nmm"]), "pre_aggregator='nmm' is invalid"),
        (dict(attack="sign-flip", f=1), "attack='sign-flip' is invalid"),
        (dict(workers_per_rank=0), "workers_per_rank=0 is invalid"),
        (dict(worker_momentum=1.0), r"worker_momentum=1.0 is invalid: expected a number in \[0, 1\)"),
        (dict(f=-1), "f=-1 is invalid"),
    ],
)
def test_bad_settings_fail_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lightning_zero.RobustDDPStrategy(**kwargs)


def test_names_are_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["robust_ddp_scratch"]["strategy"] is lightning_zero.RobustDDPStrategy
    assert StrategyRegistry["robust_ddp_scratch_spawn"]["init_params"] == {"start_method": "spawn"}
