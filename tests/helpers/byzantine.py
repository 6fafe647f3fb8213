"""Members of the Byzantine ranks protocol as threads of one process, each with its own signed TCP transport (a
faulty one's :class:`~lightning_zero.byzantine.behaviours.Twisted`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_zero.byzantine.behaviours import Rewrite, Twisted
from lightning_zero.comm.signed import SignedTransport


def run_members(
    n: int, body: Callable[[int, Any], Any], faulty: dict[int, Rewrite], linger: float = 3.0
) -> dict[Any, Any]:
    """``body(rank, transport)`` on ``n`` member threads (a faulty member's transport :class:`Twisted`); returns
    ``{rank: body's result, or the exception it raised}`` and ``"keys"``, the members' public keys. A member stays
    reachable ``linger`` seconds after its body returns, while the others finish."""
    store = dist.HashStore()
    out: dict[Any, Any] = {}

    def member(rank: int) -> None:
        transport = SignedTransport(rank, n, store, timeout_s=10.0)
        out["keys"] = transport.public_keys
        try:
            out[rank] = body(rank, Twisted(transport, faulty[rank]) if rank in faulty else transport)
        except Exception as err:  # what the test inspects
            out[rank] = err
        finally:
            time.sleep(linger)
            transport.close()

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a member never returned"
    return out


def silent(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> None:
    """A member that sends nothing at all."""
    return None
