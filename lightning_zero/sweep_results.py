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

:mod:`lightning_zero.report` turns the rows into tables and plots.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUN_STATS = "run_stats.json"
METRICS = Path("csv") / "metrics.csv"
OVERRIDES = Path(".hydra") / "overrides.yaml"
CONFIG = Path(".hydra") / "config.yaml"
TRAIN_LOSS_KEYS = ("train/loss", "train_loss", "train/loss_step", "train_loss_step", "loss")
VAL_LOSS_KEYS = ("val/loss", "val_loss")
BREAKDOWN = ("params", "grads", "optimizer", "strategy_buffers")
MIB = 2**20

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
