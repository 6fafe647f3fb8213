"""Hydra multirun with multi-process jobs (``lightning_zero/tools/multirun.py``), through the real CLI.

Without :class:`lightning_zero.tools.multirun.JobScope`, rank 1 of the first job re-runs the whole sweep under its own
timestamped sweep root (two roots, rank-1 logs outside the job dirs) and ranks outlive their jobs; these tests check
one sweep root, one directory per job with that job's rank-1 log (naming the job's strategy and the rank's pid), exit
code 0, and that no process of the sweep is left once it returns.
"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

import pytest

from lightning_zero.tools.multirun import child_argv
from lightning_zero.tools.report import write_report
from tests.helpers.cli import cli_env, run_cli

TINY = [
    "trainer=ddp_sim",
    "trainer.max_steps=5",
    "trainer.val_check_interval=5",
    "trainer.limit_val_batches=2",
    "model.n_layer=1",
    "model.n_embd=32",
    "data.max_chars=40000",
]
STRATEGY_CLASS = {
    "ddp_scratch": "ScratchDDPStrategy",
    "zero1_scratch": "ZeroStrategy",
    "zero2_scratch": "ZeroStrategy",
    "zero3_scratch": "ZeroStrategy",
    "ddp": "DDPStrategy",
    "pipeline_scratch": "PipelineStrategy",
    "tensor_parallel_scratch": "TensorParallelStrategy",
}


def test_child_argv_reruns_only_this_job_in_run_mode() -> None:
    argv = child_argv(
        task=["strategy=zero1_scratch", "trainer.max_steps=5"],
        hydra_overrides=["hydra.sweep.dir=/s", "hydra.job.chdir=true", "hydra.mode=MULTIRUN", "hydra.run.dir=/r"],
        sweep_dir="/pinned/sweep",
        job_num=3,
    )
    assert argv == [
        "strategy=zero1_scratch",
        "trainer.max_steps=5",
        "hydra.job.chdir=true",
        "hydra.mode=RUN",
        'hydra.sweep.dir="/pinned/sweep"',
        "hydra.job.num=3",
    ]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _check_sweep(log_dir: Path, strategies: list[str]) -> Path:
    """One sweep root, one dir per job; each job ran its own strategy on both ranks; rank 1 logged in the job dir."""
    roots = list((log_dir / "multiruns").iterdir())
    assert len(roots) == 1, f"sweep split into {sorted(r.name for r in roots)}"
    root = roots[0]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [str(i) for i in range(len(strategies))]
    for num, strategy in enumerate(strategies):
        job = root / str(num)
        assert f"strategy={strategy}" in (job / ".hydra" / "overrides.yaml").read_text()
        cls = STRATEGY_CLASS[strategy]
        assert f"rank 0 of 2: fitting with {cls}" in (job / "train.log").read_text()
        rank1 = (job / "train_ddp_process_1.log").read_text()
        pids = {int(p) for p in re.findall(rf"rank 1 of 2 \(pid (\d+)\): fit with {cls}\b", rank1)}
        assert len(pids) == 1, rank1[-3000:]
        pid = pids.pop()
        assert f"rank 1 of 2 (pid {pid}): fit done" in rank1
        assert not _pid_alive(pid), f"job {num}'s rank 1 is still running"
        assert "val/ppl" in (job / "csv" / "metrics.csv").read_text().splitlines()[0]
    return root


def _sweep(tmp_path: Path, strategies: list[str], *extra: str, timeout: float) -> Path:
    log_dir = tmp_path / "logs"
    # No MASTER_PORT: each job must pick its own free port once the previous job has released its environment.
    run = run_cli(
        ["-m", f"strategy={','.join(strategies)}", *TINY, f"paths.log_dir={log_dir}", *extra],
        tmp_path,
        timeout=timeout,
        env=cli_env(pin_port=False),
    )
    assert run.returncode == 0, f"exit code {run.returncode}:\n{run.stdout[-8000:]}"
    assert not run.leftover, f"processes of the sweep outlived it: {run.leftover}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]  # nothing written elsewhere
    return _check_sweep(log_dir, strategies)


@pytest.mark.timeout(240)
def test_popen_sweep_runs_each_job_once_in_its_own_dir_and_reports(tmp_path: Path) -> None:
    root = _sweep(tmp_path, ["ddp_scratch", "zero1_scratch"], timeout=200)
    # The sweep report reads what the jobs wrote: both jobs ok, two ranks each, ZeRO-1's per-rank state smaller.
    written = write_report(root)
    assert {"report.md", "report.csv", "loss_curves.png", "step_time_memory.png"} <= set(written)
    with written["report.csv"].open() as file:
        rows = {row["strategy"]: row for row in csv.DictReader(file)}
    assert set(rows) == {"ddp_scratch", "zero1_scratch"}
    for row in rows.values():
        assert (row["status"], row["world_size"]) == ("ok", "2"), row
        assert len(row["peak_model_state_mib_per_rank"].split(";")) == 2
        assert float(row["median_step_time_ms"]) > 0
    assert float(rows["zero1_scratch"]["peak_model_state_mib"]) < float(rows["ddp_scratch"]["peak_model_state_mib"])
    for png in ("loss_curves.png", "step_time_memory.png"):
        assert written[png].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_popen_sweep_of_every_strategy(tmp_path: Path) -> None:
    _sweep(tmp_path, ["ddp_scratch", "zero1_scratch", "zero2_scratch", "zero3_scratch", "ddp"], timeout=540)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_layout_sweep_reports_one_table_and_the_model_parallel_layouts_agree(tmp_path: Path) -> None:
    layouts = ["ddp_scratch", "pipeline_scratch", "tensor_parallel_scratch"]
    root = _sweep(tmp_path, layouts, "experiment=char_layouts", timeout=540)
    with write_report(root)["report.csv"].open() as file:
        rows = {row["strategy"]: row for row in csv.DictReader(file)}
    assert set(rows) == set(layouts) and all(row["status"] == "ok" for row in rows.values())
    # Both split the model over the 2 processes of one replica and see the same batches: the same training.
    pipeline, tensor = (float(rows[name]["final_val/ppl"]) for name in layouts[1:])
    assert pipeline == pytest.approx(tensor, rel=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_spawn_sweep(tmp_path: Path) -> None:
    _sweep(tmp_path, ["ddp_scratch", "zero3_scratch"], "strategy.start_method=spawn", timeout=360)


@pytest.mark.slow  # 27 s of Hydra startup for one refusal; the CLI's other bad-input tests stay in the default run
@pytest.mark.timeout(120)
def test_parallel_launcher_with_popen_jobs_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="needs hydra-joblib-launcher (test extra)")
    log_dir = tmp_path / "logs"
    run = run_cli(
        ["-m", "hydra/launcher=joblib", "strategy=ddp_scratch,zero1_scratch", *TINY, f"paths.log_dir={log_dir}"],
        tmp_path,
        timeout=100,
        env=cli_env(pin_port=False),
    )
    assert run.returncode != 0
    assert "the Hydra launcher JoblibLauncher runs sweep jobs in parallel on this host" in run.stdout, run.stdout
    assert "Initializing distributed" not in run.stdout  # refused before any process group or rank existed
    assert not run.leftover
    assert not list(log_dir.rglob("train_ddp_process_*.log"))
