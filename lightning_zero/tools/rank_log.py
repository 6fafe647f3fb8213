"""Every rank's log in the run directory, whichever launcher started it.

Ranks that Lightning's popen launcher starts re-run the Hydra app, so Hydra's job logging already writes them to
``<run dir>/train_ddp_process_<local rank>.log``. Ranks started by a spawn launcher (``strategy.start_method=spawn``)
run only the training function: nothing configures their logging and their messages would go to the terminal only.
:class:`RankLogFile` gives them the same file, and records in every rank's log its process id, so a run (or a test)
can tell which processes it started.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

log = logging.getLogger(__name__)

# Hydra's default job-logging format, so popen- and spawn-started ranks' files read alike.
_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def rank_log_path(dirpath: str | os.PathLike, local_rank: int) -> Path:
    """``<dirpath>/train_ddp_process_<local_rank>.log``: the name Lightning's popen launcher gives rank ``r``'s job."""
    return Path(dirpath) / f"train_ddp_process_{local_rank}.log"


class RankLogFile(Callback):
    """On ranks > 0, log to :func:`rank_log_path` unless a handler already does (Hydra's, for popen ranks).

    Args:
        dirpath: the run directory (``${paths.output_dir}`` in the configs).
    """

    def __init__(self, dirpath: str | os.PathLike) -> None:
        self.dirpath = Path(dirpath)
        self._handler: logging.Handler | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.global_rank == 0:
            return
        path = rank_log_path(self.dirpath, trainer.local_rank).resolve()
        root = logging.getLogger()
        has_file = any(getattr(h, "baseFilename", None) == str(path) for h in root.handlers)
        if not has_file and self._handler is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._handler = logging.FileHandler(path)
            self._handler.setFormatter(logging.Formatter(_FORMAT))
            root.addHandler(self._handler)
            if root.getEffectiveLevel() > logging.INFO:
                root.setLevel(logging.INFO)
        log.info(
            "rank %d of %d (pid %d): %s with %s",
            trainer.global_rank,
            trainer.world_size,
            os.getpid(),
            getattr(stage, "value", stage),  # a TrainerFn enum: "fit", "validate", ...
            type(trainer.strategy).__name__,
        )

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.global_rank == 0:
            return
        stage = getattr(stage, "value", stage)
        log.info("rank %d of %d (pid %d): %s done", trainer.global_rank, trainer.world_size, os.getpid(), stage)
        if self._handler is not None:
            logging.getLogger().removeHandler(self._handler)
            self._handler.close()
            self._handler = None
