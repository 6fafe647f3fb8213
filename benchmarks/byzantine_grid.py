"""The Byzantine ranks mode's grid: process counts x faulty-rank behaviours x robust rules x seeds, each cell a real
``lightning-zero-train experiment=robust_digits`` run whose ranks audit every step (``ByzantineAudit`` in
``lightning_zero/byzantine/audit.py``).

Runbook::

    python benchmarks/byzantine_grid.py --out grid                    # the whole grid (hours on 2 cores), resumable
    python benchmarks/byzantine_grid.py --out grid --ranks 4 --rules median --seeds 0   # a slice
    python benchmarks/byzantine_grid.py --out grid --report           # the tables from the cells run so far

Cells: N = 4 processes with f = 1 faulty rank (2 workers per rank: n = 8 workers, the rule's f = 2, as the faulty
rank's two workers) and N = 7 with f = 2 (1 worker per rank: n = 7, the rule's f = 2); the faulty ranks are the last f.
Each behaviour of ``lightning_zero/byzantine/behaviours.py`` and ``none`` (the mode with every rank honest: the
baseline), x {median, trimmed_mean, centered_clipping} x seeds. Every worker reads 16 samples a step.

K, per behaviour and rule, is the last step after which a faulty rank was evicted minus the step of its first
fault (``crash`` exits at step 1, every other behaviour misbehaves from step 0); ``slow_under`` and ``alie`` break no
rule the protocol can see, and their ranks must never be evicted.

A cell's ``cell.json`` records what its audit files show (:func:`lightning_zero.byzantine.audit.summarize`): safety
(every honest rank's weights digest equal after every step), the honest ranks evicted (must be none), the step
after which each faulty rank was evicted, and the final ``val/acc``. The report prints, per behaviour and rule, the
seeds' accuracies against the baseline's, and "within noise" where the difference of the means is at most twice the
baseline's seed standard deviation (or 0.5 points, whichever is larger: 3 seeds estimate a spread poorly).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lightning_zero.byzantine.audit import read, summarize
from lightning_zero.byzantine.behaviours import BEHAVIOURS, CRASH_STEP

LAYOUTS = {4: {"f": 1, "workers_per_rank": 2}, 7: {"f": 2, "workers_per_rank": 1}}
RULES = ("median", "trimmed_mean", "centered_clipping")
BASELINE = "none"
SAMPLES_PER_WORKER = 16
FIRST_FAULT = {"crash": CRASH_STEP}
"""The step of a behaviour's first fault (every other behaviour misbehaves from step 0)."""
NEVER_EVICTED = ("slow_under", "alie")
"""Behaviours that break no rule the protocol can see: their rank must stay a member."""
NOISE_FLOOR = 0.005  # accuracy points: the smallest "seed noise" the report accepts as a spread


def cell_name(ranks: int, behaviour: str, rule: str, seed: int) -> str:
    return f"n{ranks}-{behaviour}-{rule}-s{seed}"


def overrides(ranks: int, behaviour: str, rule: str, seed: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    layout = LAYOUTS[ranks]
    out = [
        "experiment=robust_digits",
        f"aggregator={rule}",
        f"trainer.devices={ranks}",
        f"trainer.max_steps={args.max_steps}",
        f"trainer.val_check_interval={args.max_steps}",
        f"strategy.byzantine_ranks={layout['f']}",
        f"strategy.byzantine_timeout={args.timeout}",
        f"strategy.workers_per_rank={layout['workers_per_rank']}",
        "strategy.f=2",
        f"data.batch_size={SAMPLES_PER_WORKER * layout['workers_per_rank']}",
        f"seed={seed}",
        "callbacks=none",
        "+callbacks.byzantine_audit._target_=lightning_zero.byzantine.audit.ByzantineAudit",
        f"+callbacks.byzantine_audit.output_dir={run_dir}",
        f"hydra.run.dir={run_dir}",
    ]
    if behaviour != BASELINE:
        out.append(f"strategy.byzantine_rank_behaviour={behaviour}")
    return out


def final_accuracy(run_dir: Path) -> float | None:
    """The last ``val/acc`` in the run's ``csv/metrics.csv`` (the validation after the fit)."""
    path = run_dir / "csv" / "metrics.csv"
    if not path.exists():
        return None
    values = [row["val/acc"] for row in csv.DictReader(path.open()) if row.get("val/acc")]
    return float(values[-1]) if values else None


def run_cell(ranks: int, behaviour: str, rule: str, seed: int, args: argparse.Namespace) -> dict:
    run_dir = (args.out / cell_name(ranks, behaviour, rule, seed)).resolve()
    command = ["lightning-zero-train", *overrides(ranks, behaviour, rule, seed, args, run_dir)]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.cell_timeout)
    faulty = [] if behaviour == BASELINE else list(range(ranks - LAYOUTS[ranks]["f"], ranks))
    result = {
        "ranks": ranks, "behaviour": behaviour, "rule": rule, "seed": seed,
        "returncode": proc.returncode, "seconds": round(time.perf_counter() - start, 1),
        "val_acc": final_accuracy(run_dir),
        **summarize(read(run_dir), faulty, ranks),
    }  # fmt: skip
    result["faulty_evicted"] = {str(k): v for k, v in result["faulty_evicted"].items()}
    result["evicted_by_all"] = {str(k): v for k, v in result["evicted_by_all"].items()}
    if proc.returncode != 0:
        result["stderr_tail"] = proc.stderr[-2000:]
    (run_dir / "cell.json").write_text(json.dumps(result, indent=1))
    return result


