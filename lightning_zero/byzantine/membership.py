"""Who takes part in the Byzantine ranks mode, and the counting that its guarantees rest on: pure, no processes.

Runbook::

    members = Membership.of(world_size=7, f=2)     # ranks 0..6, up to 2 Byzantine: n >= 3f + 1 checked
    members.quorum                                 # 5: any two quorums share f + 1 ranks, so an honest one
    members.leader(step=3, view=1)                 # the rank that proposes step 3's value in view 1
    members.aggregators(shard=6)                   # (6, 0, 1, 2, 3): the 2f + 1 ranks that aggregate shard 6
    members.shards_of(rank=2)                      # (2, 1, 0, 6, 5): the shards rank 2 aggregates
    members = members.without(4)                   # rank 4 evicted: 6 ranks, f = 1

[Note: counting] With ``n`` members of which at most ``f`` are Byzantine and ``n >= 3f + 1``:

- a *quorum* is ``ceil((n + f + 1) / 2)`` members (``2f + 1`` at ``n = 3f + 1``). Two quorums share at least ``f + 1``
  members, so at least one honest one: two conflicting values cannot both gather a quorum of signed votes. The
  ``n - f`` honest members alone form a quorum, so faulty members cannot block one by staying silent.
- each column shard is aggregated by ``2f + 1`` members (the member at the shard's index and the ``2f`` after it,
  cyclically). At least ``f + 1`` of them are honest and compute the same result from the same agreed inputs: a
  result that ``f + 1`` aggregators signed identically is that result, and no other result can gather ``f + 1``.
- a member proven faulty and evicted was one of the ``f``: the remaining ``n - 1`` members hold at most ``f - 1``
  faulty ones, and ``n - 1 >= 3(f - 1) + 1`` still holds. :meth:`Membership.without` lowers ``f`` with ``n``.

Shards and leaders are indexed by position among the members (sorted ranks), so every honest rank derives the
same assignment from the same membership.
"""

from __future__ import annotations

from dataclasses import dataclass


def check_f(f: object, world_size: int | None = None) -> None:
    """``f`` (the Byzantine ranks tolerated) is an integer ``>= 1`` with ``world_size >= 3f + 1`` (``None``: the world
    size is not known yet)."""
    if isinstance(f, bool) or not isinstance(f, int) or f < 1:
        raise ValueError(f"byzantine_ranks={f!r} is invalid: expected an integer >= 1 (0 turns the mode off)")
    if world_size is not None and world_size < 3 * f + 1:
        raise ValueError(
            f"byzantine_ranks={f} needs at least 3f + 1 = {3 * f + 1} processes, got {world_size}: with fewer, f faulty"
            f" ranks can split the honest ones; the largest f for {world_size} processes is {(world_size - 1) // 3}"
        )


@dataclass(frozen=True)
class Membership:
    """The ranks taking part (``members``, sorted) and ``f``, the faulty ones among them tolerated."""

    members: tuple[int, ...]
    f: int

    def __post_init__(self) -> None:
        if tuple(sorted(set(self.members))) != self.members:
            raise ValueError(f"members={self.members} is invalid: expected distinct ranks in increasing order")
        if self.f > 0:
            check_f(self.f, len(self.members))

    @classmethod
    def of(cls, world_size: int, f: int) -> Membership:
        """Ranks ``0 .. world_size - 1``, ``f`` of them possibly Byzantine."""
        check_f(f, world_size)
        return cls(tuple(range(world_size)), f)

    @property
    def n(self) -> int:
        return len(self.members)

    @property
    def quorum(self) -> int:
        """``ceil((n + f + 1) / 2)``: see [Note: counting]."""
        return (self.n + self.f + 2) // 2

    @property
    def aggregators_per_shard(self) -> int:
        """``2f + 1`` (every member when the membership is smaller than that)."""
        return min(2 * self.f + 1, self.n)

    @property
    def acceptance(self) -> int:
        """``f + 1``: identical signed results that make a shard result accepted."""
        return self.f + 1

    def index(self, rank: int) -> int:
        """``rank``'s position among the members."""
        try:
            return self.members.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not a member: members are {list(self.members)}") from None

    def leader(self, step: int, view: int) -> int:
        """The member proposing ``step``'s value in ``view``: rotating with the step and with each view change."""
        return self.members[(step + view) % self.n]

    def aggregators(self, shard: int) -> tuple[int, ...]:
        """The ranks aggregating column ``shard`` (``0 <= shard < n``): positions ``shard, shard + 1, ...`` mod n."""
        if not 0 <= shard < self.n:
            raise ValueError(f"shard={shard} is invalid: expected 0 <= shard < n={self.n}")
        return tuple(self.members[(shard + j) % self.n] for j in range(self.aggregators_per_shard))

    def shards_of(self, rank: int) -> tuple[int, ...]:
        """The shards ``rank`` aggregates, in the order of :meth:`aggregators`' rounds: ``index - j`` mod n."""
        i = self.index(rank)
        return tuple((i - j) % self.n for j in range(self.aggregators_per_shard))

    def without(self, rank: int) -> Membership:
        """The membership after ``rank``, proven faulty, is evicted: one member and one tolerated fault fewer."""
        self.index(rank)
        return Membership(tuple(r for r in self.members if r != rank), max(self.f - 1, 0))
