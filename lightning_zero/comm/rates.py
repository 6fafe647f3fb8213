"""Link rates as settings take them (pure): a number with one of tc's decimal units (``100mbit``, ``1gbit``,
``2.5gbit``, ``800kbit``) or ``unlimited``. tc reads ``mbit`` as 10**6 bit/s, as here. The network lab's command line
(``lightning_zero/netlab/``) and the link model's ``bandwidth`` (``lightning_zero/comm/link_model.py``) both use them.
"""

from __future__ import annotations

import re

UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
UNLIMITED = "unlimited"
FORMS = "a number and a unit of bit, kbit, mbit, gbit or tbit (100mbit, 1gbit, 2.5gbit), or unlimited"
_RATE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(bit|kbit|mbit|gbit|tbit)")


def parse_rate(setting: str, text: str) -> float | None:
    """``text`` in bits per second, or ``None`` for ``unlimited``; raises ``ValueError`` naming ``setting``."""
    value = text.strip().lower()
    if value == UNLIMITED:
        return None
    match = _RATE.fullmatch(value)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"{setting}={text!r} is invalid: expected {FORMS}")
    return float(match.group(1)) * UNITS[match.group(2)]


def format_rate(bits_per_second: float | None) -> str:
    """The rate as tc prints it (``200Mbit``), ``unlimited`` for ``None``."""
    if bits_per_second is None:
        return UNLIMITED
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits_per_second >= UNITS[unit]:
            return f"{bits_per_second / UNITS[unit]:g}{unit[0].upper()}{unit[1:]}"
    return f"{bits_per_second:g}bit"
