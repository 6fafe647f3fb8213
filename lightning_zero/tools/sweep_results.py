"""What the jobs of a Hydra multirun (or one run) left behind, parsed into :class:`JobResult` rows.

A job dir is a directory holding ``.hydra/overrides.yaml``, ``csv/metrics.csv`` (the CSV logger's file; any
``metrics.csv`` below the job dir is accepted) or ``run_stats.json`` (:class:`lightning_zero.RunStats`). The given dir
is one job dir, or its children are (Hydra's ``<sweep dir>/<job num>/``; numbered children without those files are
jobs that failed before writing anything), or else job dirs are searched for below it. Each job gives one row:

- ``status``: ``ok``; ``failed`` (no usable ``metrics.csv``: the job died before logging anything); ``incomplete``
  (metrics but no ``run_stats.json``: training did not reach its end, or ``RunStats`` was not enabled). ``problems``
  says what is missing or unreadable.
- overrides (``.hydra/overrides.yaml``), strategy (the ``strategy=`` override, else ``run_stats.json``'s name, else
  ``.hydra/config.yaml``'s target), world size (``run_stats.json``, else ``.hydra/config.yaml``), optimizer steps, the
  metric series of ``metrics.csv``, the median optimizer-step time (the slowest rank's median, and every rank's) and
  the peak model-state bytes per rank.

A sweep over several override keys is summarised by :func:`pivot`: the last logged value of one metric per job,
laid out by two keys' values (and one panel per value of a third), e.g. ``strategy.aggregator`` x
``strategy.attack`` per ``data.worker_split``. A key a job did not override has the value ``"default"``.

:mod:`lightning_zero.tools.report` turns the rows into tables and plots.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

RUN_STATS = "run_stats.json"
METRICS = Path("csv") / "metrics.csv"
OVERRIDES = Path(".hydra") / "overrides.yaml"
CONFIG = Path(".hydra") / "config.yaml"
TRAIN_LOSS_KEYS = ("train/loss", "train_loss", "train/loss_step", "train_loss_step", "loss")
VAL_LOSS_KEYS = ("val/loss", "val_loss")
BREAKDOWN = ("params", "grads", "optimizer", "strategy_buffers")
MIB = 2**20
NA = "n/a"  # how the report's tables and figures show a missing value
DEFAULT = "default"  # the pivot value of a key the job did not override: the config's default

Series = list[tuple[int, float]]


class ReportError(Exception):
    """A problem with the report's input or environment, reported as one message."""


@dataclass
class JobResult:
    """What one job dir holds, parsed. ``status`` is ``"ok"``, ``"failed"`` or ``"incomplete"``."""

    job: str
    path: Path
    status: str = "ok"
    problems: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    strategy: str | None = None
    world_size: int | None = None
    optimizer_steps: int | None = None
    metrics: dict[str, Series] = field(default_factory=dict)
    train_loss_key: str | None = None
    median_step_time_ms: float | None = None  # the slowest rank's median
    median_step_time_ms_per_rank: list[float | None] = field(default_factory=list)
    # {"min", "q1", "median", "q3", "max"} over each rank's measured steps (None: not measured, or an older file)
    step_time_ms_per_rank: list[dict[str, float] | None] = field(default_factory=list)
    peak_mib_per_rank: list[float | None] = field(default_factory=list)
    peak_bytes_per_rank: list[dict[str, int] | None] = field(default_factory=list)
    strategy_buffers_counted: bool | None = None

    @property
    def label(self) -> str:
        return f"{self.job}: {' '.join(self.overrides) or '(no overrides)'}"

    @property
    def train_loss(self) -> Series:
        return self.metrics.get(self.train_loss_key, []) if self.train_loss_key else []

    @property
    def val_loss(self) -> Series:
        return next((self.metrics[k] for k in VAL_LOSS_KEYS if k in self.metrics), [])

    @property
    def val_keys(self) -> list[str]:
        return sorted(k for k in self.metrics if k.startswith(("val/", "val_")))

    def final(self, key: str | None) -> float | None:
        series = self.metrics.get(key, []) if key else []
        return series[-1][1] if series else None

    @property
    def peak_mib(self) -> float | None:
        peaks = [p for p in self.peak_mib_per_rank if p is not None]
        return max(peaks) if peaks else None

    @property
    def peak_breakdown(self) -> dict[str, int] | None:
        """The breakdown of the rank with the largest peak."""
        rows = [b for b in self.peak_bytes_per_rank if b is not None]
        return max(rows, key=lambda b: b.get("total", 0)) if rows else None


