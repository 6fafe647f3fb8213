"""Rates as the lab takes them, and the tbf burst derived from them (pure)."""

from __future__ import annotations

import pytest

from lightning_zero.comm.rates import format_rate, parse_rate
from lightning_zero.netlab.rates import ETHERNET_HEADER, tbf_burst_bytes, tbf_command


@pytest.mark.parametrize(
    ("text", "bits"),
    [("100mbit", 1e8), ("1gbit", 1e9), ("2.5gbit", 2.5e9), ("800kbit", 8e5), ("  10GBIT ", 1e10), ("9600bit", 9600.0)],
)
def test_rates_parse_in_decimal_units_as_tc_does(text: str, bits: float) -> None:
    assert parse_rate("--inter-node", text) == bits


def test_unlimited_is_no_rate() -> None:
    assert parse_rate("--intra-node", "unlimited") is None and format_rate(None) == "unlimited"


@pytest.mark.parametrize("text", ["1gbps", "1 gbit", "fast", "", "0mbit", "-1gbit", "1e9bit", "gbit"])
def test_a_rate_that_does_not_parse_names_the_setting_and_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"--inter-node=.* is invalid: expected .*100mbit, 1gbit.*unlimited"):
        parse_rate("--inter-node", text)


def test_format_rate_round_trips() -> None:
    for text in ("200mbit", "1gbit", "2.5gbit", "800kbit"):
        assert parse_rate("r", format_rate(parse_rate("r", text))) == parse_rate("r", text)


@pytest.mark.parametrize("mtu", [1500, 65536])
@pytest.mark.parametrize("rate", [1e5, 2e8, 1e9, 1e10])
def test_burst_holds_two_packets_and_a_millisecond(rate: float, mtu: int) -> None:
    burst = tbf_burst_bytes(rate, mtu)
    assert burst >= 2 * (mtu + ETHERNET_HEADER)  # smaller than a packet, the link stalls
    assert burst >= rate / 8 * 1e-3  # smaller than one ms of the rate, the shaper undershoots it
    assert burst == max(2 * (mtu + ETHERNET_HEADER), -(-int(rate / 8) // 1000))  # and no bigger than both


def test_tbf_command_shapes_the_egress_of_one_device_in_one_namespace() -> None:
    command = tbf_command("lzlab-n0", "lzlab0", 2e8, 1500)
    assert command[:9] == ["tc", "-n", "lzlab-n0", "qdisc", "add", "dev", "lzlab0", "root", "tbf"]
    assert dict(zip(command[9::2], command[10::2])) == {"rate": "200000000bit", "burst": "25000", "latency": "100ms"}
