"""``lightning-zero-parity``: a data-parallel equivalent module passes under our ZeRO strategies, one that is not (local
BatchNorm statistics) fails naming a tensor, bad input is refused with exit code 2 before or during the runs, and a
hung rank is killed at ``--timeout``.

The tool runs in this process, as ``main(argv)``; its ranks and reference are forked from a forkserver that the first
such test starts. The modules come from ``tests/tools/parity_modules.py``, named by path as a user names a script.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_zero.tools.parity import main
from lightning_zero.tools.parity_compare import compare
from lightning_zero.tools.parity_job import EXIT_ERROR, EXIT_FAIL, EXIT_PASS, GlobalBatchSampler, Job

REPO_ROOT = Path(__file__).resolve().parents[2]
MODULES = f"{Path(__file__).with_name('parity_modules.py').relative_to(REPO_ROOT)}"


@pytest.fixture(autouse=True)
def _from_the_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the repository root as a user runs from theirs; undo what importing their file adds to the path."""
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "parity_modules", raising=False)


def _check(tmp_path: Path, module: str, *args: str) -> tuple[int, dict]:
    out = tmp_path / "parity.json"
    code = main([f"{MODULES}:{module}", *args, "--json", str(out)])
    return code, json.loads(out.read_text()) if out.exists() else {}


# ---------------------------------------------------------------- verdicts
@pytest.mark.timeout(240)
def test_an_equivalent_module_passes_under_zero3(tmp_path, capsys):
    code, report = _check(tmp_path, "MLP", "--strategy", "zero3_scratch", "--devices", "2", "--steps", "5")
    stdout = capsys.readouterr().out
    assert code == EXIT_PASS, stdout
    assert report["verdict"] == "PASS"
    assert report["max_diff"] <= 1e-5
    assert [row["name"] for row in report["rows"]] == [
        "net.0.weight",
        "net.0.bias",
        "net.2.weight",
        "net.2.bias",
        "train_loss",
    ]
    assert "PASS: zero3_scratch matches the single-process reference within 1e-05 on 5 steps (max diff" in stdout
    assert "net.0.weight  (16, 6)" in stdout


@pytest.mark.timeout(240)
def test_batch_size_and_trainer_kwargs_reach_both_runs(tmp_path, capsys):
    """3 samples per rank, gradients accumulated over 2 batches and norm-clipped: still the reference's weights."""
    trainer_kwargs = json.dumps({"accumulate_grad_batches": 2, "gradient_clip_val": 0.05})
    code, report = _check(
        tmp_path, "MLP", "--strategy", "zero2_scratch", "--batch-size", "3", "--trainer-kwargs", trainer_kwargs
    )
    stdout = capsys.readouterr().out
    assert code == EXIT_PASS, stdout
    assert "global batch 6 (2 ranks x 3), 5 optimizer steps" in stdout
    assert report["max_diff"] <= 1e-5


@pytest.mark.timeout(240)
def test_a_module_named_by_its_dotted_path(capsys):
    assert main(["tests.tools.parity_modules:MLP", "--strategy", "ddp_scratch", "--steps", "2"]) == EXIT_PASS
    assert "PASS: ddp_scratch matches the single-process reference within 1e-05 on 2 steps" in capsys.readouterr().out


@pytest.mark.timeout(240)
def test_batchnorm_without_sync_fails_naming_a_tensor(tmp_path, capsys):
    """Each rank normalizes its 4 samples, the reference all 8: the check must be able to say FAIL."""
    code, report = _check(tmp_path, "BatchNormMLP", "--strategy", "zero2_scratch")
    stdout = capsys.readouterr().out
    assert code == EXIT_FAIL, stdout
    assert report["verdict"] == "FAIL"
    assert report["max_diff"] > 1e-3
    assert report["worst"] in {row["name"] for row in report["rows"]}
    assert f"(worst: {report['worst']}, max diff" in stdout
    assert "FAIL: zero2_scratch differs from the single-process reference on" in stdout
    assert "note: BatchNorm without SyncBatchNorm in net.1" in stdout


