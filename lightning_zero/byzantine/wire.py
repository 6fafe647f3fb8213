"""Byte encodings of the Byzantine ranks mode's messages: length-prefixed parts, integers, and held signed claims.

Every decoder raises :class:`ValueError` on bytes no honest rank writes, so that a malformed message is one
``except ValueError`` away from being recorded as its sender's misbehaviour.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from lightning_zero.comm.signed import HEADER, SIGNATURE_BYTES, Evidence

_LENGTH = struct.Struct("!I")
_INT = struct.Struct("!q")
EVIDENCE_BYTES = HEADER.size + 32 + SIGNATURE_BYTES


def pack(parts: Sequence[bytes]) -> bytes:
    """``parts`` as one byte string: each part prefixed by its length."""
    return b"".join(_LENGTH.pack(len(p)) + bytes(p) for p in parts)


def unpack(data: bytes, count: int | None = None) -> list[bytes]:
    """The parts of :func:`pack`'s output; ``count``: how many there must be (``None``: any)."""
    parts, at = [], 0
    while at < len(data):
        if at + _LENGTH.size > len(data):
            raise ValueError("a truncated length prefix")
        (length,) = _LENGTH.unpack_from(data, at)
        at += _LENGTH.size
        if at + length > len(data):
            raise ValueError(f"a part announcing {length} bytes with {len(data) - at} left")
        parts.append(data[at : at + length])
        at += length
    if count is not None and len(parts) != count:
        raise ValueError(f"{len(parts)} parts where {count} are expected")
    return parts


def pack_int(value: int) -> bytes:
    return _INT.pack(value)


def unpack_int(data: bytes) -> int:
    if len(data) != _INT.size:
        raise ValueError(f"an integer of {len(data)} bytes, expected {_INT.size}")
    return _INT.unpack(data)[0]


def pack_evidence(evidence: Evidence) -> bytes:
    return evidence.header + evidence.digest + evidence.signature


def unpack_evidence(data: bytes) -> Evidence:
    if len(data) != EVIDENCE_BYTES:
        raise ValueError(f"a signed claim of {len(data)} bytes, expected {EVIDENCE_BYTES}")
    return Evidence(data[: HEADER.size], data[HEADER.size : HEADER.size + 32], data[HEADER.size + 32 :])


def pack_shard_values(values: dict[int, bytes]) -> bytes:
    """Per-shard values (a member's shard results or partial sums) as one payload: ``(shard, value)`` parts."""
    return pack([pack([pack_int(shard), value]) for shard, value in values.items()])


def unpack_shard_values(data: bytes) -> dict[int, bytes]:
    """:func:`pack_shard_values` undone."""
    out = {}
    for part in unpack(data):
        shard, value = unpack(part, count=2)
        out[unpack_int(shard)] = value
    return out


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()
