"""lightning-zero-report on a synthetic Hydra multirun dir: rows, values, failed jobs, the plots."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger

from lightning_zero.tools import report, sweep_results
from lightning_zero.tools import report_figures as figures

MIB = 2**20
COMMON = ["trainer=ddp_sim", "trainer.max_steps=30", "paths.log_dir=/tmp/x"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TAB10 = {
    "C0": (0x1F, 0x77, 0xB4),
    "C1": (0xFF, 0x7F, 0x0E),
    "C2": (0x2C, 0xA0, 0x2C),
    "C3": (0xD6, 0x27, 0x28),
    "C4": (0x94, 0x67, 0xBD),
}


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
    err = capsys.readouterr().err
    assert 'pip install "lightning-zero[report]"' in err and "--no-plots writes them alone" in err
    assert (multirun / "report.csv").is_file() and (multirun / "report.md").is_file()
    assert not (multirun / "loss_curves.png").exists()
    assert report.main([str(multirun), "--no-plots"]) == 0  # the way the message offers


def test_no_job_dirs_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main([str(tmp_path)]) == 1
    assert "no job dirs" in capsys.readouterr().err


def test_python_dash_m(multirun: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "lightning_zero.tools.report", str(multirun), "--out", str(out), "--no-plots"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (out / "report.md").is_file() and len(_read_csv(out / "report.csv")) == 3


# ----------------------------------------------------------------------------------------------------- loss curves
SHORT = [(9, 4.1), (19, 3.5), (29, 3.0)]  # a 30-step run: three logged points
HIGHER = [(s, v + 0.3) for s, v in SHORT]
VAL = [(9, 3.9), (29, 3.1)]


def _loss_job(
    name: str, strategy: str, train: list[tuple[int, float]], val: list[tuple[int, float]] | None = None
) -> sweep_results.JobResult:
    metrics = {"train/loss": train, **({"val/loss": val} if val is not None else {})}
    overrides = [f"strategy={strategy}", *COMMON]
    return sweep_results.JobResult(job=name, path=Path(name), overrides=overrides, metrics=metrics,
                                   train_loss_key="train/loss")  # fmt: skip


def test_coincide_within_tolerance_at_every_shared_step() -> None:
    assert figures.coincide(SHORT, list(SHORT))
    close = [(s, v * (1 + 1e-4)) for s, v in SHORT]  # 0.01% apart: within the default 0.1%
    assert figures.coincide(SHORT, close) and not figures.coincide(SHORT, close, rel_tol=1e-5)
    assert not figures.coincide(SHORT, [(9, 4.1), (19, 3.5), (29, 3.01)])  # one step 0.3% apart
    longer = [*SHORT, (39, 2.0), (49, 1.5)]
    assert figures.coincide(SHORT[:2], longer) and figures.coincide(longer, SHORT[:2])  # a short run under a longer one
    shifted = [(s + 1, v) for s, v in SHORT]
    assert not figures.coincide(SHORT, shifted) and not figures.coincide(SHORT, [])  # no shared step
    diverged = [(9, 4.1), (19, math.nan)]
    assert figures.coincide(diverged, list(diverged)) and not figures.coincide(diverged, SHORT)


def test_coincident_groups() -> None:
    same = [(s, v * (1 - 1e-5)) for s, v in SHORT]
    assert figures.coincident_groups({"0": SHORT, "1": list(SHORT), "2": HIGHER, "3": same}) == [["0", "1", "3"], ["2"]]
    assert figures.coincident_groups({"0": HIGHER, "1": SHORT}, rel_tol=0.2) == [["0", "1"]]  # 0.3 on 3-4: within 20%
    # A short run that matches the start of two runs diverging later lies under both: one group of three.
    a, b = [*SHORT, (39, 2.0)], [*SHORT, (39, 2.5)]
    assert figures.coincident_groups({"a": a, "b": b}) == [["a"], ["b"]]
    assert figures.coincident_groups({"a": a, "x": HIGHER, "b": b, "s": SHORT[:2]}) == [["a", "b", "s"], ["x"]]


def test_loss_curves_name_coinciding_jobs_and_mark_short_runs() -> None:
    import matplotlib.pyplot as plt

    jobs = [
        _loss_job("0", "ddp", SHORT, VAL),
        _loss_job("1", "ddp_scratch", list(SHORT), list(VAL)),
        _loss_job("2", "zero3_scratch", HIGHER, VAL),
        _loss_job("3", "zero1_scratch", SHORT),
    ]
    fig = figures.loss_curves_figure(jobs)
    try:
        [ax] = fig.axes
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [
            "0: strategy=ddp (train)",
            "0: strategy=ddp (val)",
            "1: strategy=ddp_scratch (train, = job 0)",
            "1: strategy=ddp_scratch (val, = job 0)",
            "2: strategy=zero3_scratch (train)",
            "2: strategy=zero3_scratch (val, = job 0)",
            "3: strategy=zero1_scratch (train, = job 0)",
        ]
        title = ax.get_title().replace("\n", " ")
        assert "within 0.1% at every shared step" in title
        assert "3 train-loss curves (jobs 0, 1, 3); 3 val-loss curves (jobs 0, 1, 2)" in title
        lines = {line.get_label(): line for line in ax.get_lines()}
        train = [lines[text] for text in ("0: strategy=ddp (train)", "1: strategy=ddp_scratch (train, = job 0)",
                                          "3: strategy=zero1_scratch (train, = job 0)")]  # fmt: skip
        for line in lines.values():  # the data as logged, a marker on each of the few points
            assert line.get_marker() != "None" and line.get_markevery() is None
        assert [list(zip(*line.get_data())) for line in train] == [SHORT] * 3
        assert [line.get_linestyle() for line in train] == ["-", "--", "--"]  # the first solid, the others dashed
        sizes = [line.get_markersize() for line in train]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3  # each marker rings the next
        assert lines["2: strategy=zero3_scratch (train)"].get_linestyle() == "-"
    finally:
        plt.close(fig)


@pytest.mark.parametrize(("jobs", "points"), [(5, 100), (3, 3)])
def test_loss_curves_keep_every_coinciding_curve_visible(tmp_path: Path, jobs: int, points: int) -> None:
    """Jobs that train identically: every job's colour shows along the curves (the legend removed), in many pixels."""
    import matplotlib.pyplot as plt
    from PIL import Image

    series = [(2 * i, 4.0 - 0.01 * i) for i in range(points)]
    fig = figures.loss_curves_figure([_loss_job(str(k), f"s{k}", list(series)) for k in range(jobs)])
    try:
        ax = fig.axes[0]
        assert all((line.get_marker() == "None") == (points > figures.MARKER_MAX_POINTS) for line in ax.get_lines())
        ax.get_legend().remove()
        fig.savefig(tmp_path / "curves.png", dpi=110)
    finally:
        plt.close(fig)
    with Image.open(tmp_path / "curves.png") as image:
        rgb = image.convert("RGB")
        counts = {color: n for n, color in rgb.getcolors(maxcolors=rgb.width * rgb.height)}
    pixels = {name: counts.get(TAB10[name], 0) for name in list(TAB10)[:jobs]}
    assert min(pixels.values()) >= 100, pixels


