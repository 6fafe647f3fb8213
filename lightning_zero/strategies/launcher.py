"""How the strategies launch their processes, like Lightning's ``ddp``.

``start_method="popen"`` re-runs the script once per extra local rank (Lightning's subprocess launcher, as it is);
``"spawn"``/``"fork"``/``"forkserver"`` start workers with :mod:`torch.multiprocessing` (:class:`SpawnLauncher`:
Lightning's multiprocessing launcher with two fixes). When the processes are created outside (``torchrun``, SLURM),
Lightning's cluster environment says so and nothing is launched.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from typing_extensions import override

from lightning_zero.training.preemption import Preempted


class SpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher, with each worker's process group destroyed before the worker exits.

    A worker that exits with its gloo process group alive was measured to abort now and then ("terminate called
    without an active exception", SIGABRT) while the interpreter shuts down, failing a ``trainer.validate`` that
    itself succeeded; it happened in sweeps of spawn jobs under load.

    A worker that stops on preemption (:class:`~lightning_zero.training.preemption.Preempted`) hands that to the
    main process, which raises it in turn: Lightning's launcher would otherwise wait forever for rank 0's results.
    """

    @override
    def _wrapping_function(
        self,
        process_idx: int,
        trainer: Any,
        function: Any,
        args: Any,
        kwargs: Any,
        return_queue: Any,
        global_states: Any = None,
    ) -> None:
        try:
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue, global_states)
        except Preempted as preempted:
            if process_idx == 0:
                return_queue.put(preempted)
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()

    @override
    def _recover_results_in_main_process(self, worker_output: Any, trainer: pl.Trainer) -> None:
        if isinstance(worker_output, Preempted):
            raise worker_output
        super()._recover_results_in_main_process(worker_output, trainer)
