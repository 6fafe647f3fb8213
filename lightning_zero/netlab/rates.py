"""Message sizes as the lab's command line takes them, and the token buckets ``tc tbf`` needs (pure). Rates are
parsed by :mod:`lightning_zero.comm.rates`.

[Note: tbf burst] A token bucket releases at most ``burst`` bytes at once. It must hold at least one whole packet of
the interface (its MTU plus the link-layer header): a smaller bucket never fills enough to send a full packet and
the connection stalls until TCP gives up (``../shared/NOTES.md`` §8: ``burst 32KiB`` on loopback, MTU 64 KiB). It
must also cover what the link sends between two timer ticks at its rate, or the shaper undershoots the rate; one
millisecond of the rate covers that with high-resolution timers. :func:`tbf_burst_bytes` takes the larger of two
packets and one millisecond.
"""

from __future__ import annotations

import math
import re

ETHERNET_HEADER = 14  # bytes a veth adds to each IP packet
BURST_PACKETS = 2
BURST_SECONDS = 1e-3

SIZE_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"(\d+)(b|kib|mib|gib)")


def parse_size(setting: str, text: str) -> int:
    """``text`` (``4KiB``, ``256MiB``, ``1GiB``, ``4096B``) in bytes; raises ``ValueError`` naming ``setting``."""
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None or int(match.group(1)) <= 0:
        raise ValueError(f"{setting}={text!r} is invalid: expected a whole number and B, KiB, MiB or GiB (256MiB)")
    return int(match.group(1)) * SIZE_UNITS[match.group(2)]


def tbf_burst_bytes(bits_per_second: float, mtu: int) -> int:
    """The token bucket of a ``tbf`` at ``bits_per_second`` on an interface of ``mtu`` ([Note: tbf burst])."""
    packets = BURST_PACKETS * (mtu + ETHERNET_HEADER)
    return max(packets, math.ceil(bits_per_second / 8 * BURST_SECONDS))


def tbf_command(namespace: str, device: str, bits_per_second: float, mtu: int, latency_ms: int = 100) -> list[str]:
    """``tc`` shaping ``device``'s egress in ``namespace`` to ``bits_per_second``; packets wait at most
    ``latency_ms`` in the queue before tbf drops them (TCP then backs off, as on a congested link)."""
    return [
        "tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
        "rate", f"{int(bits_per_second)}bit", "burst", str(tbf_burst_bytes(bits_per_second, mtu)),
        "latency", f"{latency_ms}ms",
    ]  # fmt: skip