# ----------------------------------------------------------------------------------------------------- heat map
AGGREGATORS, ATTACKS, SPLITS = ("mean", "median"), ("null", "sign_flip", "ipm"), ("iid", "label_sorted")
FAILED = ("label_sorted", "median", "ipm")  # the one job that died before logging
HEATMAP_ARGS = ["--heatmap", "strategy.aggregator", "strategy.attack", "--facet", "data.worker_split"]
LIGHTGREY = (0xD3, 0xD3, 0xD3)  # matplotlib's "lightgrey": the n/a cells


def _acc(split: str, aggregator: str, attack: str) -> float:
    """A distinct final val/acc per cell: 0.5, plus 0.1 per aggregator, 0.01 per attack, 0.2 for label_sorted."""
    return 0.5 + 0.1 * AGGREGATORS.index(aggregator) + 0.01 * ATTACKS.index(attack) + 0.2 * SPLITS.index(split)


@pytest.fixture
def robust_sweep(tmp_path: Path) -> Path:
    """The 12 jobs of ``-m experiment=robust_digits strategy.aggregator=mean,median strategy.attack=null,sign_flip,ipm
    data.worker_split=iid,label_sorted`` (Hydra's job order: the last key varies fastest); val/acc logged three times,
    the last value being the final one. No run_stats.json: the jobs are "incomplete", their metrics still count."""
    root = tmp_path / "multiruns" / "robust"
    root.mkdir(parents=True)
    num = 0
    for aggregator in AGGREGATORS:
        for attack in ATTACKS:
            for split in SPLITS:
                job = root / str(num)
                num += 1
                overrides = [
                    "experiment=robust_digits",
                    f"strategy.aggregator={aggregator}",
                    f"strategy.attack={attack}",
                    f"data.worker_split={split}",
                ]
                _hydra_files(job, overrides, "lightning_zero.RobustDDPStrategy")
                if (split, aggregator, attack) == FAILED:
                    continue
                logger = CSVLogger(job, name="csv", version="")
                for step, acc in ((49, 0.1), (99, 0.2), (149, _acc(split, aggregator, attack))):
                    logger.log_metrics({"train/loss": 1.0, "epoch": 0}, step=step)
                    logger.log_metrics({"val/acc": acc, "val/loss": 1.0 - acc, "epoch": 0}, step=step)
                logger.save()
                logger.finalize("success")
    return root


