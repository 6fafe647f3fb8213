"""Members of the Byzantine ranks protocol as threads of one process, each with its own signed TCP transport, and
the faulty member's transport that rewrites, withholds or forges what it sends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_zero.comm.signed import SignedTransport

Rewrite = Callable[["Twisted", int, int, bytes], "bytes | None"]


class Twisted:
    """A faulty member's transport: ``rewrite(self, peer, phase, payload)`` replaces what it sends (``None``:
    withheld); ``self.sign_own`` signs what it forges."""

    def __init__(self, inner: SignedTransport, rewrite: Rewrite) -> None:
        self.inner, self.rewrite = inner, rewrite

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send(self, peer: int, step: int, phase: int, payload: bytes, tag: str = "") -> None:
        out = self.rewrite(self, peer, phase, payload)
        if out is not None:
            self.inner.send(peer, step, phase, out, tag=tag)


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


def silent(link: Twisted, peer: int, phase: int, payload: bytes) -> None:
    """A member that sends nothing at all."""
    return None
