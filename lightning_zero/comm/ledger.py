"""The byte ledger: every collective call of the shim (:mod:`lightning_zero.comm.collectives`, and the ring it
may run, :mod:`lightning_zero.comm.ring`) records ``(op, tag, input bytes)`` here, so tests and benchmarks can say
how many bytes a step put on the wire and in which calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CommLedger:
    """Counts collective calls and input bytes per ``(op, tag)``.

    ``records`` keeps every call in order so a test can slice the ledger around one micro-batch.
    """

    records: list[tuple[str, str, int]] = field(default_factory=list)

    def record(self, op: str, tag: str, nbytes: int) -> None:
        self.records.append((op, tag, nbytes))

    def reset(self) -> None:
        self.records.clear()

    def _select(self, op: str | None, tag: str | None) -> list[int]:
        return [b for o, t, b in self.records if (op is None or o == op) and (tag is None or t == tag)]

    def bytes(self, op: str | None = None, tag: str | None = None) -> int:
        """Total input bytes of the calls matching ``op`` and ``tag`` (``None`` matches any)."""
        return sum(self._select(op, tag))

    def calls(self, op: str | None = None, tag: str | None = None) -> int:
        """Number of calls matching ``op`` and ``tag`` (``None`` matches any)."""
        return len(self._select(op, tag))

    def summary(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(op, tag): (calls, bytes)}``."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for op, tag, nbytes in self.records:
            calls, total = out.get((op, tag), (0, 0))
            out[(op, tag)] = (calls + 1, total + nbytes)
        return out


LEDGER = CommLedger()
"""The process-wide ledger every call of :mod:`lightning_zero.comm.collectives` and :mod:`lightning_zero.comm.ring`
records into."""
