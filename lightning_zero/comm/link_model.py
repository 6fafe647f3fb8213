"""The link model: what a message costs on each level of the network, what our collectives' algorithms cost on it, and
the choices the ``"auto"`` settings make from it (pure: no process group).

[Note: link model]
A level (``intra_node``: between ranks of one node; ``inter_node``: between nodes) is an α-β link: one message of b
bytes over it takes α + β·b seconds (α its latency, 1/β its rate). A collective runs in steps, each a message per rank
sent at once, so a step over a group that spans nodes takes the inter-node link's time (torchrun numbers ranks node by
node: a ring over them crosses each node's outgoing link once). For a tensor of B bytes over a group of n ranks:

- ring all-reduce (gloo's and our ``"ring"``): 2(n-1) steps of B/n: 2(n-1)·α + 2(n-1)/n·B·β;
- reduce-scatter, all-gather, and ZeRO's reduce to owners: (n-1) steps of B/n: (n-1)·α + (n-1)/n·B·β;
- hierarchical ([Note: hierarchical all-reduce] in ``lightning_zero/comm/hierarchy.py``), M nodes of r ranks: a
  binomial-tree reduce and broadcast inside each node, ⌈log2 r⌉·(α + B·β) each on ``intra_node``, around a ring
  all-reduce over the M leaders on ``inter_node``.

The network lab (2 nodes x 2 ranks, 1 Gbit/s between nodes, ``lightning-zero-netlab --check``) checks the sums: at
64 MiB the model of the flat all-reduce says 842 ms (measured 845), of the hierarchical one 698 ms (measured 698).

What ``"auto"`` chooses from it:

- ``all_reduce_algorithm`` (``ddp_scratch``): on gloo, per bucket, the hierarchy where the job has several nodes of
  several ranks and the model says it is faster than the flat ring (:func:`choose_all_reduce`). NCCL keeps its own
  algorithms, which know the topology. Without a declared model, :data:`LAB_LINK_MODEL` (measured on the lab) decides:
  it puts the hierarchy ahead at every bucket size (0.85 x the flat ring's time at 4 KiB, where the lab's checks
  scattered from 0.74 to 1.25 x, and 0.84-0.85 x from 1 MiB up, where they measured 0.79-1.03 x).
- ZeRO's ``grad_reduction`` needs no model: reduce to owners costs exactly half the ring all-reduce's latency and
  bandwidth terms, whatever α and β are, so it wins wherever the buckets are transient ([Note: gradient reduction]
  in ``lightning_zero/zero/stage12_reduction.py``).

A model is declared as a mapping (a strategy's ``link_model=``, a Hydra ``strategy.link_model``), each level with
``alpha_s`` and either ``beta_s_per_byte`` or ``bandwidth`` (a rate as the lab takes it: ``1gbit``, ``100mbit``)::

    {"inter_node": {"alpha_s": 5e-5, "bandwidth": "100gbit"}, "intra_node": {"alpha_s": 1e-5, "bandwidth": "400gbit"}}

or as the path of a ``lightning-zero-netlab --check --json`` file, whose ``"link_model"`` entry is this mapping, fitted
from the all-reduces it timed inside a node and across nodes (:func:`fit_level`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_zero.comm.rates import parse_rate

LEVELS = ("intra_node", "inter_node")


@dataclass(frozen=True)
class Link:
    """One level's α (seconds per message) and β (seconds per byte)."""

    alpha_s: float
    beta_s_per_byte: float

    def steps(self, count: float, nbytes_each: float) -> float:
        """``count`` steps of one message of ``nbytes_each`` bytes."""
        return count * (self.alpha_s + self.beta_s_per_byte * nbytes_each)


@dataclass(frozen=True)
class LinkModel:
    """The job's levels; ``intra_node`` may be absent where every node runs one rank."""

    inter_node: Link
    intra_node: Link | None = None

    def level(self, group_size: int, ranks_per_node: int) -> Link:
        """The link a group of ``group_size`` consecutive ranks waits on: inside one node or across nodes."""
        if group_size <= ranks_per_node and self.intra_node is not None:
            return self.intra_node
        return self.inter_node

    def as_dict(self) -> dict[str, dict[str, float]]:
        levels = {"inter_node": self.inter_node, "intra_node": self.intra_node}
        return {name: vars(link) for name, link in levels.items() if link is not None}


# ------------------------------------------------------------------------------------------------------ costs
def ring_all_reduce_seconds(link: Link, nbytes: float, group_size: int) -> float:
    n = group_size
    return link.steps(2 * (n - 1), nbytes / n) if n > 1 else 0.0


def reduce_scatter_seconds(link: Link, nbytes: float, group_size: int) -> float:
    """Also an all-gather of ``nbytes`` in all, and ZeRO's reduce to owners of a bucket of ``nbytes``."""
    n = group_size
    return link.steps(n - 1, nbytes / n) if n > 1 else 0.0


