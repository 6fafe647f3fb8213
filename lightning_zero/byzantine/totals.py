"""The rules' totals in the Byzantine ranks mode: a member's rounds run in lockstep and meet at each call of
``total``, whose per-shard partial sums are then replicated like the results ([Note: Byzantine totals] in
:mod:`lightning_zero.byzantine.step`).

Runbook (inside :meth:`lightning_zero.byzantine.step.StepProtocol.run`)::

    totals = Lockstep(protocol, step, rounds=2 * f + 1, proofs=proofs, incomplete=set())
    shard = ColumnShard(..., total=functools.partial(totals.total, j))   # round j's, in its own thread
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

from lightning_zero.byzantine import inputs
from lightning_zero.byzantine.inputs import Proof

TOTALS = 16
"""The transport phase of the first call of ``total`` in a step (the ``t``-th: ``TOTALS + t``)."""


class Lockstep:
    """The shared ``total`` of one member's rounds ([Note: Byzantine totals])."""

    def __init__(self, protocol: Any, step: int, rounds: int, proofs: dict[int, Proof], incomplete: set[int]) -> None:
        self.protocol, self.step, self.proofs, self.incomplete = protocol, step, proofs, incomplete
        self.calls = 0
        self.error: BaseException | None = None
        self._partials: list[Tensor | None] = [None] * rounds
        self._result: Tensor | None = None
        self._barrier = threading.Barrier(rounds, action=self._exchange, timeout=protocol.timeout_s * 4)
        self._shards = protocol.membership.shards_of(protocol.me)

    def abort(self) -> None:
        self._barrier.abort()

    def total(self, j: int, partial: Tensor) -> Tensor:
        """Round ``j``'s partial sums -> the totals over every shard (when every round has handed its own)."""
        self._partials[j] = partial
        self._barrier.wait()
        assert self._result is not None
        return self._result.clone()

    def _exchange(self) -> None:
        try:
            partials = [p for p in self._partials if p is not None]
            like = partials[0]
            mine = {
                s: inputs.piece_bytes(p.reshape(1, -1))
                for s, p in zip(self._shards, partials)
                if s not in self.incomplete
            }
            phase = TOTALS + self.calls
            self.calls += 1
            accepted = self.protocol.replicated(self.step, phase, mine, "byzantine_totals", self.proofs, "partial sum")
            total = torch.zeros_like(like)
            for shard in range(self.protocol.membership.n):
                total += inputs.piece_tensor(accepted[shard], 1, like.dtype).reshape(like.shape)
            self._result = total
        except BaseException as err:
            self.error = err
            raise
