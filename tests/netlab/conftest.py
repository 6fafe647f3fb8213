"""The real-lab tests' fixture: no lab object before, none left after."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.netlab import lab_objects, run_netlab


@pytest.fixture
def no_lab_left() -> Iterator[None]:
    """A real-lab test starts with no lab object and removes any it leaves (a lab killed by a timeout)."""
    assert lab_objects() == [], "a lab is already up: lightning-zero-netlab --cleanup"
    try:
        yield
    finally:
        if lab_objects():
            run_netlab("--cleanup")
