"""lightning_zero.byzantine.costs: the formulas of [Note: step costs] against the ledger of real steps (threads with
real transports), frame for frame and byte for byte, and the variants' growth."""

from __future__ import annotations

import pytest

from lightning_zero.byzantine.costs import hotstuff_step, pbft_step
from lightning_zero.byzantine.membership import Membership
from lightning_zero.comm import collectives as comm
from tests.byzantine.test_step import D, K, run_step

pytest.importorskip("cryptography")


@pytest.mark.parametrize(("n", "f"), [(4, 1), (7, 2)])
def test_the_formulas_are_the_ledger_of_a_fault_free_step(n, f):
    comm.LEDGER.reset()
    out = run_step(n, f, "median")
    assert all(not isinstance(out[r], Exception) for r in range(n))
    measured = {tag: v for (op, tag), v in comm.LEDGER.summary().items() if op == "signed_send"}
    expected = pbft_step(n, f, D, K, itemsize=4, totals=[n * K * 4, 4])  # the median: row counts, the distance
    # A member that learns the decision (from another's decision message) before it voted sends no more votes: each
    # such vote is one 32-byte frame to each of the n - 1 others fewer than the formula's full count.
    frames, nbytes = measured.pop("agreement")
    full_frames, full_bytes = expected.pop("agreement")
    skipped = full_frames - frames
    assert skipped % (n - 1) == 0 and 0 <= skipped <= 2 * n * (n - 1), (frames, full_frames)
    assert nbytes == full_bytes - skipped * (32 + 32 + 64)
    assert measured == expected


def test_the_built_variant_grows_as_n_to_the_fifth_and_the_linear_one_as_n_cubed_outside_the_data():
    def control(costs):  # everything but the rows and results, which both variants move alike
        return costs["agreement"][1] + costs["byzantine_echo"][1]

    small = {n: (pbft_step(n, (n - 1) // 3, 1000), hotstuff_step(n, (n - 1) // 3, 1000)) for n in (64, 128)}
    assert 28 < control(small[128][0]) / control(small[64][0]) < 36  # doubling n: ~2^5
    assert 7 < control(small[128][1]) / control(small[64][1]) < 9  # ~2^3: n proposals of n commitments of n digests
    assert small[128][0]["byzantine_inputs"] == small[128][1]["byzantine_inputs"]
    assert Membership.of(128, 42).quorum == 86
