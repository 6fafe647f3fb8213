"""lightning-zero-report on a synthetic Hydra multirun dir: rows, values, failed jobs, the plots."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger

from lightning_zero import report, sweep_results

MIB = 2**20
COMMON = ["trainer=ddp_sim", "trainer.max_steps=30", "paths.log_dir=/tmp/x"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TAB10 = {"C0": (0x1F, 0x77, 0xB4), "C1": (0xFF, 0x7F, 0x0E), "C2": (0x2C, 0xA0, 0x2C)}


def _hydra_files(job: Path, overrides: list[str], strategy_target: str, stage: int | None = None) -> None:
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    strategy: dict[str, Any] = {"_target_": strategy_target}
    if stage is not None:
        strategy["stage"] = stage
    config = {"trainer": {"devices": 2, "num_nodes": 1, "max_steps": 30}, "strategy": strategy, "seed": 1234}
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))


def _metrics(job: Path, train: list[float], val: list[tuple[float, float]], step_ms: float) -> None:
    """metrics.csv as the CSV logger writes it during a fit (train every 10 steps, val at 10/20/30)."""
    logger = CSVLogger(job, name="csv", version="")
    for i, loss in enumerate(train):
        step = 10 * i + 9
        logger.log_metrics({"lr-AdamW/pg1": 0.003, "epoch": 0}, step=step)
        logger.log_metrics({"train/loss": loss, "perf/step_time_ms": step_ms, "epoch": 0}, step=step)
        if i < len(val):
            logger.log_metrics({"val/loss": val[i][0], "val/ppl": val[i][1], "epoch": 0}, step=step)
    logger.save()
    logger.finalize("success")


def _rank(rank: int, ms: float, params: int, grads: int, optimizer: int, buffers: int) -> dict[str, Any]:
    total = params + grads + optimizer + buffers
    return {
        "rank": rank,
        "median_step_time_ms": ms,
        "measured_steps": 28,
        "peak_model_state_mib": total / MIB,
        "peak_step": 1,
        "peak_model_state_bytes": {
            "params": params,
            "grads": grads,
            "optimizer": optimizer,
            "strategy_buffers": buffers,
            "total": total,
        },
    }


def _run_stats(job: Path, name: str, cls: str, ranks: list[dict[str, Any]]) -> None:
    stats = {
        "schema_version": 1,
        "strategy": {"name": name, "class": cls},
        "world_size": len(ranks),
        "accumulate_grad_batches": 1,
        "optimizer_steps": 30,
        "warmup_steps": 2,
        "measured_steps": 28,
        "strategy_buffers_counted": True,
        "median_step_time_ms": max(r["median_step_time_ms"] for r in ranks),
        "peak_model_state_mib": max(r["peak_model_state_mib"] for r in ranks),
        "ranks": ranks,
    }
    (job / "run_stats.json").write_text(json.dumps(stats, indent=2))


PSI = 1_000_000


@pytest.fixture
def multirun(tmp_path: Path) -> Path:
    """<sweep>/0 ddp_scratch and <sweep>/1 zero3_scratch (2 ranks each, complete), <sweep>/2 died before logging."""
    root = tmp_path / "multiruns" / "2026-01-01_00-00-00"
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    job0, job1, job2 = root / "0", root / "1", root / "2"
    _hydra_files(job0, ["strategy=ddp_scratch", *COMMON], "lightning_zero.ScratchDDPStrategy")
    _metrics(job0, [4.1, 3.5, 3.0], [(3.9, 49.4), (3.4, 30.0), (3.1, 22.2)], 90.0)
    _run_stats(
        job0,
        "ddp_scratch",
        "lightning_zero.strategies.ddp.ScratchDDPStrategy",
        [_rank(0, 90.0, 4 * PSI, 4 * PSI, 8 * PSI, 0), _rank(1, 95.5, 4 * PSI, 4 * PSI, 8 * PSI, 0)],
    )
    _hydra_files(job1, ["strategy=zero3_scratch", *COMMON], "lightning_zero.ZeroStrategy", stage=3)
    _metrics(job1, [4.2, 3.6, 3.2], [(4.0, 54.6), (3.5, 33.1)], 140.0)
    _run_stats(
        job1,
        "zero3_scratch",
        "lightning_zero.strategies.zero.ZeroStrategy",
        [_rank(0, 140.0, 2 * PSI, 2 * PSI, 4 * PSI, PSI), _rank(1, 132.0, 2 * PSI, 2 * PSI, 4 * PSI + 64, PSI)],
    )
    _hydra_files(job2, ["strategy=zero2_scratch", *COMMON], "lightning_zero.ZeroStrategy", stage=2)
    (job2 / "train.log").write_text("[ERROR] job died\n")
    return root


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def _png(path: Path, colors: tuple[str, ...]) -> None:
    """A valid PNG of a real figure: the magic bytes, a plausible size, many colours, the expected tab10 ones."""
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        rgb = image.convert("RGB")
        assert rgb.width >= 600 and rgb.height >= 400
        present = {c for _, c in rgb.getcolors(maxcolors=rgb.width * rgb.height)}
    assert len(present) > 100  # anti-aliased text, lines and bars, not an empty canvas
    for name in colors:
        assert TAB10[name] in present, f"{path.name}: no {name} pixels"


def test_collect_parses_rows(multirun: Path) -> None:
    jobs = sweep_results.collect(multirun)
    assert [j.job for j in jobs] == ["0", "1", "2"]
    assert [j.status for j in jobs] == ["ok", "ok", "failed"]
    ok, zero3, failed = jobs
    assert ok.overrides == ["strategy=ddp_scratch", *COMMON]
    assert (ok.strategy, ok.world_size, ok.optimizer_steps) == ("ddp_scratch", 2, 30)
    assert ok.train_loss == [(9, 4.1), (19, 3.5), (29, 3.0)]
    assert ok.val_loss == [(9, 3.9), (19, 3.4), (29, 3.1)]
    assert ok.median_step_time_ms == 95.5 and ok.median_step_time_ms_per_rank == [90.0, 95.5]
    assert ok.peak_mib == 16 * PSI / MIB
    assert zero3.final("val/ppl") == 33.1  # its last validation
    assert zero3.peak_mib == (9 * PSI + 64) / MIB and zero3.peak_breakdown["optimizer"] == 4 * PSI + 64
    # The failed job: strategy and world size from its overrides and config, the missing files named.
    assert (failed.strategy, failed.world_size) == ("zero2_scratch", 2)
    assert any("metrics.csv" in p for p in failed.problems) and any("run_stats.json" in p for p in failed.problems)
    assert failed.train_loss == [] and failed.median_step_time_ms is None


def test_report_files(multirun: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert report.main([str(multirun), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "loss_curves.png",
        "report.csv",
        "report.md",
        "step_time_memory.png",
    ]
    rows = _read_csv(out / "report.csv")
    assert [r["job"] for r in rows] == ["0", "1", "2"]
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
    r0, r1, r2 = rows
    assert r0["overrides"] == " ".join(["strategy=ddp_scratch", *COMMON])
    assert (r0["strategy"], r0["world_size"], r0["optimizer_steps"]) == ("ddp_scratch", "2", "30")
    assert float(r0["final_train_loss"]) == 3.0
    assert (float(r0["final_val/loss"]), float(r0["final_val/ppl"])) == (3.1, 22.2)
    assert float(r0["median_step_time_ms"]) == 95.5  # the slowest rank's median
    assert [float(v) for v in r0["median_step_time_ms_per_rank"].split(";")] == [90.0, 95.5]
    assert float(r0["peak_model_state_mib"]) == pytest.approx(16 * PSI / MIB)
    assert float(r1["peak_model_state_mib"]) == pytest.approx((9 * PSI + 64) / MIB)
    assert [float(v) for v in r1["peak_model_state_mib_per_rank"].split(";")] == pytest.approx(
        [9 * PSI / MIB, (9 * PSI + 64) / MIB]
    )
    assert float(r1["peak_strategy_buffers_mib"]) == pytest.approx(PSI / MIB)
    assert (float(r1["final_val/loss"]), float(r1["median_step_time_ms"])) == (3.5, 140.0)
    assert r2["strategy"] == "zero2_scratch" and r2["final_train_loss"] == "" and r2["median_step_time_ms"] == ""
    assert "no csv/metrics.csv" in r2["problems"]

    md = (out / "report.md").read_text()
    assert f"Overrides of every job: `{' '.join(COMMON)}`" in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| job | overrides | strategy | N | status |")
    assert "| 0 | `strategy=ddp_scratch` | ddp_scratch | 2 | ok | 30 | 3 | 3.1 | 22.2 | 95.5 |" in md
    assert "| 2 | `strategy=zero2_scratch` | zero2_scratch | 2 | failed |" in md
    assert "- job 2 (failed): no csv/metrics.csv; no run_stats.json" in md
    assert "![loss_curves](loss_curves.png)" in md and "![step_time_memory](step_time_memory.png)" in md

    _png(out / "loss_curves.png", ("C0", "C1"))  # two jobs with losses, in the first two colours
    _png(out / "step_time_memory.png", ("C0", "C1", "C2"))  # rank bars; params / grads / optimizer stacks


def test_single_run_dir_and_default_out(multirun: Path) -> None:
    job = multirun / "1"
    written = report.write_report(job, plots=False)
    assert set(written) == {"report.csv", "report.md"} and written["report.csv"].parent == job.resolve()
    [row] = _read_csv(job / "report.csv")
    assert (row["job"], row["status"], row["strategy"]) == (".", "ok", "zero3_scratch")


def test_unreadable_and_partial_jobs_do_not_crash(multirun: Path) -> None:
    (multirun / "1" / "run_stats.json").write_text("{ truncated")
    (multirun / "0" / "run_stats.json").unlink()
    (multirun / "3").mkdir()  # a numbered job dir Hydra created, nothing written in it
    jobs = sweep_results.collect(multirun)
    assert [j.job for j in jobs] == ["0", "1", "2", "3"]
    assert [j.status for j in jobs] == ["incomplete", "incomplete", "failed", "failed"]
    assert any("unreadable run_stats.json" in p for p in jobs[1].problems)
    assert jobs[1].strategy == "zero3_scratch" and jobs[1].final("val/loss") == 3.5  # the metrics still count
    md = report.render_markdown(jobs, multirun)
    assert "4 job(s): 0 ok, 4 failed or incomplete." in md


def test_missing_matplotlib_writes_tables_and_says_what_to_install(
    multirun: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert report.main([str(multirun)]) == 1
    assert 'pip install "lightning-zero[report]"' in capsys.readouterr().err
    assert (multirun / "report.csv").is_file() and (multirun / "report.md").is_file()
    assert not (multirun / "loss_curves.png").exists()


def test_no_job_dirs_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main([str(tmp_path)]) == 1
    assert "no job dirs" in capsys.readouterr().err


def test_python_dash_m(multirun: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "lightning_zero.report", str(multirun), "--out", str(out), "--no-plots"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (out / "report.md").is_file() and len(_read_csv(out / "report.csv")) == 3