def test_pivot_values_order_and_failed_job(robust_sweep: Path) -> None:
    jobs = sweep_results.collect(robust_sweep)
    panels = sweep_results.pivot(jobs, "strategy.aggregator", "strategy.attack", "val/acc", "data.worker_split")
    assert list(panels) == list(SPLITS)
    for split, panel in panels.items():
        assert (panel.rows, panel.cols) == (list(AGGREGATORS), list(ATTACKS))
        for aggregator in AGGREGATORS:
            for attack in ATTACKS:
                value = panel.cells[aggregator, attack]
                if (split, aggregator, attack) == FAILED:
                    assert value is None and panel.jobs[aggregator, attack] == ["11"]
                else:
                    assert value == pytest.approx(_acc(split, aggregator, attack))
    # Without a facet the two splits share a cell: the mean, over the jobs that logged the metric.
    [(facet, flat)] = sweep_results.pivot(jobs, "strategy.aggregator", "strategy.attack", "val/acc").items()
    assert facet is None and flat.jobs["median", "ipm"] == ["10", "11"]
    assert flat.cells["mean", "sign_flip"] == pytest.approx((_acc("iid", "mean", "sign_flip") + 0.71) / 2)
    assert flat.cells["median", "ipm"] == pytest.approx(_acc("iid", "median", "ipm"))  # job 11 failed


def test_pivot_missing_override_is_default() -> None:
    def job(name: str, overrides: list[str], acc: float) -> sweep_results.JobResult:
        return sweep_results.JobResult(job=name, path=Path(name), overrides=overrides, metrics={"val/acc": [(9, acc)]})

    jobs = [
        job("0", ["strategy.attack=ipm"], 0.3),  # aggregator: the config's default
        job("1", ["strategy.aggregator=krum", "+strategy.attack=alie"], 0.4),
        job("2", ["strategy.aggregator=krum", "strategy.attack=ipm", "strategy.attack=alie"], 0.6),  # last one wins
    ]
    [panel] = sweep_results.pivot(jobs, "strategy.aggregator", "strategy.attack", "val/acc").values()
    assert (panel.rows, panel.cols) == (["default", "krum"], ["ipm", "alie"])
    assert panel.cells == {("default", "ipm"): 0.3, ("default", "alie"): None, ("krum", "ipm"): None,
                           ("krum", "alie"): pytest.approx(0.5)}  # fmt: skip


