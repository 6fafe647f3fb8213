"""``lightning-zero-netlab --check``: measure each link of a lab, then the collectives over it, and fit a link model.

Each node's egress is measured by one TCP stream to the next node (k to k+1, the last to node 0), a few seconds of
the link's rate. Then the lab's ranks time every collective of the shim from 4 KiB up to ``--check-max-size``
(:mod:`lightning_zero.netlab.probe`), and each collective gets the α-β model ``seconds = α + β · bytes``
(:func:`fit_alpha_beta`): α is its latency (what a call costs however small), β its seconds per byte, 1/β the rate it
reaches on large tensors. The table prints each; ``--json`` writes them with every measured point.

The all-reduces timed inside one node and across the nodes' leaders (``"levels"``) give the link model of the lab
(``"link_model"``, [Note: link model] in ``lightning_zero/comm/link_model.py``): the path of the JSON file is a valid
``link_model=`` setting of ``ddp_scratch``, so ``all_reduce_algorithm="auto"`` chooses from what was measured here.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_zero.comm.link_model import LinkModel, fit_level
from lightning_zero.comm.rates import format_rate
from lightning_zero.netlab.lab import LabError
from lightning_zero.netlab.launch import run_command
from lightning_zero.netlab.topology import LabPlan, node_address, node_namespace

STREAM_PORT = 5201
STREAM_SECONDS = 2.0
STREAM_BYTES = (4 << 20, 256 << 20)  # at least, at most
BANDWIDTH_POINTS = 3  # the largest sizes, that fit β
LATENCY_POINTS = 4  # the smallest sizes (4 KiB to 256 KiB), that give α: the median keeps one slow call out of it


def stream_bytes(bits_per_second: float | None) -> int:
    """How much one link's stream sends: :data:`STREAM_SECONDS` of its rate, within :data:`STREAM_BYTES`."""
    low, high = STREAM_BYTES
    if bits_per_second is None:
        return high
    return int(min(high, max(low, bits_per_second / 8 * STREAM_SECONDS)))


def fit_alpha_beta(points: Sequence[Sequence[float]]) -> tuple[float, float]:
    """``(α, β)`` of ``seconds = α + β · bytes`` over ``[[bytes, seconds], ...]``, in increasing size.

    Each parameter from the sizes where it shows: β is the least-squares slope through the largest
    :data:`BANDWIDTH_POINTS` sizes (where the transfer dominates), α what the smallest :data:`LATENCY_POINTS` sizes
    take beyond their transfer at β (their median, at least 0). One fit over all sizes lets the large ones decide α too.
    """
    if len(points) < 2:
        raise ValueError(f"fitting a link model needs at least 2 sizes: got {len(points)}")
    large = points[-BANDWIDTH_POINTS:]
    mean_b = sum(b for b, _ in large) / len(large)
    mean_s = sum(s for _, s in large) / len(large)
    beta = sum((b - mean_b) * (s - mean_s) for b, s in large) / sum((b - mean_b) ** 2 for b, _ in large)
    beta = max(beta, 0.0)
    alpha = max(0.0, statistics.median(s - beta * b for b, s in points[:LATENCY_POINTS]))
    return alpha, beta


def _stream(plan: LabPlan, src: int, dst: int) -> dict[str, Any]:
    nbytes = stream_bytes(plan.inter_node)
    probe = [sys.executable, "-m", "lightning_zero.netlab.probe"]
    args = [node_address(dst), str(STREAM_PORT), str(nbytes)]
    in_dst, in_src = ["ip", "netns", "exec", node_namespace(dst)], ["ip", "netns", "exec", node_namespace(src)]
    with subprocess.Popen([*in_dst, *probe, "stream-server", *args], stdout=subprocess.PIPE, text=True) as server:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise LabError(f"the stream server in {node_namespace(dst)} did not start")
        client = subprocess.run([*in_src, *probe, "stream-client", *args], check=False, timeout=600)
        if client.returncode != 0:
            server.kill()
            raise LabError(f"the stream from node {src} to node {dst} failed with exit code {client.returncode}")
        measured = json.loads(server.stdout.readline())
    seconds = measured["seconds"]
    return {"src": src, "dst": dst, **measured, "rate_bps": 8 * measured["bytes"] / seconds if seconds else None}


