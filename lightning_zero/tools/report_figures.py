"""The figures of ``lightning-zero-report`` (:mod:`lightning_zero.tools.report`): loss curves per job (coinciding
curves in alternating dashes, so parity between strategies does not hide one behind another), step time and
model-state memory per job and rank, and the heat map of one metric over two settings. They need matplotlib (the
``report`` extra); the tables do not.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_zero.tools.sweep_results import (
    BREAKDOWN,
    MIB,
    NA,
    JobResult,
    Pivot,
    ReportError,
    Series,
    common_overrides,
    varying_overrides,
)

INSTALL_HINT = (
    'plots need matplotlib: pip install "lightning-zero[report]"; the tables (report.csv, report.md) are written, and'
    " --no-plots writes them alone without this error"
)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ReportError(INSTALL_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _plot_label(job: JobResult, common: Sequence[str]) -> str:
    """``"<job>: <overrides that differ between jobs>"`` (all of a lone job's overrides)."""
    own = varying_overrides(job, common)
    return _short(f"{job.job}: {' '.join(own) or '(no overrides)'}")


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
COINCIDE_REL_TOL = 1e-3  # a 0.1% difference is below a pixel on a loss plot: such curves hide each other
MARKER_MAX_POINTS = 60  # series with at most this many points get a marker on every point
LINE_WIDTH = 1.6
DASH = 4.0  # one curve's turn in an alternating-dash line, in line widths
MARKER_SIZE = {"train": 4.0, "val": 6.5}  # val markers are hollow and larger: they ring the train markers
MARKER_STEP = 2.5  # coinciding markers shrink by this much per curve drawn over them, so each shows as a ring
WIDE_JOBS = 12  # past this many jobs the step-time figure turns its labels upright
FIGURE_MAX_WIDTH = 40.0  # inches: the step-time figure widens by 1.9 per job up to this


def coincide(a: Series, b: Series, rel_tol: float = COINCIDE_REL_TOL) -> bool:
    """Whether two ``(step, value)`` series would hide each other on a plot: they share at least one step, and at
    every shared step the values are equal within ``rel_tol`` (relative to the larger magnitude; NaN matches NaN,
    neither is drawn). Steps only one of them logged do not count: a short run that matches the start of a longer
    one lies under it."""
    other = dict(b)
    shared = [(x, other[step]) for step, x in a if step in other]
    return bool(shared) and all(
        math.isclose(x, y, rel_tol=rel_tol) or (math.isnan(x) and math.isnan(y)) for x, y in shared
    )


def coincident_groups(series: Mapping[str, Series], rel_tol: float = COINCIDE_REL_TOL) -> list[list[str]]:
    """The names of ``series`` grouped so that curves that :func:`coincide` share a group: the connected components
    of "coincides with" (a short run matching the start of two diverging runs joins them). Every name is in one
    group; groups are ordered by their first name, names in the order of ``series``."""
    values = list(series.values())
    groups: list[list[int]] = []
    for j, s in enumerate(values):
        touching = [g for g in groups if any(coincide(values[i], s, rel_tol) for i in g)]
        groups = [g for g in groups if g not in touching] + [sorted([j, *(i for g in touching for i in g)])]
    names = list(series)
    return [[names[i] for i in g] for g in sorted(groups)]


def _dashes(index: int, size: int, gap: int) -> tuple[float, tuple[float, float]]:
    """The line style of curve ``index`` of ``size`` coinciding ones: dashes that take turns with the others' (then
    ``gap`` empty turns), so that each curve shows its own colour in its turns wherever they overlap."""
    period = (size + gap) * DASH
    return (period - index * DASH) % period, (DASH, period - DASH)


def loss_curves_figure(jobs: Sequence[JobResult]) -> Any:
    """The figure of :func:`plot_loss_curves` (the caller closes it).

    Jobs are told apart by colour and marker. Curves that coincide (:func:`coincident_groups`, train and val loss
    separately) would hide each other, so they are drawn in alternating dashes, each curve in its own turns, their
    markers nested (each one smaller than the one it is drawn over); their legend entries name a job they coincide
    with (``"(train, = job 0)"``) and the title lists the groups. The data are drawn as logged, never offset.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 6), layout="constrained")
    common = common_overrides(jobs)
    plotted = [j for j in jobs if j.train_loss or j.val_loss]
    order = {j.job: k for k, j in enumerate(plotted)}
    entries: dict[tuple[int, str], tuple[Any, str]] = {}  # (job's place, kind) -> legend proxy and text
    notes = []
    for kind in ("train", "val"):
        series = {j.job: s for j in plotted if (s := j.train_loss if kind == "train" else j.val_loss)}
        for group in coincident_groups(series):
            if len(group) > 1:
                notes.append(f"{len(group)} {kind}-loss curves (jobs {', '.join(group)})")
            for index, name in enumerate(group):
                k = order[name]
                color, marker = f"C{k % 10}", MARKERS[k % len(MARKERS)]
                steps, values = zip(*series[name])
                gap = 0 if kind == "train" else 1  # val: dashed even alone, told from train by its gaps
                style = "-" if gap == 0 and index == 0 else _dashes(index, len(group), gap)
                mark = marker if len(steps) <= MARKER_MAX_POINTS else "None"
                size = MARKER_SIZE[kind] + MARKER_STEP * (len(group) - 1 - index)
                fill = color if kind == "train" else "none"
                what = kind
                if index > 0:
                    what += f", = job {next(o for o in group if o != name and coincide(series[o], series[name]))}"
                text = f"{_plot_label(plotted[k], common)} ({what})"
                ax.plot(steps, values, color=color, lw=LINE_WIDTH, ls=style, marker=mark, ms=size, mfc=fill,
                        mew=1.5, label=text)  # fmt: skip
                proxy = plt.Line2D([], [], color=color, lw=LINE_WIDTH, ls="-" if kind == "train" else "--",
                                   marker=mark, ms=MARKER_SIZE[kind], mfc=fill, mew=1.5)  # fmt: skip
                entries[k, kind] = proxy, text
    title = "Loss by job"
    if common:
        title += "\n" + _short("every job: " + " ".join(common), 110)
    if notes:
        within = f"equal within {100 * COINCIDE_REL_TOL:g}% at every shared step, drawn in alternating dashes"
        title += "\n" + textwrap.fill(f"Coinciding ({within}): {'; '.join(notes)}", 110)
    ax.set_title(title, fontsize=10)
    ax.set(xlabel="optimizer step", ylabel="loss")
    ax.grid(alpha=0.3)
    missing = [j.job for j in jobs if not j.train_loss and not j.val_loss]
    if missing:
        note = f"no loss logged: job {', '.join(missing)}"
        ax.text(0.99, 0.01, note, ha="right", va="bottom", transform=ax.transAxes, fontsize=8, color="C3")
    if plotted:  # proxies: a legend sample of a dashed curve could fall in the other curves' turns and show nothing
        handles, texts = zip(*(entries[key] for key in sorted(entries)))
        ax.legend(handles, texts, fontsize=8)
    else:
        ax.text(0.5, 0.5, "no loss logged by any job", ha="center", va="center", transform=ax.transAxes)
    return fig


def plot_loss_curves(jobs: Sequence[JobResult], path: Path) -> None:
    """Train loss against step, one line per job (labelled by its overrides); validation loss dashed, with hollow
    markers. Series of at most ``MARKER_MAX_POINTS`` points are marked at every point; coinciding curves stay
    visible (:func:`loss_curves_figure`)."""
    fig = loss_curves_figure(jobs)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def _bar_label(job: JobResult, common: Sequence[str]) -> str:
    lines = [f"{job.job}: {job.strategy or '?'}"]
    lines += [_short(o, 28) for o in varying_overrides(job, common) if not o.lstrip("+~").startswith("strategy=")][:2]
    if job.status != "ok":
        lines.append(f"({job.status})")
    return "\n".join(lines)


def _natural(text: str) -> tuple[Any, ...]:
    """A sort key that orders the numbers inside ``text`` by value: ``seed=2`` before ``seed=10``."""
    return tuple(int(part) if k % 2 else part for k, part in enumerate(re.split(r"(\d+)", text)))


def figure_order(jobs: Sequence[JobResult]) -> list[JobResult]:
    """The jobs in the order the step-time figure draws them: by strategy, then by their other varying overrides, then
    by job number. Two sweeps of the same settings draw the same order, however their command lines listed them."""
    common = common_overrides(jobs)

    def key(job: JobResult) -> tuple[Any, ...]:
        others = [o for o in varying_overrides(job, common) if not o.lstrip("+~").startswith("strategy=")]
        return _natural(job.strategy or "~"), [_natural(o) for o in others], _natural(job.job)

    return sorted(jobs, key=key)


def _spread(job: JobResult, rank: int) -> dict[str, float] | None:
    """Rank ``rank``'s step-time quantiles; a file without them (or a rank without measured steps) gives its median
    alone as a flat box, or ``None``."""
    quantiles = job.step_time_ms_per_rank[rank] if rank < len(job.step_time_ms_per_rank) else None
    if quantiles:
        return quantiles
    median = job.median_step_time_ms_per_rank[rank]
    return None if median is None else dict.fromkeys(("min", "q1", "median", "q3", "max"), median)


def _mib_label(totals: Sequence[float]) -> str:
    low, high = min(totals), max(totals)
    return f"{high:.3g}" if f"{low:.3g}" == f"{high:.3g}" else f"{low:.3g}-{high:.3g}"


def step_time_memory_figure(jobs: Sequence[JobResult]) -> Any:
    """The figure of :func:`plot_step_time_memory` (the caller closes it).

    Two panels over one x axis, a slot per job in :func:`figure_order`. Top: each rank's optimizer-step time over
    its measured steps as a box (quartiles, the median across it, whiskers from min to max), so the noise of the
    run shows beside any difference between jobs. Bottom: each rank's peak model-state MiB, stacked by kind. One
    value per job and panel, above its slot (the slowest rank's median ms; the ranks' peak MiB, a range where they
    differ), and the legends beside the axes, so no text lies over another or over a bar. The figure widens with
    the number of jobs (labels turn upright past ``WIDE_JOBS``).
    """
    plt = _pyplot()
    from matplotlib.patches import Patch

    jobs = figure_order(jobs)
    n = max(1, len(jobs))
    wide = n > WIDE_JOBS
    fig, (ax_t, ax_m) = plt.subplots(
        2, 1, figsize=(min(FIGURE_MAX_WIDTH, max(10.0, 1.9 * n + 2.5)), 8.5), sharex=True, layout="constrained"
    )
    common = common_overrides(jobs)
    most_ranks = max((max(len(j.median_step_time_ms_per_rank), len(j.peak_bytes_per_rank)) for j in jobs), default=1)
    cmap = plt.get_cmap("viridis")  # ranks in viridis shades, not the tab10 colours of the memory breakdown
    shade = [cmap(0.85 * r / max(1, most_ranks - 1)) for r in range(most_ranks)]
    value_style = {"ha": "center", "va": "bottom", "fontsize": 8, "rotation": 90 if wide else 0}
    top_t = top_m = 0.0
    for x, j in enumerate(jobs):
        ranks = len(j.median_step_time_ms_per_rank)
        w = 0.8 / max(1, ranks)
        for r in range(ranks):
            spread = _spread(j, r)
            if spread is None:
                continue
            stats = {"med": spread["median"], "q1": spread["q1"], "q3": spread["q3"], "whislo": spread["min"],
                     "whishi": spread["max"], "fliers": []}  # fmt: skip
            drawn = ax_t.bxp([stats], positions=[x - 0.4 + w * (r + 0.5)], widths=w * 0.7, patch_artist=True,
                             medianprops={"color": "black"}, manage_ticks=False)  # fmt: skip
            drawn["boxes"][0].set_facecolor(shade[r])
        medians = [m for m in j.median_step_time_ms_per_rank if m is not None]
        if medians:
            highest = max(s["max"] for r in range(ranks) if (s := _spread(j, r)))
            ax_t.annotate(f"{max(medians):.3g} ms", (x, highest), xytext=(0, 3), textcoords="offset points",
                          **value_style)  # fmt: skip
            top_t = max(top_t, highest)
        else:
            ax_t.text(x, 0, "no run_stats.json", **{**value_style, "va": "bottom"})
    ax_t.set_title("Optimizer-step time per rank over its measured steps (warm-up dropped)\nbox: quartiles, line: "
                   "median, whiskers: min to max; value: the slowest rank's median", fontsize=10)  # fmt: skip
    ax_t.set_ylabel("ms")
    colors = {"params": "C0", "grads": "C1", "optimizer": "C2", "strategy_buffers": "C7"}
    drawn_kinds: set[str] = set()
    for x, j in enumerate(jobs):
        w = 0.8 / max(1, len(j.peak_bytes_per_rank))
        totals = []
        for r, b in enumerate(j.peak_bytes_per_rank):
            if not b:
                continue
            pos, bottom = x - 0.4 + w * (r + 0.5), 0.0
            for kind in BREAKDOWN:
                height = b.get(kind, 0) / MIB
                if height > 0:
                    ax_m.bar(pos, height, w * 0.9, bottom=bottom, color=colors[kind], edgecolor=shade[r], lw=1.2)
                    drawn_kinds.add(kind)
                bottom += height
            totals.append(bottom)
        if totals:
            ax_m.annotate(f"{_mib_label(totals)} MiB", (x, max(totals)), xytext=(0, 3), textcoords="offset points",
                          **value_style)  # fmt: skip
            top_m = max(top_m, max(totals))
        else:
            ax_m.text(x, 0, "no memory measured", **value_style)
    ax_m.set_title("Peak model-state MiB per rank (after an optimizer step)\nstacked by kind, ranks left to right",
                   fontsize=10)  # fmt: skip
    ax_m.set_ylabel("MiB")
    ax_m.set_xticks(range(len(jobs)), [_bar_label(j, common) for j in jobs], fontsize=8,
                    rotation=90 if wide else 0)  # fmt: skip
    ax_m.set_xlim(-0.6, len(jobs) - 0.4)
    headroom = 1.35 if wide else 1.15  # room for the value above the tallest slot
    for ax, top in ((ax_t, top_t), (ax_m, top_m)):
        ax.set_ylim(0, top * headroom if top > 0 else 1)
        ax.grid(axis="y", alpha=0.3)
    rank_handles = [Patch(facecolor=shade[r], edgecolor="black", label=f"rank {r}") for r in range(most_ranks)]
    if any(j.median_step_time_ms_per_rank for j in jobs):
        ax_t.legend(handles=rank_handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    kinds = [
        Patch(facecolor=colors[k], edgecolor="black", label=k.replace("_", " ")) for k in BREAKDOWN if k in drawn_kinds
    ]
    if kinds:
        ax_m.legend(handles=kinds, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    if not any(j.median_step_time_ms_per_rank for j in jobs):
        ax_t.text(0.5, 0.5, "no run_stats.json in any job", ha="center", va="center", transform=ax_t.transAxes)
    return fig


def plot_step_time_memory(jobs: Sequence[JobResult], path: Path) -> None:
    """Step-time spread and peak model-state MiB per job and rank (:func:`step_time_memory_figure`)."""
    fig = step_time_memory_figure(jobs)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def plot_heatmap(
    panels: dict[str | None, Pivot],
    path: Path,
    row_key: str,
    col_key: str,
    metric: str,
    facet_key: str | None = None,
) -> None:
    """One heat map panel per facet value on one colour scale (one colorbar), each cell's value written in it;
    cells without a value greyed and marked ``n/a``."""
    plt = _pyplot()
    import numpy as np

    first = next(iter(panels.values()))
    n_rows, n_cols = len(first.rows), len(first.cols)
    found = [v for panel in panels.values() for v in panel.cells.values() if v is not None]
    low, high = (min(found), max(found)) if found else (0.0, 1.0)
    if high - low < 1e-12:  # one value: a zero-width scale would map everything to the bottom colour
        low, high = low - 0.5, high + 0.5
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")
    width = max(7.0, len(panels) * (1.2 * n_cols + 2.0) + 1.5)
    height = max(4.5, 0.6 * n_rows + 2.8)
    fig, axes = plt.subplots(1, len(panels), figsize=(width, height), layout="constrained", squeeze=False)
    image = None
    for ax, (facet, panel) in zip(axes[0], panels.items()):
        grid = np.array(
            [[np.nan if panel.cells[r, c] is None else panel.cells[r, c] for c in panel.cols] for r in panel.rows]
        )
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=low, vmax=high, aspect="auto")
        for i in range(n_rows):
            for j in range(n_cols):
                value = grid[i, j]
                if np.isnan(value):
                    ax.text(j, i, NA, ha="center", va="center", fontsize=9, color="dimgray")
                else:  # dark text on viridis' bright (yellow) end, light text on its dark end
                    color = "black" if (value - low) / (high - low) > 0.6 else "white"
                    ax.text(j, i, f"{value:.3f}", ha="center", va="center", fontsize=9, color=color)
        ax.set_xticks(range(n_cols), panel.cols)
        ax.set_yticks(range(n_rows), panel.rows)
        ax.set(xlabel=col_key, ylabel=row_key)
        if facet_key is not None:
            ax.set_title(f"{facet_key}={facet}", fontsize=10)
    assert image is not None
    fig.colorbar(image, ax=axes[0].tolist(), label=metric)
    fig.suptitle(f"{metric} (last logged value per job)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