def read_metrics(path: Path) -> dict[str, Series]:
    """A CSVLogger ``metrics.csv``: ``{metric: [(step, value), ...]}`` in file order, empty cells skipped.

    The file has one column per metric plus ``step`` (and ``epoch``); each row holds what was logged at once.
    """
    series: dict[str, Series] = {}
    with path.open(newline="") as file:
        for row in csv.DictReader(file):
            step_text = (row.get("step") or "").strip()
            if not step_text:
                continue
            step = int(float(step_text))
            for key, text in row.items():
                if key in ("step", "epoch") or key is None or text is None or not text.strip():
                    continue
                try:
                    series.setdefault(key, []).append((step, float(text)))
                except ValueError:
                    continue  # a non-numeric cell: not a metric
    return series


def read_overrides(path: Path) -> list[str]:
    """Hydra's ``.hydra/overrides.yaml``: the job's command-line overrides, as strings."""
    import yaml

    data = yaml.safe_load(path.read_text())
    if data is None:
        return []
    if not isinstance(data, list):
        raise ValueError(f"expected a list of overrides, got {type(data).__name__}")
    return [str(o) for o in data]


def read_config(path: Path) -> dict[str, Any]:
    """Hydra's ``.hydra/config.yaml`` (the composed job config; interpolations left as written)."""
    import yaml

    data = yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else {}


def read_run_stats(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), list):
        raise ValueError("not a RunStats file (no 'ranks' list)")
    return data


def _pick_train_loss(metrics: dict[str, Series]) -> str | None:
    for key in TRAIN_LOSS_KEYS:
        if key in metrics:
            return key
    return next((k for k in sorted(metrics) if k.startswith("train") and "loss" in k), None)


def _strategy_from_config(config: dict[str, Any]) -> str | None:
    target = (config.get("strategy") or {}).get("_target_") if isinstance(config.get("strategy"), dict) else None
    if not isinstance(target, str):
        return None
    name = target.rsplit(".", 1)[-1]
    stage = config["strategy"].get("stage")
    return f"{name}(stage={stage})" if isinstance(stage, int) else name


