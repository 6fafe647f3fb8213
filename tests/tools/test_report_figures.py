"""The step-time and memory figure of ``lightning-zero-report``: its job order, its boxes, and that no text overlaps."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lightning_zero.tools import report_figures as figures
from lightning_zero.tools import sweep_results

pytest.importorskip("matplotlib")  # the report extra, which the test extra installs

MIB = 2**20
STRATEGIES = ("zero3_scratch", "ddp", "zero1_scratch", "zero2_scratch", "ddp_scratch")


def _job(name: str, strategy: str, ranks: int, extra: list[str], spread: bool = True) -> sweep_results.JobResult:
    """A job as :func:`sweep_results.collect` reads it: per-rank step-time quantiles (unless ``spread`` is off: an
    older ``run_stats.json``) and a per-rank memory breakdown, from a seeded draw."""
    draw = random.Random(f"{name}-{strategy}")
    times, medians, peaks = [], [], []
    for r in range(ranks):
        low = 5 + 20 * draw.random()
        q1, median, q3 = sorted(low + 10 * draw.random() for _ in range(3))
        times.append({"min": low, "q1": q1, "median": median, "q3": q3, "max": q3 + 10 * draw.random()})
        medians.append(median)
        shard = int(4 * MIB / (1 if strategy == "ddp" else ranks)) + 512 * r
        peaks.append({"params": shard, "grads": shard, "optimizer": 2 * shard, "strategy_buffers": shard // 4})
    return sweep_results.JobResult(
        job=name, path=Path(name), overrides=[f"strategy={strategy}", *extra, "trainer.max_steps=200"],
        strategy=strategy, median_step_time_ms_per_rank=medians, step_time_ms_per_rank=times if spread else [],
        peak_bytes_per_rank=peaks,
    )  # fmt: skip


def _sweep(n: int, ranks: int, extra: int = 0) -> list[sweep_results.JobResult]:
    """``n`` jobs cycling through the strategies; ``extra`` varying overrides each, long ones."""
    return [
        _job(str(k), STRATEGIES[k % len(STRATEGIES)], ranks,
             [f"model.some_long_setting_{e}=value_{k}_{'x' * 20}" for e in range(extra)])
        for k in range(n)
    ]  # fmt: skip


@contextmanager
def _figure(jobs: list[sweep_results.JobResult]) -> Iterator[Any]:
    import matplotlib.pyplot as plt

    fig = figures.step_time_memory_figure(jobs)
    try:
        fig.canvas.draw()
        yield fig
    finally:
        plt.close(fig)


def _texts(fig: Any) -> list[tuple[str, Any]]:
    """Every visible text of the figure (titles, values, tick labels) and every legend, with its box in pixels."""
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        for text in [ax.title, *ax.texts, *ax.get_xticklabels(), *ax.get_yticklabels(), ax.yaxis.label]:
            if text.get_visible() and text.get_text():
                found.append((text.get_text(), text.get_window_extent(renderer)))
        if ax.get_legend() is not None:
            found.append(("legend", ax.get_legend().get_window_extent(renderer)))
    return found


@pytest.mark.parametrize(
    ("n", "ranks", "extra"), [(1, 2, 0), (3, 2, 2), (5, 2, 0), (5, 4, 2), (12, 4, 1), (13, 8, 2), (30, 2, 0)]
)
def test_no_text_overlaps_another_or_a_drawn_value(n: int, ranks: int, extra: int) -> None:
    with _figure(_sweep(n, ranks, extra)) as fig:
        renderer = fig.canvas.get_renderer()
        texts = _texts(fig)
        for (a, box_a), (b, box_b) in itertools.combinations(texts, 2):
            assert not box_a.overlaps(box_b), f"{a!r} overlaps {b!r}"
        for name, box in texts:  # nothing cut off at the figure's edge
            assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and box.y0 >= fig.bbox.y0, name
            assert box.y1 <= fig.bbox.y1, name
        for ax in fig.axes:  # no value over a bar, a box or a whisker
            drawn = [a.get_window_extent(renderer) for a in [*ax.patches, *ax.lines]]
            for text in ax.texts:
                box = text.get_window_extent(renderer)
                assert not any(box.overlaps(d) for d in drawn), f"{text.get_text()!r} lies over the data"
                assert ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1), text.get_text()


def test_jobs_are_drawn_in_one_order_however_the_sweep_listed_them() -> None:
    jobs = [
        _job("0", "zero2_scratch", 2, []),
        _job("1", "ddp_scratch", 2, ["seed=10"]),
        _job("2", "ddp", 2, []),
        _job("3", "ddp_scratch", 2, ["seed=2"]),
    ]
    expected = ["2", "3", "1", "0"]  # by strategy, then seed=2 before seed=10 (by value), whatever the job numbers
    assert [j.job for j in figures.figure_order(jobs)] == expected
    assert [j.job for j in figures.figure_order(jobs[::-1])] == expected
    with _figure(jobs[::-1]) as fig:
        labels = [t.get_text().split("\n")[0] for t in fig.axes[1].get_xticklabels()]
    assert labels == ["2: ddp", "3: ddp_scratch", "1: ddp_scratch", "0: zero2_scratch"]


def test_each_rank_is_a_box_of_its_quartiles_with_min_max_whiskers() -> None:
    jobs = [_job("0", "ddp", 2, []), _job("1", "zero3_scratch", 3, [])]
    with _figure(jobs) as fig:
        ax_t = fig.axes[0]
        boxes = [p.get_path().get_extents() for p in ax_t.patches]
        ys = sorted({round(y, 9) for line in ax_t.lines for y in line.get_ydata()})
        values = [t.get_text() for t in ax_t.texts]
    spreads = [s for j in jobs for s in j.step_time_ms_per_rank]
    assert len(boxes) == len(spreads) == 5
    assert [(round(b.y0, 9), round(b.y1, 9)) for b in boxes] == [
        (round(s["q1"], 9), round(s["q3"], 9)) for s in spreads
    ]
    for s in spreads:  # the whiskers end at the fastest and the slowest step, the median is drawn across the box
        assert {round(s[q], 9) for q in ("min", "median", "max")} <= set(ys)
    assert values == [f"{max(j.median_step_time_ms_per_rank):.3g} ms" for j in jobs]  # the slowest rank's median


def test_an_older_run_stats_file_draws_its_medians_flat() -> None:
    """A ``run_stats.json`` without ``step_time_ms`` (written before the spread was recorded) still plots."""
    jobs = [_job("0", "ddp", 2, [], spread=False), _job("1", "ddp_scratch", 2, [])]
    with _figure(jobs) as fig:
        flat = [p.get_path().get_extents() for p in fig.axes[0].patches][:2]
    assert [(b.y0, b.y1) for b in flat] == pytest.approx([(m, m) for m in jobs[0].median_step_time_ms_per_rank])


def test_memory_values_name_the_range_of_the_ranks() -> None:
    def job(name: str, mib: list[float]) -> sweep_results.JobResult:
        peaks = [{"params": int(m * MIB / 2), "optimizer": int(m * MIB / 2)} for m in mib]
        return sweep_results.JobResult(job=name, path=Path(name), overrides=[f"strategy=s{name}"],
                                       strategy=f"s{name}", peak_bytes_per_rank=peaks)  # fmt: skip

    with _figure([job("0", [3.0, 3.0]), job("1", [1.25, 1.5, 1.25]), job("2", [])]) as fig:
        values = [t.get_text() for t in fig.axes[1].texts]
    assert values == ["3 MiB", "1.25-1.5 MiB", "no memory measured"]
