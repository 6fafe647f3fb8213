"""``robust_ddp_scratch`` with ``byzantine_ranks=1`` on 4 real gloo processes: without a faulty rank it trains as the
sharded aggregation of the same rule; a rank that lies is outvoted or left out, and every honest rank ends on the
same weights."""

from __future__ import annotations

import dataclasses
import os

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_zero
from lightning_zero.byzantine.audit import ByzantineAudit, read, summarize
from lightning_zero.byzantine.behaviours import alie_rows
from lightning_zero.byzantine.exchange import CRASH_EXIT
from tests.helpers.parity import ParityConfig, ParityModule, fit_lightning, make_trainer, max_abs_diff, train_loader
from tests.helpers.workers import run_workers

pytest.importorskip("cryptography")
CONFIG = ParityConfig(world_size=4, batches_per_rank=4, max_epochs=1, gradient_clip_val=None)
RULE = dict(aggregator="centered_clipping", f=1, aggregator_kwargs={"tau": 0.5}, worker_momentum=0.5)


def _fits(modes: dict[str, dict], config: ParityConfig = CONFIG, audit_dir: str | None = None) -> dict:
    """Each mode's fit; with ``audit_dir``, every rank audits every step into ``<audit_dir>/<mode>``."""
    out = {}
    for name, mode in modes.items():
        strategy = lightning_zero.RobustDDPStrategy(**RULE, **mode)
        audit = [] if audit_dir is None else [ByzantineAudit(os.path.join(audit_dir, name))]
        out[name] = fit_lightning(config, strategy, callbacks=audit)
        exchange = strategy.robust_engine.exchange
        out[f"{name}/outcome"] = getattr(exchange, "metrics", dict)()
        evictions = getattr(exchange, "evictions", [])
        out[f"{name}/evictions"] = [step for step, rank, _ in evictions if rank == 3]
        out[f"{name}/evicted"] = sorted({rank for _, rank, _ in evictions})
    return out


BYZANTINE = {"byzantine_ranks": 1, "byzantine_timeout": 20.0}


@pytest.mark.timeout(600)
def test_without_faults_it_trains_as_sharded_aggregation_and_a_wrong_aggregate_is_outvoted_then_evicted():
    one_step = ParityConfig(world_size=4, batches_per_rank=1, max_epochs=1, gradient_clip_val=None)
    modes = {
        "sharded": {"sharded_aggregation": True},
        "byzantine": BYZANTINE,
        "wrong_aggregate": {**BYZANTINE, "byzantine_rank_behaviour": "wrong_aggregate"},  # rank 3 lies
    }
    ranks = run_workers(_fits, 4, modes, timeout=500)
    first_steps = run_workers(_fits, 4, {k: modes[k] for k in ("byzantine", "wrong_aggregate")}, one_step)
    for r, first in zip(ranks, first_steps):
        assert max_abs_diff(r["byzantine"], r["sharded"]) <= 1e-6  # the same fit up to the order of float sums
        assert max_abs_diff(r["byzantine"], ranks[0]["byzantine"]) == 0.0
        # step 0: rank 3's zeroed shard results are outvoted by f + 1 = 2 honest ones, the same bits as no fault
        assert max_abs_diff(first["wrong_aggregate"], first["byzantine"]) == 0.0
    for r in ranks[:3]:
        assert max_abs_diff(r["wrong_aggregate"], ranks[0]["wrong_aggregate"]) == 0.0
        assert r["wrong_aggregate/evictions"] == [1]  # proven in step 0's results, spread and decided in step 1
    assert all(r["byzantine/outcome"]["byzantine/proofs"] == 0.0 for r in ranks)


