"""Comparing a ``lightning-zero-parity`` job's runs (:mod:`lightning_zero.tools.parity`): the largest difference per
tensor of the final ``state_dict`` and per logged metric after each optimizer step, the verdict against the
tolerance, the printed table and the ``--json`` report.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightning_zero.tools.parity_job import REFERENCE, TABLE_ROWS, Job


# ---------------------------------------------------------------- comparing
@dataclass
class Row:
    """One compared tensor or metric: the largest absolute difference, ``inf`` when it exists on one side only or
    the shapes differ (``note`` says which)."""

    name: str
    shape: str
    max_diff: float
    note: str = ""


def _tensor_rows(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> list[Row]:
    rows = []
    for name in [*reference, *(k for k in ours if k not in reference)]:
        if name not in ours or name not in reference:
            side = "the strategy run" if name not in ours else "the reference"
            tensor = reference.get(name, ours.get(name))
            rows.append(Row(name, str(tuple(tensor.shape)), math.inf, f"missing in {side}"))
        elif ours[name].shape != reference[name].shape:
            shapes = f"{tuple(ours[name].shape)} vs {tuple(reference[name].shape)}"
            rows.append(Row(name, str(tuple(reference[name].shape)), math.inf, f"shapes differ: {shapes}"))
        else:
            diff = (ours[name].double() - reference[name].double()).abs()
            rows.append(Row(name, str(tuple(reference[name].shape)), diff.max().item() if diff.numel() else 0.0))
    return rows


def _rank_mean(per_rank: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Each step's metrics averaged over the ranks that logged them."""
    steps = []
    for step in zip(*per_rank):
        keys = dict.fromkeys(k for metrics in step for k in metrics)
        steps.append({k: sum(m[k] for m in step if k in m) / sum(k in m for m in step) for k in keys})
    return steps


def _metric_rows(ours: list[dict[str, float]], reference: list[dict[str, float]]) -> list[Row]:
    names = dict.fromkeys(k for metrics in (*reference, *ours) for k in metrics)
    rows = []
    for name in names:
        diffs, missing = [], 0
        for mine, theirs in zip(ours, reference):
            if name in mine and name in theirs:
                diffs.append(abs(mine[name] - theirs[name]))
            elif name in mine or name in theirs:
                missing += 1
        note = f"logged by one run only at {missing} steps" if missing else ""
        worst = math.inf if missing else max(diffs, key=_severity, default=0.0)
        rows.append(Row(name, f"{len(reference)} steps", worst, note))
    return rows


def _severity(diff: float) -> float:
    """Sort key of a difference: nan (a nan on one side) ranks with inf, above every finite difference."""
    return math.inf if math.isnan(diff) else diff


def _within(row: Row, tolerance: float) -> bool:
    return row.max_diff <= tolerance  # False for nan


def compare(results: dict[str, dict[str, Any]], job: Job, tolerance: float) -> tuple[bool, list[Row], str]:
    """``(passed, rows, verdict line)`` for the results of :func:`run`."""
    reference = results[REFERENCE]
    ranks = [results[f"rank{r}"] for r in range(job.devices)]
    ran = {f"rank {r}": res["global_step"] for r, res in enumerate(ranks)} | {"the reference": reference["global_step"]}
    if any(steps != job.steps for steps in ran.values()):
        counts = ", ".join(f"{who} {steps}" for who, steps in ran.items())
        return False, [], f"FAIL: the runs did not all make {job.steps} optimizer steps ({counts}); nothing compared"
    rows = _tensor_rows(ranks[0]["state"], reference["state"])
    rows += _metric_rows(_rank_mean([res["metrics"] for res in ranks]), reference["metrics"])
    if not rows:
        return False, [], "FAIL: the module has no parameters or buffers and logged no train* metric; nothing compared"
    worst = max(rows, key=lambda row: _severity(row.max_diff))
    above = [row for row in rows if not _within(row, tolerance)]
    if not above:
        return (
            True,
            rows,
            f"PASS: {job.strategy} matches the single-process reference within {tolerance:g} on {job.steps} steps"
            f" (max diff {worst.max_diff:.1e} on {worst.name})",
        )
    detail = f"; {worst.note}" if worst.note else ""
    return (
        False,
        rows,
        f"FAIL: {job.strategy} differs from the single-process reference on {len(above)} of {len(rows)} tensors and"
        f" metrics beyond {tolerance:g} after {job.steps} steps (worst: {worst.name}, max diff"
        f" {worst.max_diff:.1e}{detail})",
    )


def table(rows: list[Row], tolerance: float) -> list[str]:
    """The rows as aligned text; above :data:`TABLE_ROWS` rows, the largest differences only, in model order."""
    shown = rows
    if len(rows) > TABLE_ROWS:
        keep = {id(row) for row in sorted(rows, key=lambda row: -_severity(row.max_diff))[:TABLE_ROWS]}
        shown = [row for row in rows if id(row) in keep]
    name_width = max(len("tensor"), *(len(row.name) for row in shown))
    shape_width = max(len("shape"), *(len(row.shape) for row in shown))
    lines = [f"{'tensor':<{name_width}}  {'shape':<{shape_width}}  max |diff|"]
    for row in shown:
        flag = "" if _within(row, tolerance) else "  > tolerance"
        note = f"  ({row.note})" if row.note else ""
        lines.append(f"{row.name:<{name_width}}  {row.shape:<{shape_width}}  {row.max_diff:.1e}{flag}{note}")
    if len(shown) < len(rows):
        hidden = len(rows) - len(shown)
        lines.append(f"... {hidden} more with smaller differences (--json has every row)")
    return lines


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # strict JSON has no inf or nan


def report(passed: bool, rows: list[Row], verdict: str, job: Job, tolerance: float, notes: list[str]) -> dict:
    """The ``--json`` document."""
    worst = max(rows, key=lambda row: _severity(row.max_diff), default=None)
    return {
        "verdict": "PASS" if passed else "FAIL",
        "message": verdict,
        "max_diff": _finite(worst.max_diff) if worst else None,
        "worst": worst.name if worst else None,
        "tolerance": tolerance,
        "job": asdict(job),
        "notes": notes,
        "rows": [{**asdict(row), "max_diff": _finite(row.max_diff)} for row in rows],
    }