def _world_size_from_config(config: dict[str, Any]) -> int | None:
    trainer = config.get("trainer")
    if not isinstance(trainer, dict):
        return None
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    if isinstance(devices, list):
        devices = len(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0 and isinstance(nodes, int):
        return devices * nodes
    return None


def _find_metrics(job_dir: Path) -> Path | None:
    if (job_dir / METRICS).is_file():
        return job_dir / METRICS
    return next(iter(sorted(job_dir.rglob("metrics.csv"))), None)


def parse_job(job_dir: Path, name: str | None = None) -> JobResult:
    """Read one job dir into a :class:`JobResult`; missing or unreadable files become ``problems``, never errors."""
    job = JobResult(job=name if name is not None else job_dir.name, path=job_dir)
    config: dict[str, Any] = {}
    for rel, reader in ((OVERRIDES, read_overrides), (CONFIG, read_config)):
        path = job_dir / rel
        if not path.is_file():
            continue
        try:
            value = reader(path)
        except Exception as err:  # a truncated or hand-edited file: report it, keep going
            job.problems.append(f"unreadable {rel}: {err}")
            continue
        if rel == OVERRIDES:
            job.overrides = value
        else:
            config = value

    metrics_path = _find_metrics(job_dir)
    if metrics_path is None:
        job.status = "failed"
        job.problems.append(f"no {METRICS.as_posix()}")
    else:
        try:
            job.metrics = read_metrics(metrics_path)
        except Exception as err:
            job.problems.append(f"unreadable {metrics_path.relative_to(job_dir).as_posix()}: {err}")
        job.train_loss_key = _pick_train_loss(job.metrics)
        if not job.metrics:
            job.status = "failed"
            job.problems.append(f"{metrics_path.relative_to(job_dir).as_posix()} holds no metrics")
        else:
            job.optimizer_steps = max(step for series in job.metrics.values() for step, _ in series)

    stats: dict[str, Any] | None = None
    if (job_dir / RUN_STATS).is_file():
        try:
            stats = read_run_stats(job_dir / RUN_STATS)
        except Exception as err:
            job.problems.append(f"unreadable {RUN_STATS}: {err}")
    else:
        job.problems.append(f"no {RUN_STATS}")
    if stats is None and job.status == "ok":
        job.status = "incomplete"
    if stats is not None:
        ranks = sorted(stats["ranks"], key=lambda r: r.get("rank", 0))
        strategy = stats.get("strategy")
        job.strategy = strategy.get("name") if isinstance(strategy, dict) else strategy
        job.world_size = stats.get("world_size")
        job.optimizer_steps = stats.get("optimizer_steps", job.optimizer_steps)
        job.median_step_time_ms_per_rank = [r.get("median_step_time_ms") for r in ranks]
        job.step_time_ms_per_rank = [r.get("step_time_ms") for r in ranks]
        job.peak_mib_per_rank = [r.get("peak_model_state_mib") for r in ranks]
        job.peak_bytes_per_rank = [r.get("peak_model_state_bytes") for r in ranks]
        job.strategy_buffers_counted = stats.get("strategy_buffers_counted")
        medians = [m for m in job.median_step_time_ms_per_rank if m is not None]
        job.median_step_time_ms = max(medians) if medians else None

    # The strategy config the job chose (e.g. "fsdp2", which run_stats.json names by class: "model_parallel") wins.
    from_overrides = [o.split("=", 1)[1] for o in job.overrides if o.lstrip("+").startswith("strategy=")]
    if from_overrides:
        job.strategy = from_overrides[-1]
    elif job.strategy is None:
        job.strategy = _strategy_from_config(config)
    if job.world_size is None:
        job.world_size = _world_size_from_config(config)
    return job


def _is_job_dir(path: Path) -> bool:
    return any((path / rel).is_file() for rel in (OVERRIDES, METRICS, Path(RUN_STATS)))


def _natural(path: Path) -> tuple[int, int | str]:
    return (0, int(path.name)) if path.name.isdigit() else (1, path.name)


def find_job_dirs(root: Path) -> list[Path]:
    """The job dirs of a multirun dir (its numbered or job-looking children), or ``[root]`` for a single run dir."""
    if _is_job_dir(root):
        return [root]
    children = sorted((d for d in root.iterdir() if d.is_dir()), key=_natural)
    jobs = [d for d in children if _is_job_dir(d)]
    if jobs:  # a Hydra sweep dir: numbered children without files are jobs that died before writing any
        return sorted({*jobs, *(d for d in children if d.name.isdigit())}, key=_natural)
    found = {p.parents[1] for p in root.rglob(OVERRIDES.as_posix())}
    found |= {p.parent for p in root.rglob(RUN_STATS)}
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def collect(root: Path) -> list[JobResult]:
    """Every job under ``root``, parsed; jobs are named by their path relative to ``root`` (``"."`` for root)."""
    root = Path(root)
    if not root.is_dir():
        raise ReportError(f"{root} is not a directory")
    dirs = find_job_dirs(root)
    if not dirs:
        raise ReportError(
            f"no job dirs under {root}: expected Hydra job dirs holding {OVERRIDES.as_posix()},"
            f" {METRICS.as_posix()} or {RUN_STATS}"
        )
    return [parse_job(d.resolve(), d.relative_to(root).as_posix()) for d in dirs]


def common_overrides(jobs: Sequence[JobResult]) -> list[str]:
    """Overrides every job has (none when there is only one job: then all of its overrides describe it)."""
    if len(jobs) < 2:
        return []
    first, rest = jobs[0].overrides, [set(j.overrides) for j in jobs[1:]]
    return [o for o in first if all(o in r for r in rest)]


def varying_overrides(job: JobResult, common: Sequence[str]) -> list[str]:
    return [o for o in job.overrides if o not in common]


# ----------------------------------------------------------------------------------------------------- pivots
def parse_override(override: str) -> tuple[str, str] | None:
    """``"key=value"`` (also ``+key=value``, ``++key=value``) as ``(key, value)``; ``None`` for ``~key`` deletions."""
    if override.startswith("~") or "=" not in override:
        return None
    key, value = override.split("=", 1)
    return key.lstrip("+"), value


def override_value(job: JobResult, key: str) -> str:
    """The value ``job`` gave ``key`` on the command line (the last one wins, as in Hydra), else ``"default"``."""
    value = DEFAULT
    for override in job.overrides:
        parsed = parse_override(override)
        if parsed is not None and parsed[0] == key:
            value = parsed[1]
    return value


def override_keys(jobs: Sequence[JobResult]) -> list[str]:
    """Every key some job overrides, in the order they first appear."""
    keys: dict[str, None] = {}
    for job in jobs:
        for override in job.overrides:
            parsed = parse_override(override)
            if parsed is not None:
                keys.setdefault(parsed[0], None)
    return list(keys)


class Pivot(NamedTuple):
    """One panel of :func:`pivot`: ``cells[(row, col)]`` is the mean of the jobs' values, ``None`` when no job of
    that cell logged the metric (or there is no such job); ``jobs[(row, col)]`` names the cell's jobs."""

    rows: list[str]
    cols: list[str]
    cells: dict[tuple[str, str], float | None]
    jobs: dict[tuple[str, str], list[str]]


def pivot(
    jobs: Sequence[JobResult], row_key: str, col_key: str, metric: str, facet_key: str | None = None
) -> dict[str | None, Pivot]:
    """The last logged value of ``metric`` per job, by the jobs' values of ``row_key`` and ``col_key``.

    Returns one :class:`Pivot` per value of ``facet_key`` (the single key ``None`` without one). Row, column and
    facet values are in the order they first appear among ``jobs``, and every panel has all rows and columns, so
    panels line up. A key a job did not override has the value ``"default"``. Several jobs in one cell (a sweep over
    a key not in the pivot, e.g. ``seed``) are averaged over those that logged ``metric``.

    Raises:
        ReportError: a key no job overrides (naming the keys that exist), the same key twice, or a metric that no
            job logged while others were (naming those).
    """
    keys = {"row": row_key, "column": col_key, **({"facet": facet_key} if facet_key is not None else {})}
    if len(set(keys.values())) < len(keys):
        raise ReportError(f"the heat map keys {keys} must differ from each other")
    existing = override_keys(jobs)
    for role, key in keys.items():
        if key not in existing:
            raise ReportError(
                f"{role} key {key!r} is not overridden by any job: expected one of {existing or '(no overrides)'}"
            )
    logged = sorted({k for j in jobs for k in j.metrics})
    if logged and metric not in logged:  # a typo; with no metrics at all (every job failed) the grid is all n/a
        raise ReportError(f"metric {metric!r} was not logged by any job: expected one of {logged}")

    def first_seen(key: str | None) -> list[Any]:
        return list(dict.fromkeys(override_value(j, key) if key is not None else None for j in jobs))

    rows, cols = first_seen(row_key), first_seen(col_key)
    values: dict[tuple[str | None, str, str], list[float]] = {}
    names: dict[tuple[str | None, str, str], list[str]] = {}
    for j in jobs:
        facet = override_value(j, facet_key) if facet_key is not None else None
        cell = (facet, override_value(j, row_key), override_value(j, col_key))
        names.setdefault(cell, []).append(j.job)
        value = j.final(metric)
        if value is not None:
            values.setdefault(cell, []).append(value)
    panels: dict[str | None, Pivot] = {}
    for facet in first_seen(facet_key):
        cells: dict[tuple[str, str], float | None] = {}
        for r in rows:
            for c in cols:
                found = values.get((facet, r, c))
                cells[r, c] = sum(found) / len(found) if found else None
        cell_jobs = {(r, c): names.get((facet, r, c), []) for r in rows for c in cols}
        panels[facet] = Pivot(list(rows), list(cols), cells, cell_jobs)
    return panels
