"""ZeRO-3's guard against ranks that gather units in different orders, with one blocking exchange per divergence.

[Note: gather sequence check] ZeRO-3 hangs or corrupts weights when ranks gather units in different orders (a
data-dependent branch that skips or repeats a unit on one rank): the all-gathers of two different units pair up on
the wire, and on gloo two messages of different sizes abort the process. So a gather is launched only once it is
known to pair with the same gather on every rank:

- *planned gather*: the ``c``-th gather of a pass is the unit the previous pass gathered ``c``-th (the *plan*).
  Every rank holds the same plan (checked below), so it needs no exchange. In steady training every gather is
  planned.
- *unplanned gather*: anything else (the first pass, a changed control flow, evaluation after training). The ranks
  first exchange ``(unit, gather count)`` (32 bytes, blocking) and raise an error naming both units if they differ.
- *end of pass* (end of backward, end of an evaluation step: the same points on every rank): the ranks exchange the
  number of gathers and a digest of the pass's sequence, asynchronously; it is checked before the next gather, so no
  rank follows a plan that differs from another rank's.

A rank that leaves the plan while the others follow it blocks in the exchange until one of them reaches its own next
exchange (an error naming the units) or until the timeout (an error naming this rank's unit). The exchanges run on a
gloo group of their own: on the data group they would queue behind in-flight gathers and reductions.

Why not block before every gather (the first version did): each exchange waits for the slowest rank, so 13 gathers
per step on the 27M GPT of ``benchmarks/step_time.py`` meant 13 lockstep points; on CUDA a blocked CPU also stops
queueing kernels. Interleaved on 2 CPU ranks (two runs of 4 rounds), exposed communication per step: blocking 161 and
135 ms, this scheme 143 and 110 ms. Why not exchange asynchronously beside every planned gather, so that a rank
leaving the plan after the first pass is named at once rather than at the timeout: measured 257 ms in the second run,
worse than blocking.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero.comm import collectives as comm

GATHER, END = 0, 1
"""Kinds of exchange entries: an unplanned gather, the end of a pass."""

_DIGEST_MODULUS = 2**61 - 1


def extend_digest(digest: int, unit: int) -> int:
    """Digest of a gather sequence extended by ``unit`` (order-sensitive; fits an int64)."""
    return (digest * 1_000_003 + unit + 1) % _DIGEST_MODULUS


def is_planned(plan: Sequence[int], position: int, unit: int) -> bool:
    """Whether gathering ``unit`` as the pass's gather number ``position`` follows ``plan``."""
    return position < len(plan) and plan[position] == unit


def disagreement(entries: Sequence[Sequence[int]], me: int, labels: Sequence[str], sequence: Sequence[int]) -> str:
    """The error message for exchange ``entries`` (one ``(kind, unit, count, digest)`` per rank), or ``""`` if every
    rank agrees with rank ``me``. ``sequence`` is rank ``me``'s gathers in the pass that the entry ends (if it does)."""

    def what(rank: int) -> str:
        kind, unit, count, _ = entries[rank]
        if kind == GATHER:
            return f"rank {rank} gathers unit {labels[unit]!r} as its gather #{count}"
        return f"rank {rank} ended its pass after {count} gathers"

    mine = tuple(entries[me])
    for rank, entry in enumerate(entries):
        if tuple(entry) == mine:
            continue
        if mine[0] == END and entry[0] == END:
            units = ", ".join(repr(labels[u]) for u in sequence)
            return (
                f"ZeRO-3 gather sequence diverged in the pass that just ended: rank {me} gathered [{units}] in it"
                f" ({mine[2]} gathers in all) while rank {rank} gathered a different sequence ({entry[2]} in all)."
                + _ADVICE
            )
        return f"ZeRO-3 gather sequence diverged: {what(me)} while {what(rank)}." + _ADVICE
    return ""