@pytest.mark.timeout(240)
def test_lightning_boring_model_passes_under_ddp_from_the_command_line(tmp_path):
    """Lightning's own demo module and strategy, through ``python -m``: the tool's sanity run."""
    out = tmp_path / "boring.json"
    command = [sys.executable, "-m", "lightning_zero.tools.parity"]
    command += ["lightning.pytorch.demos.boring_classes:BoringModel", "--strategy", "ddp", "--json", str(out)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert done.returncode == EXIT_PASS, done.stdout + done.stderr
    assert "Warning" not in done.stderr  # e.g. runpy's, when each process re-runs the tool as its __main__
    assert "PASS: ddp matches the single-process reference within 1e-05 on 5 steps" in done.stdout
    report = json.loads(out.read_text())
    assert {row["name"] for row in report["rows"]} == {"layer.weight", "layer.bias"}
    assert report["max_diff"] <= 1e-5


# ---------------------------------------------------------------- refusals and failures
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["MLP", "--strategy", "zero4_scratch"],
            "--strategy 'zero4_scratch' is not a registered strategy; did you mean zero3_scratch? (the registered",
        ),
        (["MLP", "--strategy", "ddp", "--devices", "1"], "--devices 1: must be at least 2"),
        (["MLP", "--strategy", "ddp", "--steps", "0"], "--steps 0: must be at least 1"),
        (["MLP", "--strategy", "ddp", "--batch-size", "0"], "--batch-size 0: must be at least 1"),
        (["MLP", "--strategy", "ddp", "--json", "no/such/dir/out.json"], "--json no/such/dir/out.json: the folder"),
        (["MLP", "--strategy", "ddp", "--init-kwargs", "{bad"], "--init-kwargs '{bad': not valid JSON"),
        (["MLP", "--strategy", "ddp", "--init-kwargs", "[1]"], "expected a JSON object, got a list"),
        (
            ["MLP", "--strategy", "ddp", "--init-kwargs", '{"width": 3}'],
            "MLP(...) got an unexpected keyword argument 'width'",
        ),
        (
            ["MLP", "--strategy", "ddp", "--trainer-kwargs", '{"max_epochs": 3, "devices": 4}'],
            "--trainer-kwargs may not set devices, max_epochs",
        ),
        (["Missing", "--strategy", "ddp"], "has no attribute 'Missing'"),
        (["dataset", "--strategy", "ddp"], "is not a LightningModule subclass"),
        (["NoData", "--strategy", "ddp"], "NoData defines no train_dataloader() and no --datamodule was given"),
        (["MLP", "--strategy", "ddp", "--datamodule", "MLP"], "is not a LightningDataModule subclass"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(argv, message, capsys):
    module, *options = argv
    if options[-1] == "MLP":  # the --datamodule case names a class of the same file
        options[-1] = f"{MODULES}:MLP"
    assert main([f"{MODULES}:{module}", *options]) == EXIT_ERROR
    assert message in capsys.readouterr().err
    assert not multiprocessing.active_children()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_such_package.model:LitModel", "cannot import 'no_such_package.model' (ModuleNotFoundError"),
        ("tests/tools/no_such_file.py:LitModel", "no such file: 'tests/tools/no_such_file.py'"),
        ("LitModel", "expected MODULE:CLASS, e.g. my_project.model:LitModel"),
    ],
)
def test_unimportable_targets_name_what_failed(target, message, capsys):
    assert main([target, "--strategy", "zero3_scratch"]) == EXIT_ERROR
    assert message in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_a_loader_the_reference_cannot_replay_is_refused(capsys):
    assert main([f"{MODULES}:WeightedData", "--strategy", "zero1_scratch"]) == EXIT_ERROR
    assert "custom sampler (WeightedRandomSampler)" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_a_crash_shows_the_end_of_the_process_output(capsys):
    assert main([f"{MODULES}:Crashes", "--strategy", "zero2_scratch"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "failed with exit code 1; the last lines of its output:" in err
    assert "RuntimeError: boom in training_step" in err


@pytest.mark.timeout(240)
def test_a_hung_rank_is_killed_at_the_timeout(capsys):
    assert main([f"{MODULES}:HangsOnRank1", "--strategy", "zero2_scratch", "--timeout", "10"]) == EXIT_ERROR
    assert "timed out after 10 s (--timeout) with rank 0, rank 1 still running, now killed" in capsys.readouterr().err
    assert not multiprocessing.active_children()


# ---------------------------------------------------------------- the pieces
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("size", "world", "batch"), [(64, 2, 4), (63, 2, 4), (10, 3, 3), (5, 4, 2)])
def test_global_batches_are_the_ranks_batches_concatenated(size, world, batch, drop_last):
    """Against real per-rank loaders under Lightning's sampler, over two epochs (padding and short batches too)."""
    sampler = GlobalBatchSampler(size, world, batch, seed=3, drop_last=drop_last)
    for epoch in (0, 1):
        per_rank = []
        for rank in range(world):
            ranks_sampler = DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=True, seed=3)
            ranks_sampler.set_epoch(epoch)
            per_rank.append(list(DataLoader(range(size), batch_size=batch, sampler=ranks_sampler, drop_last=drop_last)))
        sampler.set_epoch(epoch)
        expected = [[i for batches in per_rank for i in batches[k].tolist()] for k in range(len(per_rank[0]))]
        assert list(sampler) == expected
        assert len(sampler) == len(expected)
    assert sampler.sampler is sampler  # where Lightning calls set_epoch


def _result(state: dict, steps: int = 2, loss: float = 1.0) -> dict:
    return {"global_step": steps, "metrics": [{"train_loss": loss}] * steps, "state": state, "notes": []}


def test_missing_tensors_mismatched_shapes_and_short_runs_fail():
    job = Job("m:C", None, {}, "zero3_scratch", devices=2, steps=2, batch_size=None, seed=0)
    weight, bias = torch.ones(2, 3), torch.zeros(2)
    reference = _result({"w": weight, "b": bias, "buffer": torch.ones(1)})
    rank0 = _result({"w": weight.clone(), "b": torch.zeros(3), "extra": torch.ones(1)}, loss=1.5)
    passed, rows, verdict = compare({"reference": reference, "rank0": rank0, "rank1": _result({})}, job, 1e-5)
    assert not passed
    by_name = {row.name: row for row in rows}
    assert by_name["w"].max_diff == 0.0
    assert by_name["b"].note == "shapes differ: (3,) vs (2,)"
    assert by_name["buffer"].note == "missing in the strategy run"
    assert by_name["extra"].note == "missing in the reference"
    assert by_name["train_loss"].max_diff == pytest.approx(0.25)  # rank mean (1.5 + 1.0) / 2 against 1.0
    assert math.isinf(by_name["b"].max_diff)
    assert verdict.startswith("FAIL: zero3_scratch differs from the single-process reference on 4 of 5")

    short = {"reference": reference, "rank0": _result(reference["state"], steps=1), "rank1": _result({}, steps=2)}
    passed, rows, verdict = compare(short, job, 1e-5)
    assert not passed and not rows
    assert verdict == (
        "FAIL: the runs did not all make 2 optimizer steps (rank 0 1, rank 1 2, the reference 2); nothing compared"
    )
