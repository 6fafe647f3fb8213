"""``lightning-zero-parity`` (also ``python -m lightning_zero.tools.parity``): check that your LightningModule trains
the same under a data-parallel strategy as in one process, before you spend cluster time on it.

Runbook::

    lightning-zero-parity my_project.model:LitModel --strategy zero3_scratch --devices 2 --steps 5
    lightning-zero-parity path/to/model.py:LitModel --init-kwargs '{"hidden": 64}' --batch-size 4 --json parity.json
    lightning-zero-parity my_project.model:LitModel --datamodule my_project.data:LitData --strategy zero2_scratch
    lightning-zero-parity my_project.model:LitModel --trainer-kwargs '{"accumulate_grad_batches": 2}'
    lightning-zero-parity lightning.pytorch.demos.boring_classes:BoringModel --strategy ddp   # the tool itself

``MODULE:CLASS`` is an importable module path (the current directory is on the path) or a ``.py`` file; the module is
built as ``CLASS(**init_kwargs)`` after ``seed_everything(--seed)``, in every run. The training data come from its
``train_dataloader()``, or from the ``LightningDataModule`` given with ``--datamodule`` (built without arguments).

Two fits of ``--steps`` optimizer steps, from the same seed, on CPU with one thread per process:

- the strategy run: ``--devices`` processes that look like ``torchrun`` ranks to Lightning (gloo), each fed its share
  of every batch by Lightning's shuffling ``DistributedSampler`` (``--batch-size`` samples per rank, default the
  loader's batch size);
- the reference: ``Trainer(devices=1, strategy="auto")`` in one process, whose batch k is the concatenation, in rank
  order, of every rank's k-th batch (:class:`GlobalBatchSampler`), so it holds ``devices x batch size`` samples.

Averaging gradients over ranks of per-rank *mean* losses gives the gradient of the global batch's mean loss, so a
correct strategy ends where the reference does, up to float rounding (about 1e-7 after a few fp32 steps). The tool
compares rank 0's ``module.state_dict()`` after ``fit`` (parameters and buffers) with the reference's, and every
logged metric whose name starts with ``train`` after each optimizer step (the strategy run's value is the mean over
ranks: the global batch's value for a batch mean, logged with ``sync_dist=True`` or not), then prints a table of the
largest absolute difference per tensor and metric and a verdict. ``--json OUT`` writes the table and the verdict.

These differ legitimately between N processes and one, and make the check fail without a strategy bug: a loss that
is not a mean over the batch (a sum, a per-rank weighting, anything reading ``self.global_rank`` or
``self.trainer.world_size``); BatchNorm without ``SyncBatchNorm`` (each rank normalizes its own samples); dropout or
random augmentation (the ranks and the reference draw different random numbers: set ``p=0`` for the check); metrics
that are not batch means. The tool prints a note when the module has BatchNorm or dropout layers.
The training loader must be a plain ``torch.utils.data.DataLoader`` over a map-style dataset with the default sampler
(Lightning replaces it with a ``DistributedSampler``); ``train_dataloader()`` is called under ``--seed``, so data
drawn at random there are the same in every process.

``--trainer-kwargs`` JSON goes to both ``Trainer`` calls (``accumulate_grad_batches``, ``gradient_clip_val``,
``precision``, ...); the arguments the check sets itself are refused. The processes' output is kept out of the
terminal and the last lines of it are printed when a process fails; ``--timeout`` (default 600 s) bounds the runs,
all processes together, and kills them when it runs out (a collective that never completes hangs every rank).

Exit codes: 0 PASS, 1 FAIL, 2 the check could not be made (bad arguments or input, a process that crashed or timed
out).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.tools.overrides import did_you_mean
from lightning_zero.tools.parity_compare import compare, report, table
from lightning_zero.tools.parity_job import (
    EXIT_ERROR,
    EXIT_FAIL,
    EXIT_PASS,
    PROG,
    REFERENCE,
    SET_BY_THE_CHECK,
    Job,
    ParityError,
    load_class,
    trains_from,
)
from lightning_zero.tools.parity_run import run


# ---------------------------------------------------------------- console script
def _json_object(text: str, option: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ParityError(f"{option} {text!r}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ParityError(f"{option} {text!r}: expected a JSON object, got a {type(value).__name__}")
    return value


def _job(args: argparse.Namespace) -> Job:
    """Validate the arguments (cheap checks first) and build the job. Raises :class:`ParityError`."""
    if args.strategy not in StrategyRegistry:
        names = StrategyRegistry.available_strategies()
        raise ParityError(
            f"--strategy {args.strategy!r} is not a registered strategy{did_you_mean(args.strategy, names)} (the"
            f" registered ones: {', '.join(names)})"
        )
    for option, value, least in (("--devices", args.devices, 2), ("--steps", args.steps, 1)):
        if value < least:
            raise ParityError(f"{option} {value}: must be at least {least}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ParityError(f"--batch-size {args.batch_size}: must be at least 1")
    if not args.tolerance >= 0:
        raise ParityError(f"--tolerance {args.tolerance:g}: must be a number >= 0")
    if not args.timeout > 0:
        raise ParityError(f"--timeout {args.timeout:g}: must be a positive number of seconds")
    if args.json and not Path(args.json).resolve().parent.is_dir():  # found out now, not after the runs
        raise ParityError(f"--json {args.json}: the folder {str(Path(args.json).resolve().parent)!r} does not exist")
    init_kwargs = _json_object(args.init_kwargs, "--init-kwargs")
    trainer_kwargs = _json_object(args.trainer_kwargs, "--trainer-kwargs")
    if refused := sorted(SET_BY_THE_CHECK & trainer_kwargs.keys()):
        raise ParityError(
            f"--trainer-kwargs may not set {', '.join(refused)}: the check sets these itself, the same in both runs"
        )
    module_cls = load_class(args.module, L.LightningModule, "MODULE:CLASS")
    datamodule_cls = load_class(args.datamodule, L.LightningDataModule, "--datamodule") if args.datamodule else None
    try:
        inspect.signature(module_cls).bind(**init_kwargs)
    except TypeError as err:
        raise ParityError(f"--init-kwargs {args.init_kwargs}: {module_cls.__qualname__}(...) {err}") from None
    trains_from(module_cls, datamodule_cls)
    return Job(
        module=args.module,
        datamodule=args.datamodule,
        init_kwargs=init_kwargs,
        strategy=args.strategy,
        devices=args.devices,
        steps=args.steps,
        batch_size=args.batch_size,
        seed=args.seed,
        trainer_kwargs=trainer_kwargs,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="Exit codes: 0 PASS, 1 FAIL, 2 the check could not be made.",
    )
    parser.add_argument(
        "module", metavar="MODULE:CLASS", help="your LightningModule: pkg.module:Class or file.py:Class"
    )
    parser.add_argument("--strategy", required=True, help="a registered strategy name, e.g. zero3_scratch or ddp")
    parser.add_argument("--devices", type=int, default=2, help="processes of the strategy run (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps of each run (default 5)")
    parser.add_argument("--batch-size", type=int, help="samples per rank and batch (default: the loader's)")
    parser.add_argument("--datamodule", metavar="MODULE:CLASS", help="a LightningDataModule to train from")
    parser.add_argument("--init-kwargs", default="{}", metavar="JSON", help="keyword arguments of CLASS(...)")
    parser.add_argument("--trainer-kwargs", default="{}", metavar="JSON", help="more arguments of both Trainers")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest absolute difference (default 1e-5)")
    parser.add_argument("--seed", type=int, default=0, help="seed_everything and the samplers' seed (default 0)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the runs may take (default 600)")
    parser.add_argument("--json", metavar="OUT", help="write every difference and the verdict to this file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console script ``lightning-zero-parity``; returns the exit code (argparse exits with 2 by itself)."""
    args = _parser().parse_args(argv)
    try:
        job = _job(args)
        print(
            f"{PROG}: {args.module} under {job.strategy} on {job.devices} CPU processes and the single-process"
            f" reference, {job.steps} steps, seed {job.seed} (timeout {args.timeout:g} s) ...",
            file=sys.stderr,
        )
        with tempfile.TemporaryDirectory(prefix="lightning-zero-parity-") as workdir:
            results = run(job, workdir, args.timeout)
    except ParityError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    reference = results[REFERENCE]
    passed, rows, verdict = compare(results, job, args.tolerance)
    batch = reference["batch_size"]
    print(f"global batch {job.devices * batch} ({job.devices} ranks x {batch}), {job.steps} optimizer steps")
    if rows:
        print("\n".join(table(rows, args.tolerance)))
    for note in reference["notes"]:
        print(f"note: {note}")
    print(verdict)
    if args.json:
        document = report(passed, rows, verdict, job, args.tolerance, reference["notes"])
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return EXIT_PASS if passed else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
