"""``examples/fabric_train.py`` under Fabric's launchers: popen (the script re-run per rank) and spawn."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "strategy", ["zero3_scratch", pytest.param("ddp_scratch_spawn", marks=pytest.mark.slow)]
)  # Fabric's spawn launcher in the slow run (CI runs it); popen in the default one
def test_fabric_example_trains_on_two_processes(strategy):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "examples/fabric_train.py", "--strategy", strategy, "--steps", "3", "--max-chars", "20000"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 2 and all(loss == loss for loss in losses), out.stdout  # steps 0 and 2, finite