def report(out: Path) -> None:
    cells = [json.loads(p.read_text()) for p in sorted(out.glob("*/cell.json"))]
    if not cells:
        sys.exit(f"no cells under {out}")
    failed = sum(c["returncode"] != 0 for c in cells)
    print(
        f"{len(cells)} cells; safe in {sum(c['safe'] for c in cells)}; honest ranks evicted in"
        f" {sum(bool(c['honest_evicted']) for c in cells)}; non-zero exit in {failed}"
    )
    print(
        "| N | behaviour | rule | seeds | safe | honest evicted | faulty evicted after step | K | val/acc (mean ± sd)"
        " | baseline | within noise |"
    )
    print("|---:|---|---|---:|---|---|---|---|---|---|---|")
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["ranks"], c["behaviour"], c["rule"]), []).append(c)
    for (ranks, behaviour, rule), group in sorted(groups.items()):
        accs = [c["val_acc"] for c in group if c["val_acc"] is not None]
        base = [c["val_acc"] for c in groups.get((ranks, BASELINE, rule), []) if c["val_acc"] is not None]
        evicted = sorted({str(v) for c in group for v in c["faulty_evicted"].values()})
        steps = [v for c in group for v in c["faulty_evicted"].values() if v is not None]
        k = max(steps) - FIRST_FAULT.get(behaviour, 0) if steps else None
        if behaviour == BASELINE or behaviour in NEVER_EVICTED:
            k_text = "never evicted" if not steps else f"evicted ({', '.join(evicted)})"
        else:
            missed = sum(v is None for c in group for v in c["faulty_evicted"].values())
            k_text = f"{k}" + (f" ({missed} never evicted)" if missed else "")
        within = "-"
        if accs and len(base) >= 2 and behaviour != BASELINE:
            noise = max(2 * statistics.stdev(base), NOISE_FLOOR)
            within = "yes" if abs(statistics.mean(accs) - statistics.mean(base)) <= noise else "no"
        print(
            f"| {ranks} | {behaviour} | {rule} | {len(group)} | {all(c['safe'] for c in group)}"
            f" | {sorted({r for c in group for r in c['honest_evicted']}) or 'none'} | {', '.join(evicted) or '-'}"
            f" | {k_text} | {_mean_sd(accs)} | {_mean_sd(base)} | {within} |"
        )


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.2f} ± {100 * sd:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the grid's folder (a cell per subfolder)")
    parser.add_argument("--ranks", type=int, nargs="+", default=sorted(LAYOUTS), choices=sorted(LAYOUTS))
    parser.add_argument("--behaviours", nargs="+", default=[BASELINE, *BEHAVIOURS], choices=[BASELINE, *BEHAVIOURS])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=150, help="optimizer steps per cell (experiment: 150)")
    parser.add_argument("--timeout", type=float, default=2.0, help="strategy.byzantine_timeout, seconds")
    parser.add_argument("--cell-timeout", type=float, default=1800.0, help="seconds before a cell counts as hung")
    parser.add_argument("--report", action="store_true", help="print the tables from the cells run so far")
    args = parser.parse_args()
    if args.report:
        report(args.out)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    for ranks in args.ranks:
        for behaviour in args.behaviours:
            for rule in args.rules:
                for seed in args.seeds:
                    done = args.out / cell_name(ranks, behaviour, rule, seed) / "cell.json"
                    if done.exists():
                        continue
                    result = run_cell(ranks, behaviour, rule, seed, args)
                    print(
                        f"{cell_name(ranks, behaviour, rule, seed)}: exit {result['returncode']},"
                        f" {result['seconds']} s, safe {result['safe']}, honest evicted {result['honest_evicted']},"
                        f" faulty evicted {result['faulty_evicted']}, val/acc {result['val_acc']}",
                        flush=True,
                    )
    report(args.out)


if __name__ == "__main__":
    main()