def test_pivot_bad_keys_and_metric(robust_sweep: Path) -> None:
    jobs = sweep_results.collect(robust_sweep)
    with pytest.raises(sweep_results.ReportError, match=r"row key 'strategy.agg' is not overridden by any job") as err:
        sweep_results.pivot(jobs, "strategy.agg", "strategy.attack", "val/acc")
    assert "'experiment', 'strategy.aggregator', 'strategy.attack', 'data.worker_split'" in str(err.value)
    with pytest.raises(sweep_results.ReportError, match=r"facet key 'seed' is not overridden"):
        sweep_results.pivot(jobs, "strategy.aggregator", "strategy.attack", "val/acc", "seed")
    with pytest.raises(sweep_results.ReportError, match=r"must differ"):
        sweep_results.pivot(jobs, "strategy.attack", "strategy.attack", "val/acc")
    with pytest.raises(
        sweep_results.ReportError, match=r"metric 'val/accuracy' was not logged by any job: .*'val/acc'"
    ):
        sweep_results.pivot(jobs, "strategy.aggregator", "strategy.attack", "val/accuracy")


def test_heatmap_report_files(robust_sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert report.main([str(robust_sweep), "--out", str(out), *HEATMAP_ARGS, "--metric", "val/acc"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert str(out / "heatmap.png") in printed and str(out / "heatmap.csv") in printed
    assert {"heatmap.csv", "heatmap.png", "report.csv", "report.md"} <= {p.name for p in out.iterdir()}

    md = (out / "report.md").read_text()
    section = md[md.index("## Heat map: val/acc") :]
    assert section.index("### data.worker_split=iid") < section.index("### data.worker_split=label_sorted")
    header = "| strategy.aggregator \\ strategy.attack | null | sign_flip | ipm |"
    assert section.count(header) == 2
    assert "| mean | 0.500 | 0.510 | 0.520 |" in section and "| median | 0.600 | 0.610 | 0.620 |" in section
    label_sorted = section[section.index("### data.worker_split=label_sorted") :]
    assert "| mean | 0.700 | 0.710 | 0.720 |" in label_sorted and "| median | 0.800 | 0.810 | n/a |" in label_sorted
    assert "![heatmap](heatmap.png)" in section

    rows = _read_csv(out / "heatmap.csv")
    assert list(rows[0]) == [
        "data.worker_split",
        "strategy.aggregator",
        "strategy.attack=null",
        "strategy.attack=sign_flip",
        "strategy.attack=ipm",
    ]
    assert [(r["data.worker_split"], r["strategy.aggregator"]) for r in rows] == [
        (s, a) for s in SPLITS for a in AGGREGATORS
    ]
    assert float(rows[3]["strategy.attack=sign_flip"]) == pytest.approx(0.81) and rows[3]["strategy.attack=ipm"] == ""

    _png(out / "heatmap.png", ())
    from PIL import Image

    with Image.open(out / "heatmap.png") as image:
        rgb = image.convert("RGB")
        assert LIGHTGREY in {c for _, c in rgb.getcolors(maxcolors=rgb.width * rgb.height)}  # the n/a cell


def test_heatmap_without_facet_or_plots(robust_sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "flat"
    written = report.write_report(
        robust_sweep, out, plots=False, heatmap=("strategy.attack", "data.worker_split"), metric="val/loss"
    )
    assert "heatmap.csv" in written and "heatmap.png" not in written and not (out / "heatmap.png").exists()
    md = (out / "report.md").read_text()
    assert "## Heat map: val/loss" in md and "###" not in md and "![heatmap]" not in md
    assert "| strategy.attack \\ data.worker_split | iid | label_sorted |" in md
    assert "| ipm | 0.430 | 0.280 |" in md  # iid: both aggregators' mean; label_sorted: median/ipm failed
    assert "Means over several jobs: null / iid: jobs 0, 6;" in md


def test_heatmap_cli_errors(robust_sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bad"
    args = [str(robust_sweep), "--out", str(out), "--heatmap", "strategy.aggregator", "strategy.atack"]
    assert report.main(args) == 1
    err = capsys.readouterr().err
    assert "column key 'strategy.atack' is not overridden by any job" in err and "'strategy.attack'" in err
    assert not out.exists()  # nothing written for a mistyped key
    with pytest.raises(SystemExit):
        report.main([str(robust_sweep), "--facet", "data.worker_split"])
    assert "--facet and --metric need --heatmap ROW COL" in capsys.readouterr().err
