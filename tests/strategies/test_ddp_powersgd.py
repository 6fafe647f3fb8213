"""``ddp_scratch`` with ``grad_compression="powersgd"`` under the Trainer, on 2 gloo processes: it trains, the ranks
agree, compression changes the run after ``start_iter``, a resume is bit-identical, accumulation stays silent; and the
strategy's arguments are checked before any process starts."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.distributed as dist

import lightning_zero
from lightning_zero.comm.powersgd import CHECKPOINT_KEY
from tests.helpers.parity import ParityConfig, ParityModule, make_trainer, train_loader
from tests.helpers.probes import LedgerPerBatch
from tests.helpers.workers import run_workers

WORLD = 2
CONFIG = ParityConfig(world_size=WORLD, batches_per_rank=2)  # 2 optimizer steps per epoch
EPOCHS = 4
SMALL_BUCKET_MB = 512 / 2**20  # the parity net (467 parameters) spans several buckets
POWERSGD = {"rank": 1, "start_iter": 2}


class _LossModule(ParityModule):
    def __init__(self) -> None:
        super().__init__(CONFIG.lr)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


def _strategy(
    compress: bool = True, find_unused_parameters: bool = False, **powersgd
) -> lightning_zero.ScratchDDPStrategy:
    if not compress:
        return lightning_zero.ScratchDDPStrategy(bucket_size_mb=SMALL_BUCKET_MB)
    return lightning_zero.ScratchDDPStrategy(
        bucket_size_mb=SMALL_BUCKET_MB,
        grad_compression="powersgd",
        powersgd={**POWERSGD, **powersgd},
        find_unused_parameters=find_unused_parameters,
    )


def _fit(strategy, epochs: int, resume: str | None = None, save: str | None = None, **trainer_kwargs) -> dict:
    L.seed_everything(CONFIG.seed, verbose=False)
    module = _LossModule()
    trainer = make_trainer(CONFIG, strategy, max_epochs=epochs, **trainer_kwargs)
    trainer.fit(module, train_loader(CONFIG), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    compressor = trainer.strategy._engine.compressor
    return {
        "weights": {k: v.detach().clone() for k, v in module.net.state_dict().items()},
        "losses": module.losses,
        "iteration": compressor.iteration if compressor is not None else None,
        "steps": trainer.global_step,
    }


def _fits(directory: str) -> dict:
    out = {"compressed": _fit(_strategy(), EPOCHS), "plain": _fit(_strategy(compress=False), EPOCHS)}
    half = f"{directory}/half.ckpt"
    out["first_half"] = _fit(_strategy(), EPOCHS // 2, save=half)
    out["resumed"] = _fit(_strategy(), EPOCHS, resume=half)
    stateless = f"{directory}/stateless.ckpt"
    if dist.get_rank() == 0:
        checkpoint = torch.load(half, weights_only=True)
        out["saved_keys"] = sorted(checkpoint)
        out["saved_state"] = checkpoint[CHECKPOINT_KEY]
        del checkpoint[CHECKPOINT_KEY]
        torch.save(checkpoint, stateless)
    dist.barrier()
    out["resumed_stateless"] = _fit(_strategy(), EPOCHS, resume=stateless)
    # find_unused_parameters: no rebuild (as torch), so the checkpoint names no bucket order and the resume keeps the
    # first layout its memories belong to
    unused = f"{directory}/unused.ckpt"
    out["unused_straight"] = _fit(_strategy(find_unused_parameters=True), EPOCHS)
    _fit(_strategy(find_unused_parameters=True), EPOCHS // 2, save=unused)
    out["unused_resumed"] = _fit(_strategy(find_unused_parameters=True), EPOCHS, resume=unused)
    out["unused_order"] = torch.load(unused, weights_only=True)[CHECKPOINT_KEY]["bucket_order"]
    recorder = LedgerPerBatch()
    out["accumulated"] = _fit(_strategy(start_iter=1), 2, accumulate_grad_batches=2, callbacks=[recorder])
    out["accumulated"]["batches"] = recorder.batches
    return out


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    return run_workers(_fits, WORLD, str(tmp_path_factory.mktemp("powersgd")), timeout=300)


@pytest.mark.timeout(360)
def test_trains_the_same_weights_on_every_rank_and_differs_from_plain_after_start_iter(fits):
    steps = CONFIG.batches_per_rank * EPOCHS
    for rank_fits in fits:
        compressed, plain = rank_fits["compressed"], rank_fits["plain"]
        assert compressed["steps"] == steps and compressed["iteration"] == steps
        assert all(math.isfinite(loss) for loss in compressed["losses"])
        start = POWERSGD["start_iter"]
        # the losses of the first start_iter + 1 steps are computed before any compressed update is applied
        assert compressed["losses"][: start + 1] == plain["losses"][: start + 1]
        assert compressed["losses"][start + 1 :] != plain["losses"][start + 1 :]
        assert any(not torch.equal(compressed["weights"][k], plain["weights"][k]) for k in plain["weights"])
    for key, value in fits[0]["compressed"]["weights"].items():
        assert torch.equal(value, fits[1]["compressed"]["weights"][key]), key


@pytest.mark.timeout(360)
def test_resume_is_bit_identical_and_the_checkpoint_carries_every_rank(fits):
    for rank_fits in fits:
        straight, resumed = rank_fits["compressed"], rank_fits["resumed"]
        assert resumed["iteration"] == straight["iteration"]
        for key, value in straight["weights"].items():
            assert torch.equal(value, resumed["weights"][key]), key
    state = fits[0]["saved_state"]
    assert state["bucket_order"] is not None  # the rebuilt layout the memories belong to ([Note: bucket rebuild])
    assert CHECKPOINT_KEY in fits[0]["saved_keys"]
    assert state["world_size"] == WORLD and state["iteration"] == CONFIG.batches_per_rank * EPOCHS // 2
    errors = [entry["error"] for entry in state["buckets"].values()]
    assert errors and all(e.shape[0] == WORLD for e in errors)
    assert any(not torch.equal(e[0], e[1]) for e in errors)  # error feedback is each rank's own


@pytest.mark.timeout(360)
def test_a_checkpoint_without_compressor_state_resumes_with_a_fresh_compressor(fits):
    for rank_fits in fits:
        stateless = rank_fits["resumed_stateless"]
        assert stateless["iteration"] == CONFIG.batches_per_rank * EPOCHS // 2  # counted from 0 at the resume
        assert all(math.isfinite(loss) for loss in stateless["losses"])
        assert any(
            not torch.equal(stateless["weights"][k], rank_fits["resumed"]["weights"][k]) for k in stateless["weights"]
        )


@pytest.mark.timeout(360)
def test_accumulation_is_silent_and_counts_one_iteration_per_optimizer_step(fits):
    for rank_fits in fits:
        accumulated = rank_fits["accumulated"]
        batches = accumulated["batches"]
        assert accumulated["steps"] == accumulated["iteration"] == 2
        assert batches[0] == [] and batches[2] == []  # the non-boundary micro-batches
        assert {tag for _, tag, _ in batches[1]} >= {"grads"}  # step 0: plain (start_iter=1)
        assert not any("powersgd" in tag for _, tag, _ in batches[1])
        compressed_tags = {tag for _, tag, _ in batches[3] if tag.startswith("grads")}
        assert "grads_powersgd_p" in compressed_tags and "grads" not in compressed_tags


# ------------------------------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize("cls", [lightning_zero.ScratchDDPStrategy, lightning_zero.fabric.ScratchDDPStrategy])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grad_compression": "zip"}, r"grad_compression='zip' is invalid: expected None or one of \('powersgd',\)"),
        ({"powersgd": {"rank": 2}}, r"powersgd=\{'rank': 2\} is set but grad_compression=None"),
        ({"grad_compression": "powersgd", "powersgd": {"rnak": 2}}, r"powersgd has unknown options \['rnak'\]"),
        ({"grad_compression": "powersgd", "powersgd": {"rank": 0}}, "powersgd rank=0 is invalid: expected an integer"),
        (
            {"grad_compression": "powersgd", "reduce_dtype": "bf16"},
            "reduce_dtype=torch.bfloat16 cannot be combined with grad_compression='powersgd'",
        ),
    ],
)
def test_bad_arguments_raise_one_clear_error(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


@pytest.mark.parametrize("cls", [lightning_zero.ZeroStrategy, lightning_zero.fabric.ZeroStrategy])
def test_zero_refuses_compression(cls):
    with pytest.raises(ValueError, match="grad_compression='powersgd' is not supported by zero1_scratch"):
        cls(stage=1, grad_compression="powersgd")
    cls(stage=1, grad_compression=None)  # the default passes


def test_good_arguments_build_the_config():
    strategy = lightning_zero.ScratchDDPStrategy(grad_compression="powersgd", powersgd={"rank": 4, "start_iter": 10})
    assert (strategy.compression.rank, strategy.compression.start_iter) == (4, 10)
    assert lightning_zero.ScratchDDPStrategy(grad_compression="powersgd", reduce_dtype=None).compression is not None
    assert lightning_zero.ScratchDDPStrategy().compression is None


@pytest.mark.timeout(360)
def test_resume_with_find_unused_parameters_keeps_the_first_layout(fits):
    for rank_fits in fits:
        assert rank_fits["unused_order"] is None
        straight, resumed = rank_fits["unused_straight"], rank_fits["unused_resumed"]
        for key, value in straight["weights"].items():
            assert torch.equal(value, resumed["weights"][key]), key
