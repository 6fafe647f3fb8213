"""The replicas x model-parallel grid of ranks (pure)."""

from __future__ import annotations

import pytest

from lightning_zero.training.mesh import Mesh


def test_mesh_layout_puts_a_replica_on_consecutive_ranks():
    mesh = Mesh(8, 4)
    assert mesh.data_size == 2
    assert [mesh.coordinates(r) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert mesh.model_group(1) == [4, 5, 6, 7] and mesh.data_group(2) == [2, 6]
    groups = [mesh.model_group(r) for r in range(mesh.data_size)]
    assert sorted(r for g in groups for r in g) == list(range(8))  # every rank in exactly one replica
    assert all(mesh.data_group(i)[mesh.coordinates(r)[0]] == r for i in range(4) for r in mesh.data_group(i))


@pytest.mark.parametrize("size", [3, 0, 8, True])
def test_mesh_refuses_sizes_that_do_not_divide_the_world(size):
    with pytest.raises(ValueError, match=rf"stages={size!r} is invalid: expected a divisor of the world size 4"):
        Mesh(4, size, name="stages")
