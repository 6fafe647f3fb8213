"""End to end: the digits MLP with n = 8 workers (one process, ``workers_per_rank=8``; the process layout does not
change results, ``test_robust.py`` shows), f = 2, IID shards. Relations only, no absolute accuracies:

- without attack every rule lands within 3 points of ``mean``;
- under sign flip (scale 4) and IPM (eps 10) ``mean`` collapses to chance while median, trimmed mean, Krum, geometric
  median and centered clipping stay within 5 points of their clean accuracy; Krum never selects a Byzantine vector.
"""

from __future__ import annotations

import os
from functools import partial

import lightning as L
import pytest
import torch

import lightning_zero
from lightning_zero.demo.digits import DigitsDataModule, DigitsMLPModule
from tests.helpers.workers import free_port, run_workers

pytest.importorskip("sklearn")

STEPS = 150
CHANCE = 0.1  # 10 classes
RULES = {
    "mean": {},
    "median": {},
    "trimmed_mean": {},
    "krum": {},
    "multi_krum": {},
    "geometric_median": {},
    "centered_clipping": {"tau": 0.5},  # tau is on the scale of gradient deviations (here ~1): 10 lets IPM through
}
ROBUST = ["median", "trimmed_mean", "krum", "geometric_median", "centered_clipping"]
ATTACKS = {"sign_flip": {"scale": 4.0}, "ipm": {"eps": 10.0}}


def _fit(
    rule: str, attack: str | None = None, devices: int = 1, **mode
) -> tuple[float, lightning_zero.RobustDDPStrategy]:
    """Validation accuracy after ``STEPS`` steps of n = 8 workers on ``devices`` processes; the strategy for its last
    aggregation result. ``mode``: ``sharded_aggregation``."""
    L.seed_everything(0, verbose=False)
    data = DigitsDataModule(batch_size=128 // devices, worker_split="iid")  # 16 samples per worker and step
    model = DigitsMLPModule(hidden_sizes=(64,), dropout=0.0, optimizer=partial(torch.optim.AdamW, lr=3e-3))
    strategy = lightning_zero.RobustDDPStrategy(
        rule, f=2, aggregator_kwargs=RULES[rule], workers_per_rank=8 // devices, attack=attack,
        attack_kwargs=ATTACKS.get(attack), **mode,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, max_epochs=-1,
        val_check_interval=STEPS, check_val_every_n_epoch=None, num_sanity_val_steps=0, use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, data)
    return float(trainer.callback_metrics["val/acc"]), strategy


# 18 fits of the digits MLP (~90 s): in the slow run (CI runs it too); tests/strategies/test_robust.py keeps the
# strategy's multi-process tests in the default run.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def accuracies() -> dict:
    saved = dict(os.environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {(rule, None): _fit(rule) for rule in RULES}
        out.update({(rule, a): _fit(rule, a) for rule in ["mean", *ROBUST] for a in ATTACKS})
        return out
    finally:
        torch.set_num_threads(threads)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def test_every_rule_is_within_three_points_of_mean_without_attack(accuracies):
    mean = accuracies[("mean", None)][0]
    assert mean > 5 * CHANCE  # it learned: the comparison means something
    for rule in RULES:
        assert accuracies[(rule, None)][0] >= mean - 0.03, (rule, accuracies[(rule, None)][0], mean)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_mean_collapses_and_robust_rules_hold_under_attack(accuracies, attack):
    mean_acc = accuracies[("mean", attack)][0]
    assert mean_acc <= 2 * CHANCE
    for rule in ROBUST:
        clean, attacked = accuracies[(rule, None)][0], accuracies[(rule, attack)][0]
        assert attacked >= clean - 0.05, (rule, attack, clean, attacked)
    assert accuracies[("krum", attack)][1].last_result.byzantine_selected == 0.0


# ------------------------------------------------------------------ sharded aggregation: the same accuracies, 2 ranks
SHARDED_CASES = [("median", "sign_flip"), ("krum", "ipm"), ("centered_clipping", "sign_flip"), ("trimmed_mean", None)]


def _accuracies_by_mode(_: int) -> dict:
    out = {}
    for rule, attack in SHARDED_CASES:
        out[(rule, attack, "unsharded")] = _fit(rule, attack, devices=2)[0]
        out[(rule, attack, "sharded")] = _fit(rule, attack, devices=2, sharded_aggregation=True)[0]
    return out


def test_sharded_aggregation_gives_the_same_digits_accuracies():
    accuracies = run_workers(_accuracies_by_mode, 2, 0, timeout=600)[0]
    for rule, attack in SHARDED_CASES:
        unsharded, sharded = (accuracies[(rule, attack, mode)] for mode in ("unsharded", "sharded"))
        assert unsharded > 5 * CHANCE, (rule, attack, unsharded)
        # the same aggregates up to the order of float sums: at most one of the 270 validation digits differs
        assert abs(sharded - unsharded) <= 1 / 270 + 1e-9, (rule, attack, unsharded, sharded)
