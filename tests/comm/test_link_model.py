"""The link model's pure parts ([Note: link model] in ``lightning_zero/comm/link_model.py``): the algorithms' costs,
the fit of a level from a timed all-reduce, the choices ``"auto"`` makes from it, and the declared setting."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from lightning_zero.comm.hierarchy import bucket_algorithm
from lightning_zero.comm.link_model import (
    LAB_LINK_MODEL,
    Link,
    LinkModel,
    all_reduce_seconds,
    choose_all_reduce,
    fit_level,
    reduce_scatter_seconds,
    resolve_link_model,
    ring_all_reduce_seconds,
)

SLOW_INTER = Link(alpha_s=1e-4, beta_s_per_byte=8e-9)  # 1 Gbit/s
FAST_INTRA = Link(alpha_s=2e-5, beta_s_per_byte=1e-10)


def _random_links(count: int) -> list[tuple[Link, int, int]]:
    rng = random.Random(0)
    return [
        (Link(rng.uniform(0, 1e-2), rng.uniform(0, 1e-7)), rng.randint(2, 4096), rng.randint(1, 1 << 30))
        for _ in range(count)
    ]


def test_a_ring_takes_its_steps_and_bytes() -> None:
    link = Link(alpha_s=1e-3, beta_s_per_byte=1e-9)
    assert ring_all_reduce_seconds(link, 4e6, 4) == pytest.approx(6 * 1e-3 + 1.5 * 4e6 * 1e-9)
    assert reduce_scatter_seconds(link, 4e6, 4) == pytest.approx(3 * 1e-3 + 0.75 * 4e6 * 1e-9)
    assert ring_all_reduce_seconds(link, 4e6, 1) == 0.0 == reduce_scatter_seconds(link, 4e6, 1)


def test_reduce_to_owners_costs_half_the_all_reduce_on_every_link() -> None:
    """Why ZeRO's ``grad_reduction="auto"`` needs no link model ([Note: gradient reduction])."""
    for link, n, nbytes in _random_links(200):
        assert reduce_scatter_seconds(link, nbytes, n) == pytest.approx(ring_all_reduce_seconds(link, nbytes, n) / 2)


def test_the_fit_of_a_level_predicts_the_all_reduce_it_was_fitted_on() -> None:
    for link, n, nbytes in _random_links(50):
        alpha, beta = 2 * (n - 1) * link.alpha_s, 2 * (n - 1) / n * link.beta_s_per_byte
        fitted = fit_level(alpha, beta, n)
        assert fitted.alpha_s == pytest.approx(link.alpha_s) and fitted.beta_s_per_byte == pytest.approx(
            link.beta_s_per_byte
        )
        assert ring_all_reduce_seconds(fitted, nbytes, n) == pytest.approx(alpha + beta * nbytes)
    with pytest.raises(ValueError, match="group_size=1 is invalid: a fitted all-reduce needs at least 2 ranks"):
        fit_level(1e-3, 1e-9, 1)


def test_a_group_spanning_nodes_waits_on_the_inter_node_link() -> None:
    model = LinkModel(inter_node=SLOW_INTER, intra_node=FAST_INTRA)
    assert model.level(4, 4) is FAST_INTRA and model.level(8, 4) is SLOW_INTER
    assert LinkModel(inter_node=SLOW_INTER).level(2, 4) is SLOW_INTER  # no intra level declared


def test_the_hierarchy_is_chosen_above_the_crossover_the_formulas_give() -> None:
    """2 nodes x 2 ranks: flat = 6 α_e + 1.5 B β_e, hierarchical = 2 (α_i + B β_i) + 2 α_e + B β_e, so the
    hierarchy wins from B* = (2 α_i - 4 α_e) / (0.5 β_e - 2 β_i) on (when intra latency is the larger)."""
    intra = Link(alpha_s=2e-3, beta_s_per_byte=1e-9)
    model = LinkModel(inter_node=SLOW_INTER, intra_node=intra)
    crossover = (2 * intra.alpha_s - 4 * SLOW_INTER.alpha_s) / (0.5 * SLOW_INTER.beta_s_per_byte - 2e-9)
    assert choose_all_reduce(model, crossover * 0.99, world_size=4, ranks_per_node=2) == "native"
    assert choose_all_reduce(model, crossover * 1.01, world_size=4, ranks_per_node=2) == "hierarchical"
    flat = all_reduce_seconds(model, 1e6, algorithm="native", world_size=4, ranks_per_node=2)
    assert flat == pytest.approx(6e-4 + 1.5e6 * 8e-9)
    hierarchical = all_reduce_seconds(model, 1e6, algorithm="hierarchical", world_size=4, ranks_per_node=2)
    assert hierarchical == pytest.approx(2 * (2e-3 + 1e6 * 1e-9) + 2e-4 + 1e6 * 8e-9)


