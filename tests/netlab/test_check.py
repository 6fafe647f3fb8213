"""``--check``'s pure parts: the sizes it times, the stream length, the α-β fit and its table."""

from __future__ import annotations

import pytest

from lightning_zero.comm.link_model import Link, LinkModel, ring_all_reduce_seconds
from lightning_zero.netlab.check import fit_alpha_beta, link_model, render, stream_bytes
from lightning_zero.netlab.probe import COLLECTIVES, repetitions, sizes
from lightning_zero.netlab.rates import parse_size


def test_sizes_go_from_4_kib_by_four() -> None:
    assert sizes(256 << 20) == [4 << 10 << 2 * k for k in range(9)]
    assert sizes(64 << 10) == [4 << 10, 16 << 10, 64 << 10] and sizes(1000) == []
    assert [repetitions(s) for s in (4 << 10, 1 << 20, 4 << 20, 64 << 20)] == [5, 5, 3, 1]


def test_a_stream_lasts_about_two_seconds_of_the_link() -> None:
    assert stream_bytes(2e8) == 50_000_000  # 25 MB/s for 2 s
    assert stream_bytes(1e6) == 4 << 20 and stream_bytes(1e11) == 256 << 20 and stream_bytes(None) == 256 << 20


@pytest.mark.parametrize(("alpha", "beta"), [(50e-6, 1e-8), (2e-3, 4.4e-8), (0.0, 8e-9)])
def test_the_fit_recovers_a_link_model(alpha: float, beta: float) -> None:
    points = [[b, alpha + beta * b] for b in sizes(256 << 20)]
    fitted_alpha, fitted_beta = fit_alpha_beta(points)
    assert fitted_beta == pytest.approx(beta, rel=1e-9)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6, abs=1e-12)


def test_the_fit_keeps_latency_out_of_the_bandwidth_and_noise_out_of_both() -> None:
    beta = 4e-8
    points = [[b, 1e-4 + beta * b] for b in sizes(64 << 20)]
    points[0][1] += 3e-3  # one slow small call (a delayed ACK): the median of the four smallest keeps it out of α
    alpha, fitted_beta = fit_alpha_beta(points)
    assert fitted_beta == pytest.approx(beta, rel=1e-9) and alpha == pytest.approx(1e-4, rel=1e-6)
    points[1][1] += 3e-3  # two of four: α moves halfway
    assert fit_alpha_beta(points)[0] == pytest.approx(1e-4 + 1.5e-3, rel=1e-6)
    with pytest.raises(ValueError, match="at least 2 sizes: got 1"):
        fit_alpha_beta(points[:1])


def test_render_has_a_row_per_link_and_per_collective() -> None:
    model = {"alpha_s": 1e-4, "beta_s_per_byte": 4e-8, "rate_bytes_per_s": 2.4e7, "points": []}
    results = {
        "links": [{"src": 0, "dst": 1, "bytes": 50_000_000, "seconds": 2.09, "rate_bps": 1.914e8}],
        "collectives": dict.fromkeys(COLLECTIVES, model),
    }
    table = render(results).splitlines()
    assert "| node 0 -> node 1 | 50000000 | 2.090 | 191.4Mbit/s |" in table
    assert "| all_reduce | 100 | 40.000 | 25.0 | 24.0 |" in table
    assert sum(line.startswith("| ") and line.split(" |")[0][2:] in COLLECTIVES for line in table) == 5


def test_the_level_probes_give_the_link_model_each_all_reduce_was_timed_on() -> None:
    """A 2-rank all-reduce inside a node and across the leaders, each fitted as α + β B, give links whose ring
    all-reduce over that group predicts the fitted times again; rendered as rows and a table of their own."""
    timed = {
        "intra_node": (3.6e-3, 1.1e-9, 2),
        "inter_node": (2.3e-3, 8.4e-9, 2),
        "all_reduce_hierarchical": (6e-3, 1e-8, 4),
    }
    levels = {
        name: {"alpha_s": a, "beta_s_per_byte": b, "group_size": n, "rate_bytes_per_s": 1 / b, "points": []}
        for name, (a, b, n) in timed.items()
    }
    model = link_model(levels)
    assert model == LinkModel(inter_node=Link(1.15e-3, 8.4e-9), intra_node=Link(1.8e-3, 1.1e-9))
    for name in ("intra_node", "inter_node"):
        a, b, n = timed[name]
        assert ring_all_reduce_seconds(getattr(model, name), 1e8, n) == pytest.approx(a + b * 1e8)
    assert link_model({"inter_node": levels["inter_node"]}).intra_node is None  # a lab of one rank per node
    table = render({"links": [], "collectives": {}, "levels": levels, "link_model": model.as_dict()}).splitlines()
    assert "| all_reduce inside a node (2 ranks) | 3600 | 1.100 | 909.1 | 909.1 |" in table
    assert "| all_reduce, hierarchical (4 ranks) | 6000 | 10.000 | 100.0 | 100.0 |" in table
    assert "| inter_node | 1150 | 8.400 | 119.0 |" in table


@pytest.mark.parametrize(("text", "nbytes"), [("4KiB", 4096), ("256MiB", 256 << 20), ("1GiB", 1 << 30), ("512B", 512)])
def test_sizes_parse(text: str, nbytes: int) -> None:
    assert parse_size("--check-max-size", text) == nbytes


@pytest.mark.parametrize("text", ["256MB", "1.5MiB", "0MiB", "big"])
def test_bad_sizes_name_the_setting(text: str) -> None:
    with pytest.raises(ValueError, match=r"--check-max-size=.* is invalid: expected a whole number and B, KiB"):
        parse_size("--check-max-size", text)
