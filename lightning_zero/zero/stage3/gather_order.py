"""ZeRO-3's guard against ranks that run their collectives in different orders, with one blocking exchange per
divergence.

[Note: gather sequence check] ZeRO-3 hangs or corrupts weights when ranks issue its collectives in different orders
(a data-dependent branch that skips or repeats a unit on one rank, a unit whose backward completes earlier on one
rank): the all-gathers and reduce-scatters of different units pair up on the wire, and on gloo two messages of
different sizes abort the process. So each unit's all-gather and each unit's gradient reduce-scatter is launched only
once it is known to pair with the same collective on every rank:

- *planned*: the ``c``-th collective of a pass is the one the previous pass of the same *mode* (training with or
  without gradient synchronisation, evaluation) issued ``c``-th (the *plan*). Every rank holds the same plans
  (checked below), so it needs no exchange. In steady training every collective is planned.
- *unplanned*: anything else (the first pass, a changed control flow). The ranks first exchange ``(kind, unit,
  count)`` (32 bytes, blocking) and raise an error naming both sides if they differ, before any of them waits in the
  collective itself.
- *end of pass* (end of backward, end of an evaluation step: the same points on every rank): the ranks exchange the
  number of collectives and a digest of the pass's sequence, asynchronously; it is checked before the next
  collective, so no rank follows a plan that differs from another rank's.

A rank that leaves the plan while the others follow it blocks in the exchange until one of them reaches its own next
exchange (an error naming the units) or until the timeout (an error naming this rank's unit; [Note: collective
watchdog] in ``lightning_zero/comm/watchdog.py``). The exchanges run on a gloo group of their own: on the data group
they would queue behind in-flight gathers and reductions.

Why not block before every gather (the first version did): each exchange waits for the slowest rank, so 13 gathers
per step on the 27M GPT of ``benchmarks/step_time.py`` meant 13 lockstep points; on CUDA a blocked CPU also stops
queueing kernels. Interleaved on 2 CPU ranks (two runs of 4 rounds), exposed communication per step: blocking 161 and
135 ms, this scheme 143 and 110 ms. Why not exchange asynchronously beside every planned gather, so that a rank
leaving the plan after the first pass is named at once rather than at the timeout: measured 257 ms in the second run,
worse than blocking.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero.comm import collectives as comm
from lightning_zero.comm import watchdog

GATHER, END, REDUCE = 0, 1, 2
"""Kinds of exchange entries: a gather, the end of a pass, a gradient reduction."""

_DIGEST_MODULUS = 2**61 - 1


def code(kind: int, unit: int) -> int:
    """A collective of a sequence: unit ``unit``'s gather or reduction."""
    return 2 * unit + (kind == REDUCE)


def extend_digest(digest: int, entry: int) -> int:
    """Digest of a sequence extended by ``entry`` (order-sensitive; fits an int64)."""
    return (digest * 1_000_003 + entry + 1) % _DIGEST_MODULUS


def is_planned(plan: Sequence[int], position: int, entry: int) -> bool:
    """Whether ``entry`` as the pass's collective number ``position`` follows ``plan``."""
    return position < len(plan) and plan[position] == entry


def _name(entry: int, labels: Sequence[str]) -> str:
    return f"{'reduce' if entry % 2 else 'gather'} {labels[entry // 2]!r}"


