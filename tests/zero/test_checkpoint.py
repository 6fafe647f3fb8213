"""Sharded checkpoint I/O: a failed save leaves the last good checkpoint intact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_zero.zero import checkpoint
from tests.helpers.workers import run_workers


def _save_then_fail(path: str) -> dict:
    dist.init_process_group("gloo")
    good = {"model": {"w": torch.arange(6.0)}}
    checkpoint.save_sharded(path, good, meta={"epoch": 1})

    def broken_save(state_dict, checkpoint_id):  # dies half-way: one file written, no index
        Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
        raise OSError("disk full")

    real_save = checkpoint.dcp.save
    checkpoint.dcp.save = broken_save
    try:
        checkpoint.save_sharded(path, {"model": {"w": torch.zeros(6)}}, meta={"epoch": 2})
    except OSError as error:
        failure = str(error)
    finally:
        checkpoint.dcp.save = real_save
    loaded = {"model": {"w": torch.empty(6)}}
    meta = checkpoint.load_sharded(path, loaded)
    return {
        "failure": failure,
        "w": loaded["model"]["w"],
        "meta": meta,
        "sharded": checkpoint.is_sharded_checkpoint(path),
    }


@pytest.mark.timeout(120)
def test_a_failed_save_keeps_the_last_good_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    result = run_workers(_save_then_fail, 1, str(path))[0]
    assert result["failure"] == "disk full"
    assert result["sharded"]
    assert torch.equal(result["w"], torch.arange(6.0))
    assert result["meta"] == {"epoch": 1}
    assert not checkpoint.is_sharded_checkpoint(tmp_path / "last.ckpt.partial")  # the debris is not a checkpoint
