"""The lab's layout as data: its namespaces, links, addresses and the ``ip``/``tc`` commands that make them (pure).

[Note: lab topology]
One network namespace per simulated node (``lzlab-n<k>``) and one of the lab's own (``lzlab-hub``) holding a bridge
(``lzlab-br``). Node k's interface ``lzlab0`` is one end of a veth pair whose other end (``lzlab-p<k>``) is a port of
the bridge, so every node reaches every other through the hub and nothing reaches the host's interfaces: the veths
are created directly inside the lab's namespaces and never exist in the host's. Node k has address 198.18.0.(k+1)
of 198.18.0.0/15, the range RFC 2544 reserves for benchmarks.

Each node's egress (``lzlab0``) is shaped with tbf at ``--inter-node``; traffic between ranks of one node goes to the
node's own address, which the kernel routes over the namespace's loopback (``../shared/NOTES.md`` §8), unshaped
unless ``--intra-node`` shapes that loopback. Each node's ``/etc/hosts`` names the nodes (:meth:`LabPlan.hosts_file`).
Every name starts with :data:`PREFIX`, so ``--cleanup`` can find what a
killed lab left behind without touching anything else.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from lightning_zero.comm.rates import format_rate
from lightning_zero.netlab.rates import tbf_burst_bytes, tbf_command

PREFIX = "lzlab"
HUB = f"{PREFIX}-hub"
BRIDGE = f"{PREFIX}-br"
NODE_INTERFACE = f"{PREFIX}0"  # the same name in every node's namespace: one GLOO_SOCKET_IFNAME for all ranks
NETWORK = ipaddress.ip_network("198.18.0.0/15")
VETH_MTU = 1500
LOOPBACK_MTU = 65536
MAX_NODES = 64  # far beyond what 2 cores run; keeps a typo (--nodes 2000) from making thousands of namespaces


def node_namespace(k: int) -> str:
    return f"{PREFIX}-n{k}"


def hub_port(k: int) -> str:
    return f"{PREFIX}-p{k}"


def node_address(k: int) -> str:
    return str(NETWORK[k + 1])


def node_hostname(k: int) -> str:
    """Node k's name in every node's ``/etc/hosts``; zero-padded, so that names sort in node order."""
    return f"{PREFIX}-node{k:02d}"


@dataclass(frozen=True)
class LabPlan:
    """A lab of ``nodes`` nodes of ``ranks_per_node`` ranks; rates in bit/s, ``None`` for unshaped."""

    nodes: int
    ranks_per_node: int = 1
    inter_node: float | None = None
    intra_node: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes={self.nodes!r} is invalid: expected an integer from 1 to {MAX_NODES}")
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={self.ranks_per_node!r} is invalid: expected an integer >= 1")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def namespaces(self) -> list[str]:
        """Every namespace the lab makes, the hub first."""
        return [HUB, *(node_namespace(k) for k in range(self.nodes))]

    def setup_commands(self) -> list[list[str]]:
        """The commands that build the lab, in order (each namespace right after the one it needs)."""
        commands = [
            ["ip", "netns", "add", HUB],
            ["ip", "-n", HUB, "link", "add", BRIDGE, "type", "bridge"],
            ["ip", "-n", HUB, "link", "set", BRIDGE, "up"],
        ]
        for k in range(self.nodes):
            ns, port = node_namespace(k), hub_port(k)
            commands += [
                ["ip", "netns", "add", ns],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "link", "add", NODE_INTERFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", HUB],
                ["ip", "-n", HUB, "link", "set", port, "master", BRIDGE],
                ["ip", "-n", HUB, "link", "set", port, "up"],
                ["ip", "-n", ns, "addr", "add", f"{node_address(k)}/{NETWORK.prefixlen}", "dev", NODE_INTERFACE],
                ["ip", "-n", ns, "link", "set", NODE_INTERFACE, "up"],
            ]
            if self.inter_node is not None:
                commands.append(tbf_command(ns, NODE_INTERFACE, self.inter_node, VETH_MTU))
            if self.intra_node is not None:
                commands.append(tbf_command(ns, "lo", self.intra_node, LOOPBACK_MTU))
        return commands

    def command_line(self) -> str:
        """The options of ``lightning-zero-netlab`` that make this lab (for a benchmark's reproduce line)."""
        return (
            f"--nodes {self.nodes} --ranks-per-node {self.ranks_per_node} --inter-node"
            f" {format_rate(self.inter_node).lower()} --intra-node {format_rate(self.intra_node).lower()}"
        )

    def hosts_file(self) -> str:
        """``/etc/hosts`` inside each node (``ip netns exec`` mounts ``/etc/netns/<ns>/hosts`` over it): the nodes by
        name, so that c10d's reverse lookups of its peers succeed instead of warning on every connection."""
        # c10d's stores listen on IPv6 sockets, so a peer shows as ::ffff:<v4>: each address is listed in both forms.
        names = [("127.0.0.1", "localhost"), *((node_address(k), node_hostname(k)) for k in range(self.nodes))]
        lines = ["::1 localhost", *(f"{a} {n}" for a, n in names), *(f"::ffff:{a} {n}" for a, n in names)]
        return "\n".join(lines) + "\n"

    def describe(self) -> str:
        """What the lab is, in the lines it prints when it starts."""
        lines = [
            f"netlab: {self.nodes} node(s) x {self.ranks_per_node} rank(s), namespaces {', '.join(self.namespaces)}",
            f"netlab: node k at {node_address(0)}..{node_address(self.nodes - 1)} on bridge {BRIDGE} in {HUB}",
        ]
        for what, rate, device, mtu in (
            ("inter-node", self.inter_node, f"{NODE_INTERFACE} (each node's egress)", VETH_MTU),
            ("intra-node", self.intra_node, "lo (inside each node)", LOOPBACK_MTU),
        ):
            if rate is None:
                lines.append(f"netlab: {what} unlimited")
            else:
                burst = tbf_burst_bytes(rate, mtu)
                lines.append(f"netlab: {what} {format_rate(rate)} on {device}: tbf burst {burst} bytes (MTU {mtu})")
        return "\n".join(lines)