@pytest.mark.parametrize(
    ("kwargs", "devices", "message"),
    [
        ({"byzantine_ranks": 1}, 3, r"byzantine_ranks=1 needs at least 3f \+ 1 = 4 processes, got 3"),
        ({"byzantine_ranks": 2}, 4, r"byzantine_ranks=2 needs at least 3f \+ 1 = 7 processes, got 4"),
        ({"byzantine_ranks": 1, "aggregator": "mean"}, 4, r"byzantine_ranks needs a robust rule"),
        (
            {"byzantine_ranks": 1, "sharded_aggregation": True, "aggregation_replicas": 2},
            4,
            r"aggregation_replicas=2 with byzantine_ranks=1: .* 2f \+ 1 = 3 ranks itself",
        ),
        ({"byzantine_ranks": 1, "byzantine_timeout": 0}, 4, r"byzantine_timeout=0 is invalid"),
        ({"byzantine_ranks": 1, "byzantine_rank_behaviour": "lie"}, 4, r"byzantine_rank_behaviour='lie' is invalid"),
        ({"byzantine_rank_behaviour": "silent"}, 4, r"byzantine_rank_behaviour='silent' needs byzantine_ranks >= 1"),
        ({"byzantine_ranks": 1, "byzantine_behaving_ranks": [4]}, 4, r"byzantine_behaving_ranks=\[4\] is invalid"),
        (
            {"byzantine_ranks": 1, "byzantine_rank_behaviour": "alie"},
            4,
            r"'alie' with 1 behaving rank\(s\) x workers_per_rank=1: the colluders need at least 2 rows",
        ),
    ],
)
def test_bad_settings_are_refused_when_the_trainer_is_built(kwargs, devices, message):
    kwargs = {"aggregator": "median", **kwargs}
    with pytest.raises(ValueError, match=message):
        L.Trainer(accelerator="cpu", devices=devices, strategy=lightning_zero.RobustDDPStrategy(**kwargs))


def test_the_byzantine_mode_launches_without_lightnings_child_process_observer():
    """Lightning's observer SIGKILLs every rank when one exits non-zero: the mode's own launcher does not start it."""
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    from lightning_zero.byzantine.launcher import TrainerLauncher

    def launcher(**kwargs):
        strategy = lightning_zero.RobustDDPStrategy("median", f=1, **kwargs)
        return L.Trainer(accelerator="cpu", devices=4, strategy=strategy).strategy.launcher

    assert type(launcher(byzantine_ranks=1)) is TrainerLauncher
    assert type(launcher()) is _SubprocessScriptLauncher


def test_robust_zero_refuses_byzantine_ranks():
    with pytest.raises(ValueError, match=r"byzantine_ranks=1 is not supported by robust_zero2_scratch yet"):
        lightning_zero.RobustZeroStrategy(stage=2, aggregator="median", byzantine_ranks=1)


@pytest.mark.timeout(600)
def test_an_equivocating_or_silent_rank_is_evicted_and_the_honest_ranks_train_on_identical(tmp_path):
    modes = {
        "byzantine": BYZANTINE,
        "equivocate": {**BYZANTINE, "byzantine_rank_behaviour": "equivocate"},
        "silent": {**BYZANTINE, "byzantine_timeout": 2.0, "byzantine_rank_behaviour": "silent"},
    }
    ranks = run_workers(_fits, 4, modes, CONFIG, str(tmp_path), timeout=500)
    honest = ranks[:3]
    for name, evicted_after in (("equivocate", 0), ("silent", 1)):  # proven at once; left out f + 1 = 2 steps
        audit = summarize(read(tmp_path / name), faulty=[3], world_size=4)  # every step, not only the last
        assert audit["safe"] and audit["steps"] == CONFIG.optimizer_steps, (name, audit)
        assert audit["honest_evicted"] == [] and audit["faulty_evicted"] == {3: evicted_after}, (name, audit)
        assert audit["evicted_by_all"] == {3: True}, (name, audit)
        for r in honest:
            assert max_abs_diff(r[name], honest[0][name]) == 0.0, name  # safety: one model among the honest
            assert r[f"{name}/outcome"]["byzantine/members"] == 3.0, name  # the last step: rank 3 is out
            assert r[f"{name}/outcome"]["byzantine/left_out"] == 0.0, name
            assert r[f"{name}/evictions"] == [evicted_after], name
        assert max_abs_diff(honest[0][name], honest[0]["byzantine"]) > 1e-4, name  # rank 3's rows were not used
    assert ranks[3]["equivocate/outcome"] == {}  # the evicted rank takes no part any more


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_straggler_inside_the_timeout_trains_as_no_fault_and_one_past_it_is_evicted():
    """Rank 3's first message of every step 0.8 timeouts late: waited for, the fault-free fit bit for bit. 1.25
    timeouts late: left out of steps 0 and 1, evicted after step 1, the honest ranks on one model."""
    slow = {**BYZANTINE, "byzantine_timeout": 2.0}
    modes = {name: {**slow, "byzantine_rank_behaviour": name} for name in ("slow_under", "slow_over")}
    ranks = run_workers(_fits, 4, {"byzantine": BYZANTINE, **modes}, timeout=500)
    for r in ranks[:3]:
        assert max_abs_diff(r["slow_under"], r["byzantine"]) == 0.0
        assert r["slow_under/evictions"] == [] and r["slow_over/evictions"] == [1]
        assert max_abs_diff(r["slow_over"], ranks[0]["slow_over"]) == 0.0
        assert r["slow_over/outcome"]["byzantine/members"] == 3.0