def test_a_slow_node_interior_keeps_the_flat_ring() -> None:
    """Where moving a byte inside a node costs as much as across nodes, the hierarchy's two extra stages move 3 B
    against the flat ring's 1.5 B: it loses wherever bytes dominate (its 4 steps against 6 win only tiny tensors)."""
    model = LinkModel(inter_node=SLOW_INTER, intra_node=SLOW_INTER)
    assert choose_all_reduce(model, 4096, world_size=4, ranks_per_node=2) == "hierarchical"
    for nbytes in (1 << 20, 1 << 28):
        assert choose_all_reduce(model, nbytes, world_size=4, ranks_per_node=2) == "native"
    fast = LinkModel(inter_node=SLOW_INTER, intra_node=FAST_INTRA)
    assert choose_all_reduce(fast, 1 << 20, world_size=4, ranks_per_node=2) == "hierarchical"
    assert choose_all_reduce(fast, 1 << 20, world_size=16, ranks_per_node=8) == "hierarchical"


@pytest.mark.parametrize(("world_size", "ranks_per_node"), [(4, 1), (4, 4), (6, 4)])
def test_no_hierarchy_without_several_nodes_of_several_ranks(world_size: int, ranks_per_node: int) -> None:
    model = LinkModel(inter_node=SLOW_INTER, intra_node=FAST_INTRA)
    assert choose_all_reduce(model, 1 << 28, world_size=world_size, ranks_per_node=ranks_per_node) == "native"


def test_bucket_algorithm_asks_the_model_on_gloo_only() -> None:
    slow_inside = LinkModel(inter_node=SLOW_INTER, intra_node=SLOW_INTER)
    common = {"world_size": 4, "ranks_per_node": 2}
    assert bucket_algorithm("auto", 1 << 24, backend="gloo", link_model=slow_inside, **common) == "native"
    assert bucket_algorithm("auto", 1 << 24, backend="gloo", **common) == "hierarchical"  # LAB_LINK_MODEL
    assert bucket_algorithm("auto", 1 << 24, backend="nccl", **common) == "native"
    assert bucket_algorithm("ring", 4096, backend="nccl", **common) == "ring"


def test_the_lab_model_picks_the_hierarchy_for_the_buckets_the_lab_measured_it_faster_for() -> None:
    """docs/benchmarks.md: at 2 nodes x 2 ranks and 1 Gbit/s the hierarchy measured 0.79-0.86 x gloo's all-reduce
    from 4 MiB to 64 MiB in three checks."""
    for nbytes in (4 << 20, 16 << 20, 64 << 20):
        assert choose_all_reduce(LAB_LINK_MODEL, nbytes, world_size=4, ranks_per_node=2) == "hierarchical"


# ------------------------------------------------------------------------------------------- the declared setting
def test_a_declared_model_takes_beta_or_a_bandwidth() -> None:
    model = resolve_link_model(
        {
            "inter_node": {"alpha_s": 5e-5, "bandwidth": "100gbit"},
            "intra_node": {"alpha_s": 0, "beta_s_per_byte": 1e-11},
        }
    )
    assert model == LinkModel(inter_node=Link(5e-5, 8e-11), intra_node=Link(0.0, 1e-11))
    assert resolve_link_model({"inter_node": {"alpha_s": 1e-4, "bandwidth": "unlimited"}}) == LinkModel(Link(1e-4, 0.0))
    assert resolve_link_model(None) is None and resolve_link_model(model) is model


def test_a_check_result_file_is_a_model(tmp_path: Path) -> None:
    levels = {"inter_node": {"alpha_s": 1e-3, "beta_s_per_byte": 8.4e-9}, "intra_node": vars(FAST_INTRA)}
    check = tmp_path / "check.json"
    check.write_text(json.dumps({"links": [], "collectives": {}, "link_model": levels}))
    plain = tmp_path / "model.json"
    plain.write_text(json.dumps(levels))
    expected = LinkModel(inter_node=Link(1e-3, 8.4e-9), intra_node=FAST_INTRA)
    assert resolve_link_model(str(check)) == expected == resolve_link_model(plain)
    assert resolve_link_model(LinkModel(**{k: Link(**v) for k, v in levels.items()}).as_dict()) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"intra_node": {"alpha_s": 0, "beta_s_per_byte": 0}}, "expected null, a mapping with inter_node"),
        ({"inter_node": {"alpha_s": 0, "beta_s_per_byte": 0}, "rack": {}}, "expected null, a mapping with inter_node"),
        ({"inter_node": {"beta_s_per_byte": 1e-9}}, r"link_model.inter_node=.* expected a mapping of alpha_s"),
        ({"inter_node": {"alpha_s": 0, "rate": 1}}, r"link_model.inter_node has \['alpha_s', 'rate'\]"),
        ({"inter_node": {"alpha_s": -1, "beta_s_per_byte": 0}}, "alpha_s=-1.0, beta=0.0: expected finite numbers >= 0"),
        ({"inter_node": {"alpha_s": 0, "bandwidth": "fast"}}, r"link_model.inter_node.bandwidth='fast' is invalid"),
        ("/nonexistent/check.json", "no such file"),
        ({"collectives": {}, "link_model": None}, "that check fitted no link model"),
        (3, "expected null, a mapping with inter_node"),
    ],
)
def test_bad_models_name_the_setting(value: object, message: str, tmp_path: Path) -> None:
    if isinstance(value, dict) and "collectives" in value:  # a check's result, in its file
        (tmp_path / "check.json").write_text(json.dumps(value))
        value = tmp_path / "check.json"
    with pytest.raises(ValueError, match=message):
        resolve_link_model(value)
