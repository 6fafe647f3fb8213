"""``lightning-zero-train`` (also ``python -m lightning_zero.tools.train``): compose a Hydra config, fit, validate.

With no arguments it runs the embedded demo: a character-level GPT on the stdlib's ``pydoc_data.topics`` text on
2 CPU processes with ``zero3_scratch`` (about 2 minutes on 2 cores). The configs live in ``lightning_zero.conf``::

    lightning-zero-train
    lightning-zero-train strategy=zero2_scratch trainer.max_steps=50
    lightning-zero-train --cfg job          # print the composed config
    lightning-zero-train --help             # list the config groups and their options

The command line is checked before Hydra composes anything (:func:`lightning_zero.tools.overrides.check_overrides`: a
misspelt group option, Trainer argument or strategy setting gets "did you mean"), and the settings right after
composition (:func:`lightning_zero.tools.config.validate_config`): a bad value exits with one message before any
process starts, and the run dir Hydra created for it is removed again, so a rejected command leaves nothing behind.
Everything the console shows (Lightning's messages, the progress bar, warnings) also goes to ``<job>_console.log`` in
the run dir, and an interrupted run (Ctrl-C) says so in ``train.log``. Multi-process runs: Lightning's popen launcher
re-executes this command for each extra local rank with ``hydra.run.dir`` pinned to this run's directory, so every
rank writes into one run dir: rank 0 logs to ``train.log``, rank ``r`` >= 1 to ``train_ddp_process_<r>.log`` there.
A run shorter than its validation interval (``trainer.max_steps=100`` with validation every 200 batches) validates
after its last batch instead, so it still reports a best ``val/ppl``. Sweeps of multi-process jobs
work::

    lightning-zero-train -m strategy=ddp_scratch,zero1_scratch,zero3_scratch trainer.max_steps=50

each job's extra ranks re-run only that job, in that job's directory, and each job ends with its ranks reaped, its
process group destroyed and the environment restored (:mod:`lightning_zero.tools.multirun`).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_zero.tools.config import validate_config
from lightning_zero.tools.config_schema import ConfigError, register_configs
from lightning_zero.tools.console import ConsoleLog
from lightning_zero.tools.interrupts import InterruptLog
from lightning_zero.tools.multirun import JobScope
from lightning_zero.tools.overrides import OverrideError, check_overrides

log = logging.getLogger("lightning_zero.tools.train")  # not __name__: "__main__" under python -m

register_configs()


# Messages every run printed that a user of this CLI cannot act on: Lightning's own use of a deprecated torch pytree
# API, the advertisement for its cloud logger, and the note that validation after a multi-process fit uses a
# DistributedSampler (this CLI validates on every rank on purpose: the metrics are reduced across them).
_UNACTIONABLE_WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\)` is deprecated",
    r"Using `DistributedSampler` with the dataloaders\. During `trainer\.validate\(\)`",
)
_UNACTIONABLE_INFO = ("💡 Tip:",)


class _DropInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_UNACTIONABLE_INFO)


def _quiet_unactionable_messages() -> None:
    for pattern in _UNACTIONABLE_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in ("lightning_utilities.core.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_DropInfo())


def _processes_per_node(trainer_cfg: DictConfig) -> int:
    devices = trainer_cfg.get("devices", 1)
    if isinstance(devices, int) and devices > 0:
        return devices
    if OmegaConf.is_list(devices):
        return len(devices)
    return 1


def _set_threads(cfg: DictConfig) -> None:
    import torch

    processes, cores = _processes_per_node(cfg.trainer), os.cpu_count() or 1
    threads = cfg.get("threads_per_process")
    if threads is None:
        threads = max(1, cores // processes)
    torch.set_num_threads(int(threads))
    on_cpu = cfg.trainer.get("accelerator", "auto") == "cpu" or not torch.cuda.is_available()
    if on_cpu and processes * int(threads) > cores and os.environ.get("LOCAL_RANK", "0") == "0":
        log.warning(
            "trainer.devices=%s starts %d processes x %d thread(s) on %d CPU cores: %d threads compete for %d"
            " cores, so every step runs slower than with fewer processes (trainer.devices=%d, or lower"
            " threads_per_process)",
            cfg.trainer.get("devices"),
            processes,
            int(threads),
            cores,
            processes * int(threads),
            cores,
            max(1, cores // int(threads)),
        )


def _validate_at_the_end(trainer_cfg: DictConfig) -> dict[str, Any]:
    """``{"val_check_interval": ...}`` for a run shorter than its validation interval, else ``{}``.

    The trainer configs validate every 200 batches, so ``trainer.max_steps=100`` would end its fit without one
    validation: no ``val/ppl`` for the checkpoint callback, and ``best: -``. Such a run validates at its last step
    instead (``val_check_interval`` counts batches: ``max_steps`` x ``accumulate_grad_batches``).
    """
    max_steps, interval = trainer_cfg.get("max_steps", -1), trainer_cfg.get("val_check_interval")
    batches = max_steps * trainer_cfg.get("accumulate_grad_batches", 1) if isinstance(max_steps, int) else -1
    if not isinstance(interval, int) or isinstance(interval, bool) or not 0 < batches < interval:
        return {}
    if os.environ.get("LOCAL_RANK", "0") == "0":
        log.info(
            "trainer.max_steps=%d ends before the first validation (trainer.val_check_interval=%d batches):"
            " validating after batch %d instead",
            max_steps,
            interval,
            batches,
        )
    return {"val_check_interval": batches}


def build(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate data, model, callbacks, loggers, strategy and trainer from ``cfg``; no process is started yet."""
    import lightning as L
    from hydra.utils import instantiate

    _set_threads(cfg)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    optimizer = instantiate(cfg.optimizer) if cfg.get("optimizer") else None
    # What the model needs from the data: {"vocab_size": ...} (char demo), {"in_features": ..., "num_classes": ...}.
    model_kwargs = getattr(datamodule, "model_kwargs", dict)()
    model = instantiate(cfg.model, optimizer=optimizer, **model_kwargs)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    strategy = instantiate(cfg.strategy)
    trainer = instantiate(
        cfg.trainer,
        strategy=strategy,
        callbacks=callbacks,
        logger=loggers or False,
        **_validate_at_the_end(cfg.trainer),
    )
    for logger in loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    return {"trainer": trainer, "model": model, "datamodule": datamodule, "ckpt_path": cfg.get("ckpt_path")}