class _Logged(ParityModule):
    """A BatchNorm MLP (rank 0's buffers broadcast before every forward, as torch DDP does) that logs its loss
    reduced over the ranks (``sync_dist=True``: Lightning's reduce) each step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
        )
        self.val_mse = torchmetrics.MeanSquaredError()  # its states synced across the ranks by compute()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss, sync_dist=True, on_step=True, batch_size=1)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_mse(self.net(x), y)
        self.log("val_mse", self.val_mse)


def _fit_through_a_crash(tmp: str) -> dict:
    config = ParityConfig(world_size=4, batches_per_rank=4, max_epochs=1, gradient_clip_val=None)
    mode = {**BYZANTINE, "byzantine_timeout": 2.0, "byzantine_rank_behaviour": "crash"}
    strategy = lightning_zero.RobustDDPStrategy(**RULE, **mode)
    L.seed_everything(config.seed, verbose=False)
    module = _Logged(config.lr, config.optimizer)
    every_step = ModelCheckpoint(dirpath=tmp, every_n_train_steps=1, save_top_k=-1)  # barriers, broadcasts, votes
    trainer = make_trainer(config, strategy, enable_checkpointing=True, callbacks=[every_step])
    trainer.fit(module, train_loader(config))
    weights = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    loss = trainer.callback_metrics["loss"].clone()
    validated = trainer.validate(module, train_loader(config), verbose=False)  # after the fit, rank 3 still gone
    buffers = {k: v.detach().clone() for k, v in module.net.named_buffers()}  # rank 0's, broadcast for validate
    exchange = strategy.robust_engine.exchange
    return {
        "weights": weights,
        "buffers": buffers,
        "val_mse": validated[0]["val_mse"],
        "steps": trainer.global_step,
        "loss": loss,
        "evictions": [(step, rank) for step, rank, _ in exchange.evictions],
        "members": exchange.metrics()["byzantine/members"],
        "saved": sorted(os.listdir(tmp)),
    }


@pytest.mark.timeout(600)
def test_a_crashed_rank_is_evicted_and_the_honest_ranks_finish_the_fit_on_one_model(tmp_path):
    """Rank 3's process exits at step 1 (``crash``), in the middle of Lightning's collectives (the loss logged with
    ``sync_dist``, a checkpoint every step, rank 0's BatchNorm buffers before every forward): they go on over the
    signed transport without it ([Note: tolerant collectives]); the step protocol leaves rank 3 out of steps 1 and 2
    and evicts it after step 2. The honest ranks' buffers are rank 0's, bit for bit. A ``validate`` after the fit,
    whose torchmetrics state is gathered from every rank, goes on without rank 3 too."""
    ranks = run_workers(_fit_through_a_crash, 4, str(tmp_path), timeout=500, dies=[3])
    assert ranks[3] == CRASH_EXIT
    for r in ranks[:3]:
        assert r["steps"] == 4 and r["evictions"] == [(2, 3)] and r["members"] == 3.0
        params = {k: v for k, v in r["weights"].items() if k not in r["buffers"]}
        assert max_abs_diff(params, {k: ranks[0]["weights"][k] for k in params}) == 0.0
        # After a training forward each rank's BatchNorm statistics hold its own batch, as under torch DDP; the
        # validation's first forward broadcast rank 0's, over the signed transport.
        assert max_abs_diff(r["buffers"], ranks[0]["buffers"]) == 0.0
        assert torch.equal(r["loss"], ranks[0]["loss"])  # reduced over the same ranks everywhere
    assert ranks[0]["buffers"]["1.num_batches_tracked"].item() == 4  # buffers of every step's forward
    assert len({r["val_mse"] for r in ranks[:3]}) == 1  # the metric's states gathered from the same ranks
    assert ranks[0]["saved"] == [f"epoch=0-step={s}.ckpt" for s in range(1, 5)]


def _fit_and_resume(tmp: str) -> dict:
    """Two epochs with rank 3 equivocating: straight through, and one epoch saved then resumed for the second."""
    two = ParityConfig(world_size=4, batches_per_rank=2, max_epochs=2, gradient_clip_val=None)
    mode = {**RULE, **BYZANTINE, "byzantine_rank_behaviour": "equivocate"}
    out = {"straight": fit_lightning(two, lightning_zero.RobustDDPStrategy(**mode))}
    path = os.path.join(tmp, "half.ckpt")
    L.seed_everything(two.seed, verbose=False)
    module = ParityModule(two.lr, two.optimizer)
    trainer = make_trainer(dataclasses.replace(two, max_epochs=1), lightning_zero.RobustDDPStrategy(**mode))
    trainer.fit(module, train_loader(two))
    trainer.save_checkpoint(path)
    L.seed_everything(two.seed, verbose=False)
    module = ParityModule(two.lr, two.optimizer)
    strategy = lightning_zero.RobustDDPStrategy(**mode)
    make_trainer(two, strategy).fit(module, train_loader(two), ckpt_path=path)
    out["resumed"] = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    out["resumed/first_step"] = strategy.robust_engine.exchange.evictions
    out["saved"] = torch.load(path, weights_only=False)["robust_aggregation"]["byzantine"]
    return out


@pytest.mark.timeout(600)
def test_a_resume_keeps_the_evicted_rank_out_and_trains_bit_identically(tmp_path):
    ranks = run_workers(_fit_and_resume, 4, str(tmp_path), timeout=500)
    for r in ranks[:3]:
        assert max_abs_diff(r["resumed"], r["straight"]) == 0.0
        assert r["resumed/first_step"] == [(0, 3, "proof: equivocation")]  # carried over, not found again
    saved = ranks[0]["saved"]
    assert saved["protocol"]["members"] == [0, 1, 2] and saved["protocol"]["f"] == 0 and saved["step"] == 2


@pytest.mark.timeout(600)
def test_colluding_alie_ranks_bend_the_update_but_are_never_evicted_and_the_honest_stay_identical():
    """Rank 3 commits to ``mean - z std`` of its two workers' rows, a value no proof can catch: the rule bounds it."""
    two = {**BYZANTINE, "workers_per_rank": 2}
    ranks = run_workers(_fits, 4, {"byzantine": two, "alie": {**two, "byzantine_rank_behaviour": "alie"}}, timeout=500)
    honest = ranks[:3]
    for r in honest:
        assert max_abs_diff(r["alie"], honest[0]["alie"]) == 0.0  # safety
        assert r["alie/evictions"] == [] and r["alie/outcome"]["byzantine/members"] == 4.0
        assert r["alie/outcome"]["byzantine/proofs"] == 0.0
    assert max_abs_diff(honest[0]["alie"], honest[0]["byzantine"]) > 1e-6  # rank 3's rows did change the update


def _colluding_fits(config: ParityConfig) -> dict:
    """A fault-free fit and one where ranks 5 and 6 (f = 2) collude in alie; a colluder records, every step, the rows
    its workers computed and the rows it committed to."""
    from lightning_zero.byzantine.exchange import ByzantineExchange

    collude, seen = ByzantineExchange._collude, []

    def recorded(self, rows):
        committed = collude(self, rows)
        seen.append((rows.clone(), committed.clone()))
        return committed

    ByzantineExchange._collude = recorded
    f2 = {"byzantine_ranks": 2, "byzantine_timeout": 60.0}
    out = _fits({"byzantine": f2, "alie": {**f2, "byzantine_rank_behaviour": "alie"}}, config)
    out["collusion"] = seen
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_colluders_pool_their_rows_through_the_store_and_commit_the_same_alie_row():
    """7 processes, f = 2: ranks 5 and 6 each hold one worker's rows, so alie needs the other's through the store."""
    config = dataclasses.replace(CONFIG, world_size=7, batches_per_rank=2)
    ranks = run_workers(_colluding_fits, 7, config, timeout=800)
    honest, (five, six) = ranks[:5], ranks[5:]
    for r in honest:
        assert max_abs_diff(r["alie"], honest[0]["alie"]) == 0.0  # safety
        assert r["alie/evicted"] == [] and r["alie/outcome"]["byzantine/members"] == 7.0
        assert r["alie/outcome"]["byzantine/proofs"] == 0.0 and r["collusion"] == []
    assert max_abs_diff(honest[0]["alie"], honest[0]["byzantine"]) > 1e-6
    assert len(five["collusion"]) == len(six["collusion"]) == config.optimizer_steps
    for (rows5, sent5), (rows6, sent6) in zip(five["collusion"], six["collusion"]):
        assert not torch.equal(rows5, rows6)  # two different honest rows were pooled
        assert torch.equal(sent5, sent6)  # the same pool in the same order: the same bits
        assert torch.equal(sent5, alie_rows(torch.cat([rows5, rows6]), 1))