def all_reduce_seconds(
    model: LinkModel, nbytes: float, *, algorithm: str, world_size: int, ranks_per_node: int
) -> float:
    """An all-reduce of ``nbytes`` over the world under ``algorithm`` (``"native"`` and ``"ring"`` are rings)."""
    if algorithm != "hierarchical":
        return ring_all_reduce_seconds(model.level(world_size, ranks_per_node), nbytes, world_size)
    nodes = world_size // ranks_per_node
    tree = math.ceil(math.log2(ranks_per_node)) if ranks_per_node > 1 else 0
    inside = model.intra_node or model.inter_node
    return 2 * inside.steps(tree, nbytes) + ring_all_reduce_seconds(model.inter_node, nbytes, nodes)


def choose_all_reduce(model: LinkModel, nbytes: float, *, world_size: int, ranks_per_node: int) -> str:
    """``"hierarchical"`` where the job has several nodes of several ranks and the model puts the hierarchy below the
    flat ring for a bucket of ``nbytes``, else ``"native"``."""
    if not 1 < ranks_per_node < world_size or world_size % ranks_per_node:
        return "native"
    costs = {
        algorithm: all_reduce_seconds(
            model, nbytes, algorithm=algorithm, world_size=world_size, ranks_per_node=ranks_per_node
        )
        for algorithm in ("native", "hierarchical")
    }
    return "hierarchical" if costs["hierarchical"] < costs["native"] else "native"


def fit_level(alpha_s: float, beta_s_per_byte: float, group_size: int) -> Link:
    """The link under a ring all-reduce over ``group_size`` ranks that took ``alpha_s + beta_s_per_byte · B``: its
    2(n-1) steps share the latency, and each rank moves 2(n-1)/n of the bytes."""
    if group_size < 2:
        raise ValueError(f"group_size={group_size} is invalid: a fitted all-reduce needs at least 2 ranks")
    steps = 2 * (group_size - 1)
    return Link(alpha_s / steps, beta_s_per_byte * group_size / steps)


# ------------------------------------------------------------------------------------------- the declared setting
def _link(name: str, value: Any) -> Link:
    if not isinstance(value, Mapping) or "alpha_s" not in value or len(value) != 2:
        raise ValueError(
            f"link_model.{name}={value!r} is invalid: expected a mapping of alpha_s (seconds per message) and either"
            " beta_s_per_byte or bandwidth (a rate: 100mbit, 1gbit)"
        )
    alpha = float(value["alpha_s"])
    if "beta_s_per_byte" in value:
        beta = float(value["beta_s_per_byte"])
    elif "bandwidth" in value:
        bits = parse_rate(f"link_model.{name}.bandwidth", str(value["bandwidth"]))
        beta = 0.0 if bits is None else 8 / bits
    else:
        raise ValueError(f"link_model.{name} has {sorted(value)}: expected alpha_s and beta_s_per_byte or bandwidth")
    if not (math.isfinite(alpha) and math.isfinite(beta)) or alpha < 0 or beta < 0:
        raise ValueError(f"link_model.{name} has alpha_s={alpha}, beta={beta}: expected finite numbers >= 0")
    return Link(alpha, beta)


def _load(path: Path) -> Any:
    """The levels in a JSON file: a ``--check --json`` result's ``"link_model"``, or the file's own mapping."""
    if not path.is_file():
        raise ValueError(f"link_model={str(path)!r} is invalid: no such file (expected a --check --json result)")
    loaded = json.loads(path.read_text())
    if isinstance(loaded, Mapping) and "collectives" in loaded:  # a check's result
        if loaded.get("link_model") is None:
            raise ValueError(
                f"link_model={str(path)!r} is invalid: that check fitted no link model (a lab of one node, or a check"
                " from before the levels were measured): run lightning-zero-netlab --nodes 2 (or more) --check --json"
            )
        return loaded["link_model"]
    return loaded


def resolve_link_model(value: Any) -> LinkModel | None:
    """A strategy's ``link_model`` setting as a model: ``None``, a :class:`LinkModel`, a mapping of levels, or the
    path of a JSON file (a ``lightning-zero-netlab --check --json`` result, or the mapping itself)."""
    if value is None or isinstance(value, LinkModel):
        return value
    if isinstance(value, (str, Path)):
        value = _load(Path(value))
    if not isinstance(value, Mapping) or "inter_node" not in value or not set(value) <= set(LEVELS):
        raise ValueError(
            f"link_model={value!r} is invalid: expected null, a mapping with inter_node (and intra_node) levels, or the"
            " path of a lightning-zero-netlab --check --json file"
        )
    intra = value.get("intra_node")
    return LinkModel(_link("inter_node", value["inter_node"]), None if intra is None else _link("intra_node", intra))


LAB_LINK_MODEL = LinkModel(inter_node=Link(1.16e-3, 8.40e-9), intra_node=Link(1.81e-3, 1.10e-9))
"""The model ``all_reduce_algorithm="auto"`` uses on gloo when none is declared: the median of three fits by
``lightning-zero-netlab --nodes 2 --ranks-per-node 2 --inter-node 1gbit --check`` (2026-12-07; docs/benchmarks.md):
gloo between 2 CPU ranks over loopback inside a node and over 1 Gbit/s links between nodes. Its α are mostly the CPU's
scheduling of 4 processes on 2 cores: 1.2-2.3 ms inside a node and 0.5-1.3 ms across nodes from one check to the
next."""