def fit_and_validate(trainer: Any, model: Any, datamodule: Any, ckpt_path: str | None = None) -> dict[str, Any]:
    """Fit, then validate. Returns ``{"metrics": ..., "history": [(step, value), ...], "history_metric": name,
    "trainer": ...}``: ``history`` is the module's ``val_history`` (one entry per validation pass, the sanity check
    included), the values of its ``history_metric`` (``val/ppl`` for the char demo, ``val/loss`` for digits).
    """
    log.info("rank %d of %d: fitting with %s", trainer.global_rank, trainer.world_size, type(trainer.strategy).__name__)
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    history = list(getattr(model, "val_history", []))
    results = trainer.validate(model, datamodule=datamodule, verbose=False)
    metrics = {k: float(v) for k, v in (results[0] if results else {}).items()}
    log.info("rank %d of %d: done, validation metrics %s", trainer.global_rank, trainer.world_size, metrics)
    name = getattr(model, "history_metric", "")
    return {"metrics": metrics, "history": history, "history_metric": name, "trainer": trainer}


def train(cfg: DictConfig) -> dict[str, Any]:
    """:func:`build` then :func:`fit_and_validate`."""
    return fit_and_validate(**build(cfg))


def _report(out: dict[str, Any], output_dir: str, job_name: str) -> None:
    trainer = out["trainer"]
    history, name, metrics = out["history"], out["history_metric"], out["metrics"]
    lines = [f"outputs: {output_dir}"]
    ckpt = next((c for c in trainer.checkpoint_callbacks), None)
    if ckpt is not None:
        lines.append(f"  checkpoints: {ckpt.dirpath} (best: {ckpt.best_model_path or '-'})")
    for logger in trainer.loggers:
        lines.append(f"  {type(logger).__name__}: {logger.log_dir}")
    if trainer.world_size > 1:
        lines.append(
            f"  logs: {output_dir}/{job_name}.log (rank 0) and train_ddp_process_<rank>.log"
            f" (ranks 1 to {trainer.world_size - 1})"
        )
    if history and name:
        first_step, first = history[0]
        final = metrics.get(name, float("nan"))
        lines.append(f"{name}: first {first:.4f} (step {first_step}), final {final:.4f}")
    print("\n".join(lines), flush=True)


def _discard_run_dir(output_dir: str) -> None:
    """Remove what Hydra wrote for a run rejected before it started: ``.hydra/`` and the empty log files (the run dir
    too, and its parents, if nothing else is left in them). Anything else in it (a pinned ``hydra.run.dir`` with
    results) stays."""
    run_dir = Path(output_dir).resolve()
    for handler in [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]:
        if Path(handler.baseFilename).resolve().parent == run_dir:
            logging.getLogger().removeHandler(handler)
            handler.close()
    shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
    for path in run_dir.glob("*.log"):
        if path.stat().st_size == 0:
            path.unlink()
    cwd, folder = Path.cwd().resolve(), run_dir
    while folder != cwd and cwd in folder.parents and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


@hydra.main(version_base="1.3", config_path="pkg://lightning_zero.conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """The console script ``lightning-zero-train``; returns ``cfg.optimized_metric`` for a sweeper."""
    from hydra.core.hydra_config import HydraConfig

    _quiet_unactionable_messages()
    hydra_cfg = HydraConfig.get()
    try:
        validate_config(cfg)
    except ConfigError as err:
        _discard_run_dir(hydra_cfg.runtime.output_dir)
        raise SystemExit(f"lightning-zero-train: invalid configuration: {err}") from None
    console = Path(hydra_cfg.runtime.output_dir) / f"{hydra_cfg.job.name}_console.log"
    with ConsoleLog(console), JobScope() as job:
        parts = build(cfg)
        trainer = parts["trainer"]
        job.attach(trainer)

        def interrupted() -> str:
            return (
                f"rank {trainer.global_rank}: interrupted (Ctrl-C or a signal) at step {trainer.global_step},"
                f" epoch {trainer.current_epoch}; the run stops here"
            )

        # [Note: interrupt log] in lightning_zero/tools/interrupts.py: a rank blocked in a collective logs it too.
        with InterruptLog(log, interrupted) as interrupts:
            try:
                out = fit_and_validate(**parts)
            except (KeyboardInterrupt, SystemExit):
                interrupts.log_once()
                raise
    if out["trainer"].is_global_zero:
        _report(out, hydra_cfg.runtime.output_dir, hydra_cfg.job.name)
    value = out["metrics"].get(cfg.get("optimized_metric") or "")
    return value


def cli() -> None:
    """The console script: the command line checked (:func:`~lightning_zero.tools.overrides.check_overrides`), then
    :func:`main`."""
    try:
        check_overrides(sys.argv[1:])
    except OverrideError as err:
        raise SystemExit(f"lightning-zero-train: invalid override: {err}") from None
    main()


if __name__ == "__main__":
    cli()
