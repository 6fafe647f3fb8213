"""``ddp_scratch`` with ``all_reduce_algorithm`` on 4 gloo processes laid out as torchrun lays out 2 nodes x 2
(``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` per process; ``Trainer(devices=2, num_nodes=2)``): the
hierarchical all-reduce trains what the single-process reference and Lightning's ``ddp`` train, and ``"auto"`` picks it
for large buckets there. Bad values fail before any process starts."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch.strategies import DDPStrategy

import lightning_zero
import lightning_zero.fabric
from lightning_zero.comm import hierarchy
from tests.helpers.parity import ParityConfig, fit_lightning, max_abs_diff, reference_params
from tests.helpers.workers import run_workers

CONFIG = ParityConfig(world_size=4, accumulate_grad_batches=2)
TOLERANCE = 1e-5
SMALL_BUCKET_MB = 512 / 2**20  # several buckets of the parity net


class _Probe(lightning_zero.ScratchDDPStrategy):
    """Keeps what the engine chose for a 1 MiB and a 4 KiB bucket, and whether the node groups were built."""

    def teardown(self) -> None:
        options = self._engine._all_reduce_options
        self.chosen = {"1 MiB": options(2**20)["algorithm"], "4 KiB": options(4096)["algorithm"]}
        self.groups_built = bool(hierarchy._CURRENT)
        super().teardown()


def _as_two_nodes() -> None:
    rank = int(os.environ["RANK"])
    os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")


def _fits() -> dict:
    _as_two_nodes()
    out = {}
    for algorithm in ("hierarchical", "native", "auto"):
        strategy = _Probe(bucket_size_mb=SMALL_BUCKET_MB, all_reduce_algorithm=algorithm)
        out[algorithm] = fit_lightning(CONFIG, strategy, devices=2, num_nodes=2)
        out[algorithm, "chosen"] = strategy.chosen
    out["groups_built"] = strategy.groups_built
    out["ddp"] = fit_lightning(CONFIG, DDPStrategy(), devices=2, num_nodes=2)
    return out


@pytest.fixture(scope="module")
def fits():
    return run_workers(_fits, 4, timeout=400)


@pytest.mark.timeout(500)
def test_hierarchical_all_reduce_trains_as_the_reference_and_lightning_ddp(fits):
    reference = reference_params(CONFIG)
    for rank_result in fits:
        assert max_abs_diff(rank_result["hierarchical"], reference) <= TOLERANCE
        assert max_abs_diff(rank_result["hierarchical"], rank_result["ddp"]) <= TOLERANCE
        assert max_abs_diff(rank_result["hierarchical"], fits[0]["hierarchical"]) == 0.0  # replicas agree
    assert max_abs_diff(fits[0]["hierarchical"], reference_params(ParityConfig())) > 1e3 * TOLERANCE


@pytest.mark.timeout(500)
def test_auto_takes_the_hierarchy_for_large_buckets_across_nodes(fits):
    for rank_result in fits:
        assert rank_result["auto", "chosen"] == {"1 MiB": "hierarchical", "4 KiB": "native"}
        assert rank_result["native", "chosen"] == {"1 MiB": "native", "4 KiB": "native"}
        assert rank_result["hierarchical", "chosen"] == {"1 MiB": "hierarchical", "4 KiB": "hierarchical"}
        assert rank_result["groups_built"]


def test_bucket_algorithm_rule():
    choose = hierarchy.bucket_algorithm
    assert choose("auto", 2**20, backend="gloo", world_size=4, ranks_per_node=2) == "hierarchical"
    assert choose("auto", 2**20 - 1, backend="gloo", world_size=4, ranks_per_node=2) == "native"
    assert choose("auto", 2**30, backend="gloo", world_size=4, ranks_per_node=4) == "native"  # one node
    assert choose("auto", 2**30, backend="gloo", world_size=4, ranks_per_node=1) == "native"  # one rank per node
    assert choose("auto", 2**30, backend="nccl", world_size=16, ranks_per_node=8) == "native"
    assert choose("ring", 10, backend="nccl", world_size=2, ranks_per_node=1) == "ring"


@pytest.mark.parametrize("cls", [lightning_zero.ScratchDDPStrategy, lightning_zero.fabric.ScratchDDPStrategy])
def test_a_bad_algorithm_is_refused_naming_the_setting(cls):
    with pytest.raises(ValueError, match=r"all_reduce_algorithm='tree' is invalid: expected one of \('auto', 'native'"):
        cls(all_reduce_algorithm="tree")