def disagreement(entries: Sequence[Sequence[int]], me: int, labels: Sequence[str], sequence: Sequence[int]) -> str:
    """The error message for exchange ``entries`` (one ``(kind, unit, count, digest)`` per rank), or ``""`` if every
    rank agrees with rank ``me``. ``sequence`` is rank ``me``'s collectives (codes) in the pass that the entry ends
    (if it does)."""

    def what(rank: int) -> str:
        kind, unit, count, _ = entries[rank]
        if kind == GATHER:
            return f"rank {rank} gathers unit {labels[unit]!r} as its collective #{count}"
        if kind == REDUCE:
            return f"rank {rank} reduce-scatters the gradients of unit {labels[unit]!r} as its collective #{count}"
        return f"rank {rank} ended its pass after {count} collectives"

    mine = tuple(entries[me])
    for rank, entry in enumerate(entries):
        if tuple(entry) == mine:
            continue
        if mine[0] == END and entry[0] == END:
            ran = ", ".join(_name(e, labels) for e in sequence)
            return (
                f"ZeRO-3 collective sequence diverged in the pass that just ended: rank {me} ran [{ran}] in it"
                f" ({mine[2]} collectives in all) while rank {rank} ran a different sequence ({entry[2]} in all)."
                + _ADVICE
            )
        return f"ZeRO-3 collective sequence diverged: {what(me)} while {what(rank)}." + _ADVICE
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
        mode: Callable[[], Hashable] = lambda: None,
    ) -> None:
        self.labels = list(labels)
        self.rank = comm.rank(group)
        self.active = comm.world_size(group) > 1
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if self.active else None
        if check_group is None and ranks:
            check_group = dist.new_group(ranks, timeout=timeout, backend="gloo")
        self.group = check_group if self.active else None
        self._mode = mode  # which plan a pass follows (read at its first collective)
        self.count = 0  # collectives over the engine's life
        self.plans: dict[Hashable, list[int]] = {}  # each mode's last pass: the same on every rank
        self.sequence: list[int] = []  # this pass's collectives (codes)
        self._plan: list[int] = []
        self._pass_mode: Hashable = None
        self._digest = 0
        self._end: tuple[torch.Tensor, list[int], comm.Handle | None] | None = None

    def before_gather(self, unit: int) -> None:
        """Call before launching unit ``unit``'s all-gather; raises if the ranks disagree (see the note)."""
        self._before(GATHER, unit)

    def before_reduce(self, unit: int) -> None:
        """Call before launching unit ``unit``'s gradient reduction; raises if the ranks disagree."""
        self._before(REDUCE, unit)

    def _before(self, kind: int, unit: int) -> None:
        entry = code(kind, unit)
        if not self.sequence:
            self._pass_mode = self._mode()
            self._plan = self.plans.get(self._pass_mode, [])
        if self.active:
            self._settle()
            if not is_planned(self._plan, len(self.sequence), entry):
                everyone, _ = self._exchange(kind, unit, async_op=False)
                self._check(everyone, self.sequence)
        self.sequence.append(entry)
        self._digest = extend_digest(self._digest, entry)
        self.count += 1

    def end_pass(self) -> None:
        """Call at the end of every pass (the same points on every rank): this pass's collectives become its mode's
        plan."""
        if self.active:
            self._settle()
            everyone, handle = self._exchange(END, -1, async_op=True)
            self._end = (everyone, self.sequence, handle)  # the list becomes the plan: never mutated again
        if self.sequence:
            self.plans[self._pass_mode] = self.sequence
        self.sequence, self._digest = [], 0

    def _exchange(self, kind: int, unit: int, *, async_op: bool) -> tuple[torch.Tensor, comm.Handle | None]:
        mine = torch.tensor([kind, unit, self.count, self._digest], dtype=torch.int64)
        everyone = torch.empty(4 * comm.world_size(self.group), dtype=torch.int64)
        try:
            with watchdog.doing(f"the ZeRO-3 sequence check {self._at(kind, unit)}"):
                handle = comm.all_gather(everyone, mine, group=self.group, async_op=async_op, tag="gather_check")
        except watchdog.CollectiveTimeout:  # names all of it already
            raise
        except RuntimeError as error:  # the process group's timeout: the others never reached a matching exchange
            raise RuntimeError(self._timed_out(kind, unit)) from error
        return everyone, handle

    def _settle(self) -> None:
        """Check the previous pass's end (its exchange completed long ago in a healthy run)."""
        if self._end is not None:
            everyone, sequence, handle = self._end
            self._end = None
            try:
                if handle is not None:
                    with watchdog.doing(f"the ZeRO-3 sequence check {self._at(END, -1)}"):
                        handle.wait()
            except watchdog.CollectiveTimeout:
                raise
            except RuntimeError as error:
                raise RuntimeError(self._timed_out(END, -1)) from error
            self._check(everyone, sequence)

    def _check(self, everyone: torch.Tensor, sequence: Sequence[int]) -> None:
        message = disagreement(everyone.view(-1, 4).tolist(), self.rank, self.labels, sequence)
        if message:
            raise RuntimeError(message)

    def _at(self, kind: int, unit: int) -> str:
        where = {GATHER: "before gathering unit", REDUCE: "before reducing the gradients of unit"}
        return f"{where[kind]} {self.labels[unit]!r}" if kind in where else "at the end of a pass"

    def _timed_out(self, kind: int, unit: int) -> str:
        return (
            f"ZeRO-3 collective sequence check timed out on rank {self.rank} {self._at(kind, unit)} (collective"
            f" #{self.count}): another"
            " rank never reached a matching point, e.g. it gathered a different unit or ran units a different number"
            " of times." + _ADVICE
        )
