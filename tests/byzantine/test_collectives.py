"""lightning_zero.byzantine.collectives: Lightning's collectives among threads with real signed transports. Every
member answers: the reductions equal the plain ones over all ranks; a silent or lying member cannot stop them or
change what the others decode beyond its own value."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_zero.byzantine.collectives import CALLS, TolerantCollectives
from lightning_zero.byzantine.membership import Membership
from lightning_zero.byzantine.step import StepProtocol
from tests.helpers.byzantine import run_members, silent

pytest.importorskip("cryptography")
TIMEOUT = 1.0  # far above a thread's message delay; each call waits it once for a silent member


class _Exchange:
    """What the collectives read of a ByzantineExchange: its protocol and its step counter."""

    def __init__(self, link: Any) -> None:
        self._protocol, self.step = StepProtocol(link, Membership.of(4, 1), timeout_s=TIMEOUT), 0

    def protocol(self) -> StepProtocol:
        return self._protocol


def value_of(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)


def calls(rank: int, link: Any) -> dict[str, Any]:
    collectives = TolerantCollectives(_Exchange(link))
    out = {"sum": collectives.all_reduce(value_of(rank), "sum"), "max": collectives.all_reduce(value_of(rank), "max")}
    out["avg"] = collectives.all_reduce(value_of(rank), "avg")
    collectives.barrier()
    out["broadcast"] = collectives.broadcast({"path": f"from rank {rank}", "n": rank}, src=1)
    out["rows"] = collectives.gather_rows(value_of(rank))
    out["gathered"] = collectives.gather_all(torch.arange(rank + 1) * 10)  # a shape of each rank's (a cat state)
    out["empty"] = collectives.gather_all(torch.zeros(0, 3))
    return out


def test_without_faults_each_call_equals_the_plain_collective_on_every_member():
    out = run_members(4, calls, {}, linger=1.0)
    stack = torch.stack([value_of(r) for r in range(4)])
    for r in range(4):
        assert torch.equal(out[r]["sum"], stack.sum(0)) and torch.equal(out[r]["max"], stack.amax(0))
        assert torch.equal(out[r]["avg"], stack.sum(0) / 4)
        assert out[r]["broadcast"] == {"path": "from rank 1", "n": 1}
        assert torch.equal(out[r]["rows"], torch.cat(list(stack)))
        assert [t.tolist() for t in out[r]["gathered"]] == [(torch.arange(q + 1) * 10).tolist() for q in range(4)]
        assert [tuple(t.shape) for t in out[r]["empty"]] == [(0, 3)] * 4


def test_a_silent_member_is_left_out_of_every_call_and_a_silent_source_leaves_each_its_own():
    out = run_members(4, calls, {1: silent}, linger=1.0)
    stack = torch.stack([value_of(r) for r in (0, 2, 3)])
    for r in (0, 2, 3):
        assert torch.equal(out[r]["sum"], stack.sum(0)) and torch.equal(out[r]["avg"], stack.sum(0) / 3)
        assert out[r]["broadcast"] == {"path": f"from rank {r}", "n": r}  # the source said nothing
        assert [len(t) for t in out[r]["gathered"]] == [1, 3, 4]  # rank 1's is missing, the others in rank order
        assert torch.equal(out[r]["rows"][2:4], torch.zeros(2, 3))  # rank 1's rows: zeros


def test_a_value_that_does_not_parse_or_decode_is_dropped():
    """Rank 2 sends garbage in every call (and a pickle of its choosing would never be unpickled)."""

    def garbage(link: Any, peer: int, step: int, phase: int, payload: bytes) -> bytes:
        return b"\x80\x04not a frame" if phase >= CALLS else payload

    out = run_members(4, calls, {2: garbage}, linger=1.0)
    stack = torch.stack([value_of(r) for r in (0, 1, 3)])
    for r in (0, 1, 3):
        assert torch.equal(out[r]["sum"], stack.sum(0))
        assert out[r]["broadcast"] == {"path": "from rank 1", "n": 1}


def test_only_the_source_of_a_broadcast_sends_its_value():
    """The others' messages of the broadcast's round are empty: it orders the call, it does not carry their values."""
    sent: dict[int, list[int]] = {0: [], 1: []}

    def recorder(rank: int) -> Any:
        def record(link: Any, peer: int, step: int, phase: int, payload: bytes) -> bytes:
            if phase == CALLS + 4:  # the fifth call of calls(): the broadcast
                sent[rank].append(len(payload))
            return payload

        return record

    out = run_members(4, calls, {0: recorder(0), 1: recorder(1)}, linger=1.0)
    assert all(out[r]["broadcast"] == {"path": "from rank 1", "n": 1} for r in range(4))
    assert sent[0] == [0, 0, 0] and len(sent[1]) == 3 and min(sent[1]) > 0
