"""The lab's layout as data: names, addresses, and the commands that never touch the host's interfaces (pure)."""

from __future__ import annotations

import ipaddress

import pytest

from lightning_zero.netlab.topology import (
    BRIDGE,
    HUB,
    MAX_NODES,
    NODE_INTERFACE,
    PREFIX,
    LabPlan,
    node_address,
    node_namespace,
)


def test_names_and_addresses() -> None:
    plan = LabPlan(nodes=3, ranks_per_node=2)
    assert plan.world_size == 6
    assert plan.namespaces == [HUB, "lzlab-n0", "lzlab-n1", "lzlab-n2"]
    assert [node_address(k) for k in range(3)] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    benchmark_range = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544
    assert all(ipaddress.ip_address(node_address(k)) in benchmark_range for k in range(MAX_NODES))


def test_every_object_carries_the_prefix_and_every_veth_is_made_inside_the_lab() -> None:
    plan = LabPlan(nodes=2, inter_node=1e9, intra_node=1e10)
    commands = plan.setup_commands()
    made = [c[3] for c in commands if c[:3] == ["ip", "netns", "add"]]
    assert made == plan.namespaces
    for command in commands:
        names = [w for w in command if w.startswith(PREFIX)]
        assert names, command  # each command acts on a lab object
        if "link" in command and "add" in command:
            if "veth" in command:  # both ends created straight into lab namespaces, never in the host's
                assert command.count("netns") == 2 and command[command.index("netns") + 1] in made
                assert command[-2:] == ["netns", HUB]
            else:
                assert command[:3] == ["ip", "-n", HUB] and BRIDGE in command
    tbf = [c for c in commands if c[0] == "tc"]
    assert [(c[2], c[6], c[c.index("rate") + 1]) for c in tbf] == [
        ("lzlab-n0", NODE_INTERFACE, "1000000000bit"),
        ("lzlab-n0", "lo", "10000000000bit"),
        ("lzlab-n1", NODE_INTERFACE, "1000000000bit"),
        ("lzlab-n1", "lo", "10000000000bit"),
    ]
    for k in range(2):  # each node's interface gets its address in the /15
        assert [
            "ip",
            "-n",
            node_namespace(k),
            "addr",
            "add",
            f"{node_address(k)}/15",
            "dev",
            NODE_INTERFACE,
        ] in commands


def test_unlimited_links_are_not_shaped() -> None:
    assert not [c for c in LabPlan(nodes=2).setup_commands() if c[0] == "tc"]


def test_hosts_file_names_every_node_in_both_address_forms() -> None:
    hosts = LabPlan(nodes=2).hosts_file().splitlines()
    for line in ("198.18.0.1 lzlab-node00", "::ffff:198.18.0.2 lzlab-node01", "127.0.0.1 localhost"):
        assert line in hosts


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nodes": 0}, r"nodes=0 is invalid: expected an integer from 1 to 64"),
        ({"nodes": MAX_NODES + 1}, r"nodes=65 is invalid"),
        ({"nodes": True}, r"nodes=True is invalid"),
        ({"nodes": 2, "ranks_per_node": 0}, r"ranks_per_node=0 is invalid: expected an integer >= 1"),
    ],
)
def test_bad_plans_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LabPlan(**kwargs)


def test_describe_prints_each_rate_and_its_burst() -> None:
    text = LabPlan(nodes=2, inter_node=2e8).describe()
    assert "inter-node 200Mbit on lzlab0 (each node's egress): tbf burst 25000 bytes (MTU 1500)" in text
    assert "intra-node unlimited" in text
