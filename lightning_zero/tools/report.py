"""``lightning-zero-report`` (also ``python -m lightning_zero.tools.report``): tables and plots of a Hydra multirun.

Runbook::

    lightning-zero-train -m strategy=ddp_scratch,zero3_scratch trainer=cpu trainer.max_steps=100
    lightning-zero-report outputs/multiruns/<stamp>             # writes report.md, report.csv and the plots there
    lightning-zero-report outputs/runs/<stamp> --out /tmp/rep   # a single run dir works too

    # A robustness grid: final val/acc by aggregator x attack, one panel per data split.
    lightning-zero-train -m experiment=robust_digits strategy.aggregator=mean,median,krum \
        strategy.attack=null,sign_flip,ipm data.worker_split=iid,label_sorted
    lightning-zero-report outputs/multiruns/<stamp> --heatmap strategy.aggregator strategy.attack \
        --facet data.worker_split --metric val/acc

Which dirs are jobs, which files are read and what a job's status means: :mod:`lightning_zero.tools.sweep_results`.

Outputs (in ``--out``, default the given dir): ``report.csv`` (every column), ``report.md`` (the main columns, the
per-rank breakdown, problems, the plots), ``loss_curves.png`` (train and validation loss against step per job; jobs
that train identically, as parity between strategies makes them, would hide each other's curves, so coinciding curves
are drawn in alternating dashes with nested markers and named in the legend and title) and ``step_time_memory.png``
(median step time and peak model-state MiB per job and rank, the latter split into params / grads / optimizer /
strategy buffers). Plots need matplotlib: ``pip install "lightning-zero[report]"``.

With ``--heatmap ROW COL`` (two override keys; ``--facet KEY`` for one panel per value of a third, ``--metric``,
default ``val/acc``): the last logged value of the metric per job, pivoted by the keys' values
(:func:`lightning_zero.tools.sweep_results.pivot`), as tables at the end of ``report.md``, as ``heatmap.csv`` and as
``heatmap.png``. ``n/a``: no such job, or it logged no value (it failed); ``default``: jobs that did not override
the key.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lightning_zero.tools.report_figures import plot_heatmap, plot_loss_curves, plot_step_time_memory
from lightning_zero.tools.sweep_results import (
    BREAKDOWN,
    MIB,
    NA,
    JobResult,
    Pivot,
    ReportError,
    collect,
    common_overrides,
    pivot,
    varying_overrides,
)

HEATMAP_PNG, HEATMAP_CSV = "heatmap.png", "heatmap.csv"


# ----------------------------------------------------------------------------------------------------- tables
def _val_keys(jobs: Iterable[JobResult]) -> list[str]:
    return sorted({k for j in jobs for k in j.val_keys})


def _per_rank(values: Sequence[float | None]) -> str:
    return ";".join("" if v is None else repr(float(v)) for v in values)


def table_rows(jobs: Sequence[JobResult]) -> list[dict[str, Any]]:
    """One dict per job: the columns of ``report.csv`` (numbers as numbers, missing as ``None``)."""
    val_keys = _val_keys(jobs)
    rows = []
    for j in jobs:
        breakdown = j.peak_breakdown or {}
        row: dict[str, Any] = {
            "job": j.job,
            "status": j.status,
            "overrides": " ".join(j.overrides),
            "strategy": j.strategy,
            "world_size": j.world_size,
            "optimizer_steps": j.optimizer_steps,
            "final_train_loss": j.final(j.train_loss_key),
        }
        row.update({f"final_{k}": j.final(k) for k in val_keys})
        row.update(
            {
                "median_step_time_ms": j.median_step_time_ms,
                "median_step_time_ms_per_rank": _per_rank(j.median_step_time_ms_per_rank),
                "peak_model_state_mib": j.peak_mib,
                "peak_model_state_mib_per_rank": _per_rank(j.peak_mib_per_rank),
            }
        )
        row.update({f"peak_{k}_mib": breakdown[k] / MIB if k in breakdown else None for k in BREAKDOWN})
        row["strategy_buffers_counted"] = j.strategy_buffers_counted
        row["problems"] = "; ".join(j.problems)
        row["job_dir"] = str(j.path)
        rows.append(row)
    return rows


def write_csv(jobs: Sequence[JobResult], path: Path) -> None:
    rows = table_rows(jobs)
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]) if rows else ["job"])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value).replace("|", "\\|")


def render_markdown(jobs: Sequence[JobResult], source: Path, plots: Sequence[str] = (), appendix: str = "") -> str:
    """``report.md``: the main table, per-rank model states, problems, the plots (relative links), ``appendix``."""
    val_keys = _val_keys(jobs)
    lines = [f"# Run report: {source}", ""]
    ok = sum(j.status == "ok" for j in jobs)
    lines += [f"{len(jobs)} job(s): {ok} ok, {len(jobs) - ok} failed or incomplete.", ""]
    common = common_overrides(jobs)
    if common:
        lines += [f"Overrides of every job: `{' '.join(common)}`; the table lists the others.", ""]
    header = ["job", "overrides", "strategy", "N", "status", "steps", "train loss"]
    header += [f"final {k}" for k in val_keys]
    header += ["median step ms", "peak model-state MiB (max)", "peak MiB per rank"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for j in jobs:
        own = varying_overrides(j, common)
        cells = [j.job, f"`{' '.join(own)}`" if own else "-", j.strategy, j.world_size, j.status]
        cells += [j.optimizer_steps, j.final(j.train_loss_key), *(j.final(k) for k in val_keys)]
        cells += [j.median_step_time_ms, j.peak_mib, " / ".join(_fmt(v) for v in j.peak_mib_per_rank) or None]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    lines.append("")
    lines.append("Median step ms: the slowest rank's median optimizer-step time (warm-up steps dropped).")
    lines.append("")

    measured = [j for j in jobs if any(b is not None for b in j.peak_bytes_per_rank)]
    if measured:
        lines += ["## Peak model states per rank (MiB)", ""]
        lines += ["| job | strategy | rank | step ms | params | grads | optimizer | strategy buffers | total |"]
        lines += ["|" + "---|" * 9]
        for j in measured:
            for rank, b in enumerate(j.peak_bytes_per_rank):
                ms = j.median_step_time_ms_per_rank[rank] if rank < len(j.median_step_time_ms_per_rank) else None
                parts = [b.get(k) / MIB if b and b.get(k) is not None else None for k in (*BREAKDOWN, "total")]
                lines.append("| " + " | ".join(_fmt(c) for c in (j.job, j.strategy, rank, ms, *parts)) + " |")
        hidden = [j.job for j in measured if j.strategy_buffers_counted is False]
        if hidden:
            lines += ["", f"Strategy buffers not visible from Python (e.g. torch DDP's C++ buckets): job {hidden}."]
        lines.append("")

    troubled = [j for j in jobs if j.problems]
    if troubled:
        lines += ["## Problems", ""]
        lines += [f"- job {j.job} ({j.status}): {'; '.join(j.problems)}" for j in troubled]
        lines.append("")
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{Path(p).stem}]({p})" for p in plots]
        lines.append("")
    if appendix:
        lines += [appendix.rstrip("\n"), ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- heat map
def _cell(value: float | None) -> str:
    return NA if value is None else f"{value:.3f}"


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|")


def render_pivots(
    panels: dict[str | None, Pivot],
    row_key: str,
    col_key: str,
    metric: str,
    facet_key: str | None = None,
    image: str | None = None,
) -> str:
    """The heat map section of ``report.md``: one markdown table per facet value (rows ``row_key``, columns
    ``col_key``, values with 3 decimals, ``n/a`` for missing or failed jobs), then ``image`` (a relative link)."""
    lines = [f"## Heat map: {metric}", ""]
    per = f", one table per `{facet_key}`" if facet_key is not None else ""
    lines += [
        f"The last logged `{metric}` of each job: rows `{row_key}`, columns `{col_key}`{per}. `n/a`: no such job,"
        f" or it logged no `{metric}`; `default`: the jobs did not override the key.",
        "",
    ]
    for facet, panel in panels.items():
        if facet_key is not None:
            lines += [f"### {facet_key}={facet}", ""]
        lines.append("| " + " | ".join(_md(h) for h in (f"{row_key} \\ {col_key}", *panel.cols)) + " |")
        lines.append("|" + "---|" * (len(panel.cols) + 1))
        for r in panel.rows:
            lines.append("| " + " | ".join(_md(c) for c in (r, *(_cell(panel.cells[r, c]) for c in panel.cols))) + " |")
        shared = [(cell, names) for cell, names in panel.jobs.items() if len(names) > 1]
        if shared:  # a key outside the pivot varies too (e.g. seed): say which cells are means
            lines += [
                "",
                "Means over several jobs: " + "; ".join(f"{r} / {c}: jobs {', '.join(n)}" for (r, c), n in shared),
            ]
        lines.append("")
    if image is not None:
        lines += [f"![{Path(image).stem}]({image})", ""]
    return "\n".join(lines)


def write_pivot_csv(
    panels: dict[str | None, Pivot], path: Path, row_key: str, col_key: str, facet_key: str | None = None
) -> None:
    """``heatmap.csv``: one line per facet value and row, one column per column value (``<col_key>=<value>``);
    empty cells for missing or failed jobs, as in ``report.csv``."""
    first = next(iter(panels.values()))
    header = [*([facet_key] if facet_key is not None else []), row_key, *(f"{col_key}={c}" for c in first.cols)]
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        for facet, panel in panels.items():
            for r in panel.rows:
                cells = ["" if panel.cells[r, c] is None else panel.cells[r, c] for c in panel.cols]
                writer.writerow([*([facet] if facet_key is not None else []), r, *cells])


# ----------------------------------------------------------------------------------------------------- CLI
PLOTS = {"loss_curves.png": plot_loss_curves, "step_time_memory.png": plot_step_time_memory}


def write_report(
    root: Path,
    out: Path | None = None,
    plots: bool = True,
    heatmap: tuple[str, str] | None = None,
    facet: str | None = None,
    metric: str = "val/acc",
) -> dict[str, Path]:
    """Parse ``root`` and write ``report.csv``, ``report.md`` and (``plots``) the PNGs into ``out`` (default ``root``).

    With ``heatmap=(row_key, col_key)`` (and optionally ``facet``) also the pivot of ``metric``: tables appended to
    ``report.md``, ``heatmap.csv`` and (``plots``) ``heatmap.png``.

    Returns the written files by name. Raises :class:`ReportError` for heat map keys or a metric the jobs lack
    (before anything is written), and (with the install hint) when plots are asked for and matplotlib is missing,
    after the tables are written.
    """
    root = Path(root).resolve()
    jobs = collect(root)
    if heatmap is None and facet is not None:
        raise ReportError(f"facet={facet!r} needs a heat map: pass heatmap=(row_key, col_key)")
    panels = pivot(jobs, heatmap[0], heatmap[1], metric, facet) if heatmap is not None else None
    out = Path(out) if out is not None else root
    out.mkdir(parents=True, exist_ok=True)
    written = {"report.csv": out / "report.csv"}
    write_csv(jobs, written["report.csv"])
    if panels is not None and heatmap is not None:
        written[HEATMAP_CSV] = out / HEATMAP_CSV
        write_pivot_csv(panels, written[HEATMAP_CSV], *heatmap, facet)
    plot_names: list[str] = []
    error: ReportError | None = None
    if plots:
        try:
            for name, plot in PLOTS.items():
                plot(jobs, out / name)
                written[name] = out / name
                plot_names.append(name)
            if panels is not None and heatmap is not None:
                plot_heatmap(panels, out / HEATMAP_PNG, *heatmap, metric, facet)
                written[HEATMAP_PNG] = out / HEATMAP_PNG
        except ReportError as err:
            error = err
    appendix = ""
    if panels is not None and heatmap is not None:
        appendix = render_pivots(panels, *heatmap, metric, facet, HEATMAP_PNG if HEATMAP_PNG in written else None)
    written["report.md"] = out / "report.md"
    written["report.md"].write_text(render_markdown(jobs, root, plot_names, appendix))
    if error is not None:
        raise error
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-zero-report", description="Tables and plots of a Hydra multirun (or one run) dir."
    )
    parser.add_argument("run_dir", type=Path, help="a multirun dir (<sweep dir> with job dirs 0, 1, ...) or a run dir")
    parser.add_argument("--out", type=Path, default=None, help="where to write the report (default: run_dir)")
    parser.add_argument("--no-plots", action="store_true", help="write the tables only, no PNGs")
    parser.add_argument(
        "--heatmap",
        nargs=2,
        metavar=("ROW", "COL"),
        default=None,
        help="two override keys (e.g. strategy.aggregator strategy.attack): a table and heat map of --metric by their"
        " values (report.md, heatmap.csv, heatmap.png)",
    )
    parser.add_argument("--facet", metavar="KEY", default=None, help="with --heatmap: one panel per value of KEY")
    parser.add_argument(
        "--metric",
        metavar="NAME",
        default=None,
        help="with --heatmap: the metric, its last logged value per job (default: val/acc)",
    )
    args = parser.parse_args(argv)
    if args.heatmap is None and (args.facet is not None or args.metric is not None):
        parser.error("--facet and --metric need --heatmap ROW COL")
    try:
        written = write_report(
            args.run_dir,
            args.out,
            plots=not args.no_plots,
            heatmap=(args.heatmap[0], args.heatmap[1]) if args.heatmap is not None else None,
            facet=args.facet,
            metric=args.metric if args.metric is not None else "val/acc",
        )
    except ReportError as err:
        print(f"lightning-zero-report: {err}", file=sys.stderr)
        return 1
    for path in written.values():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
