"""Sharded checkpoint I/O: a failed save leaves the last good checkpoint intact."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero.zero import checkpoint
from tests.helpers.workers import run_workers


def _save_then_fail(path: str) -> dict:
    dist.init_process_group("gloo")
    good = {"model": {"w": torch.arange(6.0)}}
    checkpoint.save_sharded(path, good, meta={"epoch": 1})

    def broken_save(state_dict, checkpoint_id):  # dies half-way: one file written, no index
        Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
        raise OSError("disk full")

    real_save = checkpoint.dcp.save
    checkpoint.dcp.save = broken_save
    try:
        checkpoint.save_sharded(path, {"model": {"w": torch.zeros(6)}}, meta={"epoch": 2})
    except OSError as error:
        failure = str(error)
    finally:
        checkpoint.dcp.save = real_save
    loaded = {"model": {"w": torch.empty(6)}}
    meta = checkpoint.load_sharded(path, loaded)
    return {
        "failure": failure,
        "w": loaded["model"]["w"],
        "meta": meta,
        "sharded": checkpoint.is_sharded_checkpoint(path),
    }


@pytest.mark.timeout(120)
def test_a_failed_save_keeps_the_last_good_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    result = run_workers(_save_then_fail, 1, str(path))[0]
    assert result["failure"] == "disk full"
    assert result["sharded"]
    assert torch.equal(result["w"], torch.arange(6.0))
    assert result["meta"] == {"epoch": 1}
    assert not checkpoint.is_sharded_checkpoint(tmp_path / "last.ckpt.partial")  # the debris is not a checkpoint


def _killed_between_the_renames(path: str) -> dict:
    dist.init_process_group("gloo")
    checkpoint.save_sharded(path, {"model": {"w": torch.arange(6.0)}}, meta={"epoch": 1})
    real_rename, renames = Path.rename, []

    def rename(self, target):  # the process dies after moving the old checkpoint aside, before moving the new in
        if self.parent == Path(path).parent:  # not DCP's own renames inside the directory
            renames.append((self.name, Path(target).name))
            if self.name == "last.ckpt.partial":
                raise KeyboardInterrupt("killed")
        return real_rename(self, target)

    Path.rename = rename
    try:
        checkpoint.save_sharded(path, {"model": {"w": torch.zeros(6)}}, meta={"epoch": 2})
    except KeyboardInterrupt:
        pass
    finally:
        Path.rename = real_rename
    aside = Path(path).with_name("last.previous.ckpt")
    loaded = {"model": {"w": torch.empty(6)}}
    meta = checkpoint.load_sharded(aside, loaded)
    return {"renames": renames, "exists": Path(path).exists(), "w": loaded["model"]["w"], "meta": meta}


@pytest.mark.timeout(120)
def test_a_kill_between_the_renames_leaves_the_old_checkpoint_under_a_last_name(tmp_path):
    """The one moment a save has no ``last.ckpt``: the old one is then ``last.previous.ckpt``, complete, and a name
    Lightning's ``ckpt_path="last"`` finds (``ModelCheckpoint._find_last_checkpoints``: ``last*`` + ``.ckpt``)."""
    out = run_workers(_killed_between_the_renames, 1, str(tmp_path / "last.ckpt"))[0]
    assert out["renames"] == [("last.ckpt", "last.previous.ckpt"), ("last.ckpt.partial", "last.ckpt")]
    assert not out["exists"]
    assert torch.equal(out["w"], torch.arange(6.0)) and out["meta"] == {"epoch": 1}
    name = Path("last.previous.ckpt")
    assert name.suffix == ModelCheckpoint.FILE_EXTENSION and name.stem.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST)


# ---------------------------------------------------------------- a bad checkpoint is refused by name, nothing changed
def _corrupt(case: str, ckpt: Path) -> str:
    """Damage a saved checkpoint the way a full disk, a lost file or a newer version would; return what to expect."""
    if case == "truncated file":
        ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
        return f"cannot read checkpoint {ckpt}: "
    if case == "missing shard":
        shard = sorted(ckpt.glob("*.distcp"))[0]
        shard.unlink()
        return f"sharded checkpoint {ckpt} is missing shard file {shard.name} (it holds tensor '"
    if case == "truncated shard":
        shard = sorted(ckpt.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
        return f"sharded checkpoint {ckpt}: shard file {shard.name} is truncated (100 bytes, but tensor '"
    if case == "no meta.pt":
        (ckpt / checkpoint.META_FILE).unlink()
        return f"sharded checkpoint {ckpt} has no meta.pt: its save did not finish"
    assert case == "newer format"
    meta = torch.load(ckpt / checkpoint.META_FILE, weights_only=False)
    meta["lightning_zero"]["format"] = 99
    torch.save(meta, ckpt / checkpoint.META_FILE)
    return f"checkpoint {ckpt} has lightning_zero format 99, but this version reads formats up to 1"


def _resume_damaged(strategy_name: str, state_dict_type: str, case: str, ckpt: str) -> dict:
    from lightning_zero import ScratchDDPStrategy, ZeroStrategy
    from tests.helpers.parity import ParityConfig, ParityModule, make_trainer, train_loader

    config = ParityConfig(world_size=1, batches_per_rank=2, max_epochs=1)

    def strategy():
        if strategy_name == "ddp_scratch":
            return ScratchDDPStrategy()
        return ZeroStrategy(stage=int(strategy_name[4]), state_dict_type=state_dict_type)

    trainer = make_trainer(config, strategy())
    trainer.fit(module := ParityModule(config.lr), train_loader(config))
    trainer.save_checkpoint(ckpt)
    expected = _corrupt(case, Path(ckpt))
    with torch.no_grad():  # weights unlike the checkpoint's, so that any loading would show
        for p in module.parameters():
            p.add_(1.0)
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    resumed = make_trainer(config, strategy())
    try:
        resumed.fit(module, train_loader(config), ckpt_path=ckpt)
        error = "no error"
    except Exception as exc:  # the message is what the test checks
        error = f"{type(exc).__name__}: {exc}"
    engine = getattr(resumed.strategy, "engine", None)  # a failed stage-3 fit leaves the module sharded
    with engine.summon_full_params() if hasattr(engine, "summon_full_params") else contextlib.nullcontext():
        after = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"error": error, "expected": expected, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("strategy", "state_dict_type", "case"),
    [
        ("ddp_scratch", "full", "truncated file"),
        ("zero2_scratch", "full", "truncated file"),
        ("zero2_scratch", "sharded", "missing shard"),
        ("zero3_scratch", "sharded", "truncated shard"),
        ("zero1_scratch", "sharded", "no meta.pt"),
        ("zero3_scratch", "sharded", "newer format"),
    ],
)
def test_a_damaged_checkpoint_is_refused_naming_the_file_before_any_weight_changes(
    tmp_path, strategy, state_dict_type, case
):
    out = run_workers(_resume_damaged, 1, strategy, state_dict_type, case, str(tmp_path / "x.ckpt"))[0]
    assert out["error"].startswith("CheckpointError: "), out["error"]
    assert out["expected"] in out["error"], out
    assert out["unchanged"], "the refused checkpoint changed the module's weights"
