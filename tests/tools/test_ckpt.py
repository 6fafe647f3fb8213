"""``lightning-zero-ckpt``: ``consolidate`` makes every stage's sharded checkpoint equal to the ``full`` one saved at
the same moment (the optimizer state of ZeRO-1/2 cut back per parameter), loadable by plain PyTorch and Lightning
without lightning_zero; ``inspect`` reports what was written, and unreadable files are named.

2 gloo ranks fit and save both kinds after the same step; the tool then runs in this process, as a user would run it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.tools.ckpt import consolidate, describe, main
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage3.state import model_state_dict, optimizer_state_dict
from lightning_zero.zero.stage12_state import full_state_dict
from tests.helpers.parity import (
    ParityConfig,
    ParityModule,
    assert_optimizer_states_equal,
    make_trainer,
    train_loader,
)
from tests.helpers.workers import run_workers

REPO_ROOT = Path(__file__).resolve().parents[2]
# (stage, model, precision): frozen parameters inside param groups (numbering), tied weights under stage 3, and the
# fp32 "master" state of ZeRO-1/2 under mixed precision.
CASES = [(1, "mlp_frozen", "32-true"), (2, "mlp", "bf16-mixed"), (3, "gpt", "32-true")]


def _save_both(tmp: str) -> None:
    for stage, model, precision in CASES:
        config = ParityConfig(world_size=2, batches_per_rank=3, max_epochs=1, model=model)
        module = ParityModule(config.lr, model=model)
        strategy = ZeroStrategy(stage=stage)
        trainer = make_trainer(config, strategy, precision=precision)
        trainer.fit(module, train_loader(config))
        trainer.save_checkpoint(f"{tmp}/stage{stage}.sharded")
        strategy.state_dict_type = "full"
        trainer.save_checkpoint(f"{tmp}/stage{stage}.full")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("ckpt")
    run_workers(_save_both, 2, str(tmp), timeout=300)
    return tmp


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("stage", "model", "precision"), CASES, ids=[f"stage{c[0]}" for c in CASES])
def test_consolidated_equals_the_full_checkpoint(saved, stage, model, precision):
    sharded, full = saved / f"stage{stage}.sharded", saved / f"stage{stage}.full"
    assert sharded.is_dir() and full.is_file()
    ours, reference = consolidate(sharded), torch.load(full, weights_only=False)
    assert ours["state_dict"].keys() == reference["state_dict"].keys()
    for key, value in reference["state_dict"].items():
        assert torch.equal(ours["state_dict"][key], value), key
    assert len(ours["optimizer_states"]) == 1
    assert reference["optimizer_states"][0]["state"]  # AdamW's moments (and masters) exist
    assert_optimizer_states_equal(ours["optimizer_states"][0], reference["optimizer_states"][0])
    assert ours["lr_schedulers"] == reference["lr_schedulers"]
    assert (ours["global_step"], ours["epoch"]) == (reference["global_step"], reference["epoch"]) == (3, 1)


@pytest.mark.timeout(400)
def test_consolidated_file_loads_and_steps_in_plain_pytorch_without_lightning_zero(saved, tmp_path):
    """ZeRO-1's flat optimizer state (frozen parameters in its groups), consolidated: Lightning and a plain
    ``torch.optim`` optimizer load it, and one step from it equals one step from the full checkpoint."""
    plain = tmp_path / "plain.ckpt"
    assert main(["consolidate", str(saved / "stage1.sharded"), str(plain)]) == 0
    code = textwrap.dedent(
        f"""
        import sys, torch
        from tests.helpers.parity import ParityModule
        values = []
        for path in ({str(plain)!r}, {str(saved / "stage1.full")!r}):
            module = ParityModule.load_from_checkpoint(path, model="mlp_frozen")
            optimizer = module.configure_optimizers()["optimizer"]
            optimizer.load_state_dict(torch.load(path, weights_only=False)["optimizer_states"][0])
            torch.manual_seed(0)
            module.net(torch.randn(4, 6)).square().sum().backward()
            optimizer.step()
            values.append(torch.cat([p.detach().flatten() for p in module.parameters()]))
        assert "lightning_zero" not in sys.modules
        print("equal" if torch.equal(values[0], values[1]) else "different", float(values[0].abs().sum()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "equal"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [1, 3])
def test_inspect_reports_strategy_layout_tensors_and_bytes(saved, stage):
    sharded = describe(saved / f"stage{stage}.sharded")
    assert sharded[0].endswith("sharded (DCP directory)")
    assert sharded[1] == f"strategy: zero{stage}_scratch (stage {stage}), written by 2 rank(s)"
    assert sharded[2] == "step 3, epoch 1"  # saved after the fit: the epoch counter has moved on
    files = {rank: (saved / f"stage{stage}.sharded" / f"__{rank}_0.distcp").stat().st_size for rank in (0, 1)}
    assert all(f"rank {rank}: " in sharded[3] for rank in files) and sum(files.values()) > 0
    model = ParityModule(model=CASES[stage - 1][1]).state_dict()
    numel = sum(v.numel() for v in model.values())
    assert f"model: {len(model)} tensors, {numel:,} elements" in sharded
    for name, value in model.items():
        assert f"  {name}  {tuple(value.shape)}  float32" in sharded
    assert sharded[-2:] == ["optimizer state: yes", "lr schedulers: 1"]
    full = describe(saved / f"stage{stage}.full")
    assert full[0].endswith("one file") and full[1] == sharded[1] and full[-2:] == sharded[-2:]
    assert [line for line in full if line.startswith("  ")] == [line for line in sharded if line.startswith("  ")]


class _CaptureLoaded(L.Callback):
    """The model and optimizer state a resume starts from, in the full format (rank 0)."""

    def on_train_start(self, trainer, pl_module):
        engine = trainer.strategy.engine
        if isinstance(engine, ShardedParams):
            self.model, self.optimizer = model_state_dict(engine, sharded=False), optimizer_state_dict(engine, False)
        else:
            model = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}  # views of the flat params
            self.model, self.optimizer = model, full_state_dict(engine.shards(0))