def run_check(plan: LabPlan, largest: int, json_path: Path | None = None) -> dict[str, Any]:
    """Measure the lab's links and collectives (module docstring); print the tables; the results."""
    links = [_stream(plan, k, (k + 1) % plan.nodes) for k in range(plan.nodes)] if plan.nodes > 1 else []
    with tempfile.TemporaryDirectory(prefix="lzlab-check-") as tmp:
        out = Path(tmp) / "collectives.json"
        probe = [sys.executable, "-m", "lightning_zero.netlab.probe", "collectives", str(out), str(largest)]
        code = run_command(plan, probe)
        if code != 0:
            raise LabError(f"the collectives probe failed with exit code {code}")
        measured = json.loads(out.read_text())
    models = {name: _fit(points) for name, points in measured["points"].items()}
    levels = {name: {**models.pop(name), "group_size": size} for name, size in measured["group_sizes"].items()}
    results = {
        "plan": {"nodes": plan.nodes, "ranks_per_node": plan.ranks_per_node,
                 "inter_node": format_rate(plan.inter_node), "intra_node": format_rate(plan.intra_node)},
        "links": links,
        "collectives": models,
        "levels": levels,
        "link_model": link_model(levels).as_dict() if "inter_node" in levels else None,
    }  # fmt: skip
    print(render(results), flush=True)
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"netlab: wrote {json_path}", flush=True)
    return results


def _fit(points: list[list[float]]) -> dict[str, Any]:
    alpha, beta = fit_alpha_beta(points)
    largest_bytes, largest_seconds = points[-1]
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "rate_bytes_per_s": largest_bytes / largest_seconds,
            "points": points}  # fmt: skip


def link_model(levels: dict[str, dict[str, Any]]) -> LinkModel:
    """The lab's link model from its level probes' fits (``inter_node`` at least): each all-reduce's α and β spread
    over the steps and bytes of a ring over its group (:func:`~lightning_zero.comm.link_model.fit_level`)."""
    link = {
        name: fit_level(levels[name]["alpha_s"], levels[name]["beta_s_per_byte"], levels[name]["group_size"])
        for name in ("intra_node", "inter_node")
        if name in levels
    }
    return LinkModel(inter_node=link["inter_node"], intra_node=link.get("intra_node"))


LEVEL_TITLES = {"intra_node": "all_reduce inside a node", "inter_node": "all_reduce across nodes (leaders)",
                "all_reduce_hierarchical": "all_reduce, hierarchical"}  # fmt: skip


def render(results: dict[str, Any]) -> str:
    """The check's tables, as Markdown: the links, the collectives (and level probes), the link model."""
    lines = ["| link | bytes | seconds | rate |", "|---|---:|---:|---:|"]
    for link in results["links"]:
        rate = format_rate(link["rate_bps"]) + "/s" if link["rate_bps"] else "-"
        lines.append(f"| node {link['src']} -> node {link['dst']} | {link['bytes']} | {link['seconds']:.3f} | {rate} |")
    lines += ["", "| collective | α (µs) | β (ns/B) | 1/β (MB/s) | rate at the largest size (MB/s) |",
              "|---|---:|---:|---:|---:|"]  # fmt: skip
    rows = [(name, model) for name, model in results["collectives"].items()]
    rows += [(f"{LEVEL_TITLES[name]} ({model['group_size']} ranks)", model)
             for name, model in results.get("levels", {}).items()]  # fmt: skip
    for name, model in rows:
        inverse = f"{1e-6 / model['beta_s_per_byte']:.1f}" if model["beta_s_per_byte"] > 0 else "-"
        lines.append(f"| {name} | {1e6 * model['alpha_s']:.0f} | {1e9 * model['beta_s_per_byte']:.3f} | {inverse} |"
                     f" {1e-6 * model['rate_bytes_per_s']:.1f} |")  # fmt: skip
    if results.get("link_model"):
        lines += ["", "| link model level | α (µs) | β (ns/B) | 1/β (MB/s) |", "|---|---:|---:|---:|"]
        for name, link in results["link_model"].items():
            beta = link["beta_s_per_byte"]
            inverse = f"{1e-6 / beta:.1f}" if beta > 0 else "-"
            lines.append(f"| {name} | {1e6 * link['alpha_s']:.0f} | {1e9 * beta:.3f} | {inverse} |")
    return "\n".join(lines)