_ADVICE = (
    " Every rank must run the sharded units the same number of times in the same order (no data-dependent skipping"
    " or repeating of a unit): a module that only some ranks run (an expert, a branch) must sit inside a unit that"
    " every rank runs. Choose larger units, e.g. auto_wrap_policy={the block class that holds it}."
)


class GatherOrder:
    """The per-engine state of [Note: gather sequence check].

    Args:
        labels: a label per unit index, for messages.
        group: the data process group (``None``: the default group); the exchanges run on a gloo group over its
            ranks.
        timeout: of that gloo group (``None``: torch's default).
        check_group: that gloo group, created by the caller; ``None``: created here with
            ``torch.distributed.new_group``, which every rank must call with the same ranks, so only right when every
            rank's engine shards over the same group (not for ``tensor_parallel_scratch``'s one group per slice).
    """

    def __init__(
        self,
        labels: Sequence[str],
        *,
        group: Any = None,
        timeout: timedelta | None = None,
        check_group: Any = None,
    ) -> None:
        self.labels = list(labels)
        self.rank = comm.rank(group)
        self.active = comm.world_size(group) > 1
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if self.active else None
        if check_group is None and ranks:
            check_group = dist.new_group(ranks, timeout=timeout, backend="gloo")
        self.group = check_group if self.active else None
        self.gathers = 0  # over the engine's life
        self.plan: list[int] = []  # the previous pass's gathers: the same on every rank
        self.sequence: list[int] = []  # this pass's gathers
        self._digest = 0
        self._end: tuple[torch.Tensor, list[int], comm.Handle | None] | None = None

    def before_gather(self, unit: int) -> None:
        """Call before launching unit ``unit``'s gather; raises if the ranks disagree (see the note)."""
        if self.active:
            self._settle()
            if not is_planned(self.plan, len(self.sequence), unit):
                everyone, _ = self._exchange(GATHER, unit, async_op=False)
                self._check(everyone, self.sequence)
        self.sequence.append(unit)
        self._digest = extend_digest(self._digest, unit)
        self.gathers += 1

    def end_pass(self) -> None:
        """Call at the end of every pass (the same points on every rank): this pass's gathers become the plan."""
        if self.active:
            self._settle()
            everyone, handle = self._exchange(END, -1, async_op=True)
            self._end = (everyone, self.sequence, handle)  # the list becomes the plan: never mutated again
        self.plan, self.sequence, self._digest = self.sequence, [], 0

    def _exchange(self, kind: int, unit: int, *, async_op: bool) -> tuple[torch.Tensor, comm.Handle | None]:
        mine = torch.tensor([kind, unit, self.gathers, self._digest], dtype=torch.int64)
        everyone = torch.empty(4 * comm.world_size(self.group), dtype=torch.int64)
        try:
            handle = comm.all_gather(everyone, mine, group=self.group, async_op=async_op, tag="gather_check")
        except RuntimeError as error:  # a timeout: the other ranks never reached a matching exchange
            raise RuntimeError(self._timed_out(kind, unit)) from error
        return everyone, handle

    def _settle(self) -> None:
        """Check the previous pass's end (its exchange completed long ago in a healthy run)."""
        if self._end is not None:
            everyone, sequence, handle = self._end
            self._end = None
            try:
                if handle is not None:
                    handle.wait()
            except RuntimeError as error:
                raise RuntimeError(self._timed_out(END, -1)) from error
            self._check(everyone, sequence)

    def _check(self, everyone: torch.Tensor, sequence: Sequence[int]) -> None:
        message = disagreement(everyone.view(-1, 4).tolist(), self.rank, self.labels, sequence)
        if message:
            raise RuntimeError(message)

    def _timed_out(self, kind: int, unit: int) -> str:
        where = f"before gathering unit {self.labels[unit]!r}" if kind == GATHER else "at the end of a pass"
        return (
            f"ZeRO-3 gather sequence check timed out on rank {self.rank} {where} (gather #{self.gathers}): another"
            " rank never reached a matching point, e.g. it gathered a different unit or ran units a different number"
            " of times." + _ADVICE
        )