def _resume(path: str, stage: int, model: str) -> dict:
    config = ParityConfig(world_size=3, batches_per_rank=3, max_epochs=2, model=model)
    capture = _CaptureLoaded()
    trainer = make_trainer(config, ZeroStrategy(stage=stage), callbacks=[capture])
    trainer.fit(ParityModule(config.lr, model=model), train_loader(config), ckpt_path=path)
    return {"model": capture.model, "optimizer": capture.optimizer}


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("source", "target"), [(1, 3), (3, 2)])
def test_converted_checkpoint_resumes_at_another_stage_and_world_size(saved, tmp_path, source, target):
    """Saved by stage ``source`` on 2 ranks, converted offline, resumed by stage ``target`` on 3: the run starts from
    the same weights and the same optimizer state (compared in the unsharded format with the ``full`` save)."""
    converted = tmp_path / f"stage{target}.ckpt"
    assert main(["convert", str(saved / f"stage{source}.sharded"), str(converted), "--stage", str(target)]) == 0
    assert describe(converted)[1] == f"strategy: zero{target}_scratch (stage {target}), written by 2 rank(s)"
    model = CASES[source - 1][1]
    resumed = run_workers(_resume, 3, str(converted), target, model, timeout=300)[0]
    reference = torch.load(saved / f"stage{source}.full", weights_only=False)
    assert resumed["model"].keys() == reference["state_dict"].keys()
    for key, value in reference["state_dict"].items():
        assert torch.equal(resumed["model"][key].cpu(), value), key
    assert_optimizer_states_equal(resumed["optimizer"], reference["optimizer_states"][0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("source", "target"), [(1, 3), (3, 2)])
def test_resuming_the_other_layout_is_refused_before_loading(saved, source, target):
    """Without the check DCP loads none of the other layout's optimizer tensors and the run resumes with fresh
    moments, silently."""
    path = saved / f"stage{source}.sharded"
    with pytest.raises(RuntimeError) as error:
        run_workers(_resume, 3, str(path), target, CASES[source - 1][1], timeout=200)
    layout = "one flat tensor per param group" if source < 3 else "one tensor per parameter"
    assert f"{path} holds a stage {source} sharded optimizer state ({layout}), which stage {target} cannot read" in (
        str(error.value)
    )
    assert f"lightning-zero-ckpt convert {path} NEW --stage {target}" in str(error.value)


def test_convert_refuses_a_bad_stage_and_an_existing_target(saved, tmp_path, capsys):
    for argv, message in (
        (["convert", str(saved / "stage1.full"), str(tmp_path / "x"), "--stage", "4"], "--stage 4 is invalid"),
        (["convert", str(saved / "stage1.full"), str(saved), "--stage", "3"], "File exists"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_export_writes_every_weight_tied_ones_included(saved, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    assert main(["export", str(saved / "stage3.sharded"), str(out)]) == 0
    exported = load_file(out)
    reference = torch.load(saved / "stage3.full", weights_only=False)["state_dict"]
    assert exported.keys() == reference.keys() and "net.head.weight" in exported  # the GPT's tied LM head
    for key, value in reference.items():
        assert torch.equal(exported[key], value), key


def test_unreadable_checkpoint_is_named(tmp_path, capsys):
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(b"PK\x03\x04 not really a checkpoint")
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", str(broken)])
    assert exit_info.value.code == 2
    assert f"lightning-zero-ckpt: {broken}: not a readable torch checkpoint" in capsys.readouterr().err
