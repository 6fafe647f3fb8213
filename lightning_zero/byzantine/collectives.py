"""Lightning's own collectives in the Byzantine ranks mode: ``barrier``, ``broadcast`` and the reduction behind
``self.log(sync_dist=True)`` and ``reduce_boolean_decision``, over the signed transport, so that a rank that crashed
or stays silent cannot stop the others (through gloo, a dead peer fails every later collective of the group).

Runbook (what :class:`~lightning_zero.strategies.robust.RobustDDPStrategy` does once the step protocol runs)::

    calls = exchange.collectives              # exchange: the ByzantineExchange of the fit
    calls.barrier()
    path = calls.broadcast(path, src=0)
    calls.all_reduce(loss, "avg")             # in place, over the members that answered

[Note: tolerant collectives] Each call is a round of its own, tagged ``(steps run, CALLS + the call's number since
that step)``: every honest rank makes the same calls in the same order (Lightning's loop is the same on every rank),
so the tags agree without a word. A call sends this rank's value to every member and waits ``timeout_s`` for the
members whose connection is up (a crashed rank's drops at once, and it is not waited for); it goes on with what came:

- ``barrier``: nothing more. A member later than the timeout is not waited for (it is left out of the next step's
  inputs the same way), so ``byzantine_timeout`` must exceed the longest wait a barrier covers (rank 0 writing a
  checkpoint).
- ``all_reduce``: the op over the values received, in rank order (``avg`` divides by their number); a value of
  another dtype or shape is dropped. What goes through it is logged metrics and Lightning's decisions, not weights:
  a Byzantine rank can bend those (the weights are the step protocol's).
- ``gather_rows`` (a checkpoint's worker momentum): zero rows for a member that sent none.
- ``gather_all`` (torchmetrics' state synchronisation): the tensors of the members that sent one of this rank's
  dtype and number of dimensions, in rank order.
- ``broadcast``: the source's value, decoded by ``torch.load(weights_only=True)`` (never a pickle of a peer's
  choosing); this rank's own value where the source is silent, gone or evicted, or sent what does not decode. A
  Byzantine source can still send different values to different ranks (no echo round here yet).

An evicted rank takes no part: each call returns its own value at once.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_zero.byzantine import inputs, wire

CALLS = 1 << 28
"""The transport phase of the first Lightning collective after a step (the ``k``-th: ``CALLS + k``)."""
_OPS: dict[str, Callable[[Tensor], Tensor]] = {
    "sum": lambda x: x.sum(0), "max": lambda x: x.amax(0), "min": lambda x: x.amin(0), "product": lambda x: x.prod(0),
}  # fmt: skip


class TolerantCollectives:
    """Lightning's collectives of one rank in the Byzantine ranks mode ([Note: tolerant collectives])."""

    def __init__(self, exchange: Any) -> None:
        self.exchange = exchange  # the ByzantineExchange: its protocol() and its step counter
        self._step, self._calls = -1, 0

    def barrier(self) -> None:
        self._round(b"")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if src == self.exchange.protocol().me:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            self._round(buffer.getvalue())
            return obj
        got = self._round(b"")  # the others send nothing: the round still orders the call, as a barrier would
        if src not in got:
            return obj
        try:
            return torch.load(io.BytesIO(got[src]), weights_only=True)
        except Exception:  # what a faulty source sent, or a type weights_only does not load: this rank's own
            return obj

    def all_reduce(self, tensor: Tensor, op: str) -> Tensor:
        """``tensor`` reduced in place by ``op`` (``sum``, ``avg``, ``max``, ``min``, ``product``)."""
        if op != "avg" and op not in _OPS:
            raise ValueError(f"reduce_op={op!r} is invalid: expected 'sum', 'avg', 'max', 'min' or 'product'")
        values = self._tensors(tensor)
        stack = torch.stack([values[r] for r in sorted(values)])
        out = stack.sum(0) / len(values) if op == "avg" else _OPS[op](stack)
        return tensor.copy_(out.to(tensor.dtype))

    def gather_rows(self, rows: Tensor) -> Tensor:
        """Every rank's ``(k, d)`` rows stacked in rank order, ``(N k, d)``; zeros for a rank that sent none (a
        checkpoint's worker momentum: a rank that comes back starts its own from zero)."""
        values, k = self._tensors(rows), rows.shape[0]
        out = rows.new_zeros(self.exchange.protocol().transport.world_size * k, *rows.shape[1:])
        for rank, value in values.items():
            out[rank * k : (rank + 1) * k] = value.to(rows.device)
        return out

    def gather_all(self, tensor: Tensor) -> list[Tensor]:
        """Every member's tensor of ``tensor``'s dtype and number of dimensions, any shape, in rank order (this
        rank's own included): torchmetrics' state synchronisation (``dist_sync_fn``)."""
        local = tensor.detach().cpu().contiguous()
        kind = f"{local.dtype} {local.ndim}".encode()
        shape = ",".join(map(str, local.shape)).encode()
        got = self._round(wire.pack([kind, shape, inputs.piece_bytes(local.reshape(1, -1))]))
        values = []
        for sender in sorted(got):
            try:
                their_kind, their_shape, raw = wire.unpack(got[sender], count=3)
                dims = [int(n) for n in their_shape.decode().split(",")] if their_shape else []
            except (ValueError, UnicodeDecodeError):
                continue
            if their_kind != kind or len(dims) != local.ndim or len(raw) != math.prod(dims) * local.element_size():
                continue
            value = inputs.piece_tensor(raw, 1, local.dtype) if raw else torch.empty(0, dtype=local.dtype)
            values.append(value.reshape(dims).to(tensor.device))
        return values

    def _tensors(self, tensor: Tensor) -> dict[int, Tensor]:
        """``{rank: its tensor}`` of the members that sent one of ``tensor``'s dtype and shape (this rank's own
        included)."""
        local = tensor.detach().cpu().reshape(1, -1)
        kind = f"{local.dtype} {tuple(tensor.shape)}".encode()
        got = self._round(wire.pack([kind, inputs.piece_bytes(local)]))
        values = {}
        for sender, payload in got.items():
            try:
                their_kind, raw = wire.unpack(payload, count=2)
            except ValueError:
                continue
            if their_kind == kind and len(raw) == local.numel() * local.element_size():
                values[sender] = inputs.piece_tensor(raw, 1, local.dtype).reshape(tensor.shape)
        return values

    def _round(self, payload: bytes) -> dict[int, bytes]:
        """This rank's ``payload`` to every member; ``{member: payload}`` of those that answered within the
        timeout (this rank's own included)."""
        protocol = self.exchange.protocol()
        link, members, me = protocol.transport, protocol.membership, protocol.me
        if me not in members.members:
            return {me: payload}
        step = self.exchange.step
        if step != self._step:
            self._step, self._calls = step, 0
        phase = CALLS + self._calls
        self._calls += 1
        peers = [r for r in members.members if r != me]
        for peer in peers:
            protocol.send(peer, step, phase, payload, "byzantine_lightning")
        got = {me: payload}
        deadline = time.monotonic() + protocol.timeout_s
        while True:
            want = set(peers) - link.gone.keys()
            remaining = deadline - time.monotonic()
            if want <= got.keys() or remaining <= 0:
                return got
            for sender, _, data, _ in link.take(step, range(phase, phase + 1), min(remaining, 0.5)):
                if sender in peers:
                    got.setdefault(sender, data)
