"""An audit of a fit in the Byzantine ranks mode: every rank's weights digest after every optimizer step, and the
evictions it decided, written per rank; :func:`summarize` checks the files against the mode's promises.

Runbook::

    lightning-zero-train experiment=robust_digits trainer.devices=4 strategy.byzantine_ranks=1 \\
        strategy.workers_per_rank=2 strategy.byzantine_rank_behaviour=equivocate \\
        +callbacks.byzantine_audit._target_=lightning_zero.byzantine.audit.ByzantineAudit \\
        +callbacks.byzantine_audit.output_dir='${paths.output_dir}'
    # -> <run dir>/byzantine_audit/rank<r>.json on every rank that finished the fit
    python -c "from lightning_zero.byzantine.audit import read, summarize; print(summarize(read('<run dir>'), [3], 4))"

Each file holds ``digests`` (the sha256 of the module's state dict, parameters and buffers, after each optimizer step,
in step order), ``evictions`` (``[step, rank, why]``, the step after which the rank left) and ``members`` (the
membership at the end). A rank that crashed or was evicted writes what it saw until it stopped taking part; a
rank whose process died writes nothing. The digests are of the module this rank trains: under the mode every honest
rank applies the agreed aggregate, so their digests must agree at every step (safety).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

AUDIT_DIR = "byzantine_audit"


def state_digest(module: torch.nn.Module) -> str:
    """The sha256 of ``module``'s state dict: every tensor's name, dtype, shape and bytes, in key order."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{t.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class ByzantineAudit(pl.Callback):
    """Records this rank's weights digest after every optimizer step and, at the end of the fit, writes it with the
    Byzantine exchange's evictions and membership to ``<output_dir>/byzantine_audit/rank<r>.json``.

    Args:
        output_dir: where the ``byzantine_audit`` folder goes; default: the Trainer's ``default_root_dir``.
    """

    def __init__(self, output_dir: str | os.PathLike[str] | None = None) -> None:
        self.output_dir = output_dir
        self.digests: list[str] = []
        self._step = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.digests, self._step = [], trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step != self._step:  # an optimizer step ran in this batch
            self._step = trainer.global_step
            self.digests.append(state_digest(pl_module))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        exchange = getattr(getattr(trainer.strategy, "robust_engine", None), "exchange", None)
        members = getattr(exchange, "members", None)
        record = {
            "rank": trainer.global_rank,
            "digests": self.digests,
            "evictions": [list(e) for e in getattr(exchange, "evictions", [])],
            "members": list(members.members) if members is not None else None,
        }
        folder = Path(self.output_dir if self.output_dir is not None else trainer.default_root_dir) / AUDIT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{trainer.global_rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(record))
        path.with_suffix(".tmp").replace(path)


def read(run_dir: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """The audit files of a run, by rank."""
    records = [json.loads(p.read_text()) for p in sorted((Path(run_dir) / AUDIT_DIR).glob("rank*.json"))]
    return {r["rank"]: r for r in records}


def summarize(audits: Mapping[int, Mapping[str, Any]], faulty: Sequence[int], world_size: int) -> dict[str, Any]:
    """What a run's audit files show, the faulty ranks known.

    - ``safe``: every honest rank wrote a file, with the same number of steps, and their digests agree at every
      step; ``first_divergence``: the first step where they do not (or ``None``).
    - ``honest_evicted``: the honest ranks any honest rank evicted (must be empty).
    - ``faulty_evicted``: for each faulty rank, the first step after which an honest rank evicted it, or ``None``;
      ``evicted_by_all``: whether every honest rank evicted it at that same step.
    """
    honest = [r for r in range(world_size) if r not in faulty]
    missing = [r for r in honest if r not in audits]
    steps = {len(audits[r]["digests"]) for r in honest if r in audits}
    first = None
    if not missing and len(steps) == 1:
        for step, digests in enumerate(zip(*(audits[r]["digests"] for r in honest))):
            if len(set(digests)) > 1:
                first = step
                break
    evictions = {r: {(step, rank) for step, rank, _ in audits[r]["evictions"]} for r in honest if r in audits}
    honest_evicted = sorted({rank for seen in evictions.values() for _, rank in seen if rank in honest})
    faulty_evicted: dict[int, int | None] = {}
    agreed: dict[int, bool] = {}
    for bad in faulty:
        when = [min((s for s, rank in seen if rank == bad), default=None) for seen in evictions.values()]
        known = [w for w in when if w is not None]
        faulty_evicted[bad] = min(known) if known else None
        agreed[bad] = bool(known) and len(known) == len(when) and len(set(known)) == 1
    return {
        "safe": not missing and len(steps) == 1 and first is None,
        "missing": missing,
        "steps": steps.pop() if len(steps) == 1 else sorted(steps),
        "first_divergence": first,
        "honest_evicted": honest_evicted,
        "faulty_evicted": faulty_evicted,
        "evicted_by_all": agreed,
    }
