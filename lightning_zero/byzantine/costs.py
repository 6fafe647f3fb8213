"""Messages and bytes of one fault-free step of the Byzantine ranks mode, by phase, as formulas: the protocol as
built (PBFT-style, :mod:`lightning_zero.byzantine.step`), which ``tests/byzantine/test_costs.py`` checks against the
ledger of real runs byte for byte, and a HotStuff-style variant with linear votes, for the choice between them at
scale (``benchmarks/byzantine_scale.py`` prints both from 16 to 1024 ranks).

Runbook::

    pbft_step(n=4, f=1, d=27_400_000, k=1)            # {"byzantine_inputs": (messages, bytes), ...}
    hotstuff_step(n=1024, f=341, d=27_400_000, k=1)   # the same phases, linear agreement

[Note: step costs] Sizes of the wire format (:mod:`lightning_zero.byzantine.wire`): a frame is a 32-byte header, the
payload and a 64-byte signature; each packed part carries a 4-byte length; a held signed claim is 128 bytes; an
integer 8. With ``n`` members, ``q`` the quorum, shard ``c`` of ``w_c`` columns (ZeRO's partition of ``d``), ``k``
rows of ``b`` bytes per value and a commitment of ``C = 12 + 16 + len(dtype) + 36 n`` bytes, the built protocol sends
per step, over all ranks:

- inputs: ``n (n - 1)`` frames; the one to member ``j`` holds the commitment, its claim and ``k w_c b`` bytes for
  each of ``j``'s ``2f + 1`` shards: the columns are sent ``2f`` times over (each shard's aggregators but the owner);
- echo: ``n (n - 1)`` frames of ``n`` signed commitments each, ``O(n^2)`` bytes a frame;
- agreement: ``n - 1`` pre-prepares holding the proposal (``n`` commitments and the ``n`` echoes it rests on,
  ``O(n^3)`` bytes), ``2 n (n - 1)`` votes of 32 bytes, and ``n (n - 1)`` decisions, each carrying the proposal and
  ``q`` signed commits: ``O(n^5)`` bytes for the step, the term that rules out this variant beyond a few dozen ranks;
- requests: ``n (n - 1)`` empty frames; totals: ``n (n - 1)`` frames per call of the rule's ``total``; results:
  ``n (n - 1)`` frames with each sender's ``2f + 1`` shard results.

The HotStuff-style variant (not built) keeps inputs and results, sends the echo to the leader only (``n`` digests
per frame), and runs three voting phases each of ``n - 1`` votes to the leader and ``n - 1`` quorum certificates
from it; a certificate is an aggregate signature (96 bytes) and a bitmap of signers. Its proposal holds the ``n``
commitments (of ``n`` digests each) and, per member, one aggregate attestation of the holders of its columns:
``O(n^2)`` bytes, sent ``n - 1`` times, ``O(n^3)`` for the step. Threshold or aggregate signatures (BLS) are what
make its votes linear; this project's Ed25519 claims are not aggregatable, which is why the built variant stays
PBFT-style for the process counts a Lightning job has (the numbers: ``docs/benchmarks.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_zero.byzantine.membership import Membership
from lightning_zero.robust.shards import column_ranges

HEADER, SIGNATURE, LENGTH, INT, CLAIM, DIGEST = 32, 64, 4, 8, 128, 32
AGGREGATE_SIGNATURE = 96
"""A BLS aggregate signature (the HotStuff-style variant's quorum certificates)."""


def _frame(payload: int) -> int:
    return HEADER + payload + SIGNATURE


def _packed(*parts: int) -> int:
    return sum(LENGTH + p for p in parts)


def commitment_bytes(n: int, dtype: str = "torch.float32") -> int:
    """``C``: width, rows, dtype and ``n`` digests, packed."""
    return _packed(INT, INT, len(dtype), *([DIGEST] * n))


def _widths(n: int, d: int) -> list[int]:
    return [hi - lo for lo, hi in column_ranges(d, n).values()]


def pbft_step(
    n: int, f: int, d: int, k: int = 1, itemsize: int = 4, totals: Sequence[int] = (), dtype: str = "torch.float32"
) -> dict[str, tuple[int, int]]:
    """``{ledger tag: (frames, bytes)}`` of one fault-free step of the built protocol ([Note: step costs]); ``totals``:
    the partial sums' bytes of each call of the rule's ``total`` (the median: ``n k`` non-finite counts, then the
    honest-distance scalar, in float32)."""
    members = Membership.of(n, f)
    widths = _widths(n, d)
    c = commitment_bytes(n, dtype)
    pairs = n * (n - 1)

    def to(j: int) -> int:  # the input frame to member j
        return _frame(_packed(c, CLAIM, *(k * widths[s] * itemsize for s in members.shards_of(j))))

    entry = _packed(c, CLAIM, 1)
    echo = _packed(_packed(*([entry] * n)), _packed())  # the commitments, no proof to spread
    entries, echoes = _packed(*([_packed(c, CLAIM)] * n)), _packed(*([_packed(INT, echo, CLAIM)] * n))
    proposal = _packed(entries, echoes, _packed())  # no eviction
    decision = _packed(INT, proposal, *([CLAIM] * members.quorum))

    results = [w * itemsize for w in widths]

    def shards_payload(i: int, size: Sequence[int]) -> int:
        return _packed(*(_packed(INT, size[s]) for s in members.shards_of(i)))

    out = {
        "byzantine_inputs": (pairs, (n - 1) * sum(to(j) for j in range(n))),
        "byzantine_echo": (pairs, pairs * _frame(echo)),
        "agreement": (
            (n - 1) + 2 * pairs + pairs,
            (n - 1) * _frame(_packed(proposal)) + 2 * pairs * _frame(DIGEST) + pairs * _frame(decision),
        ),
        "byzantine_request": (pairs, pairs * _frame(0)),
        "byzantine_results": (pairs, (n - 1) * sum(_frame(shards_payload(i, results)) for i in range(n))),
    }
    if totals:
        per_call = [(n - 1) * sum(_frame(shards_payload(i, [t] * n)) for i in range(n)) for t in totals]
        out["byzantine_totals"] = (pairs * len(totals), sum(per_call))
    return out


def hotstuff_step(
    n: int, f: int, d: int, k: int = 1, itemsize: int = 4, totals: Sequence[int] = (), dtype: str = "torch.float32"
) -> dict[str, tuple[int, int]]:
    """The same step with HotStuff-style agreement ([Note: step costs]): the data phases as built, the echo to the
    leader, three phases of votes to the leader and aggregate certificates from it."""
    built = pbft_step(n, f, d, k, itemsize, totals, dtype)
    c = commitment_bytes(n, dtype)
    bitmap = -(-n // 8)
    certificate = _packed(INT, DIGEST, AGGREGATE_SIGNATURE, bitmap)
    proposal = _packed(_packed(*([_packed(c, CLAIM)] * n)), _packed(*([_packed(AGGREGATE_SIGNATURE, bitmap)] * n)))
    out = dict(built)
    out["byzantine_echo"] = (n - 1, (n - 1) * _frame(_packed(*([DIGEST] * n))))
    out["agreement"] = (
        (n - 1) + 3 * 2 * (n - 1),
        (n - 1) * _frame(_packed(proposal)) + 3 * (n - 1) * (_frame(DIGEST) + _frame(certificate)),
    )
    return out
