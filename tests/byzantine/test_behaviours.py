"""lightning_zero.byzantine.behaviours: the colluders' ALIE rows are the simulated attack's on the same honest rows."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.byzantine.behaviours import ALIE_Z, alie_rows, check_behaviour
from lightning_zero.robust.attacks import apply_attack


def test_alie_rows_equal_the_simulated_alie_over_the_pool_as_the_honest_rows():
    pool = torch.randn(5, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    stack = torch.cat([pool, torch.zeros(2, 7, dtype=torch.float64)])
    attacked = apply_attack("alie", stack, [5, 6], z=ALIE_Z)
    assert torch.allclose(alie_rows(pool, 2), attacked[5:], rtol=0, atol=1e-12)
    assert not torch.equal(alie_rows(pool, 2)[0], pool.mean(0))


@pytest.mark.parametrize(("ranks", "f", "k", "ok"), [(None, 1, 1, False), (None, 1, 2, True), (None, 2, 1, True),
                                                      ([3], 2, 1, False), ([5, 6], 2, 1, True)])  # fmt: skip
def test_alie_needs_two_pooled_rows(ranks, f, k, ok):
    if ok:
        check_behaviour("alie", ranks, 7, f=f, workers_per_rank=k)
    else:
        with pytest.raises(ValueError, match="need at least 2 rows"):
            check_behaviour("alie", ranks, 7, f=f, workers_per_rank=k)
    with pytest.raises(ValueError, match="at least 2 pooled rows"):
        alie_rows(torch.ones(1, 3), 1)
