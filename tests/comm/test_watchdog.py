"""The collective watchdog ([Note: collective watchdog] in ``lightning_zero/comm/watchdog.py``): bounded waits whose
error names the collective on every rank, and a SIGTERM that ends a process stuck in one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_zero.comm import collectives as comm
from lightning_zero.comm import watchdog
from tests.helpers.workers import free_port, run_workers


@pytest.mark.parametrize(("value", "expected"), [(None, None), (5, 5.0), (0.5, 0.5), (timedelta(minutes=2), 120.0)])
def test_collective_timeout_accepts_seconds_a_timedelta_or_none(value, expected):
    assert watchdog.check_timeout(value) == expected


@pytest.mark.parametrize("value", [0, -3, True, "300", [1]])
def test_a_bad_collective_timeout_is_refused_naming_the_setting(value):
    with pytest.raises(ValueError, match=r"^collective_timeout=.* is invalid: expected a number of seconds > 0, or"):
        watchdog.check_timeout(value)


def test_what_a_wait_is_for_nests_and_says_where_training_is():
    watchdog.at("training step 7, epoch 1")
    with watchdog.doing("ZeRO-3 all-gather of unit 'blocks.2'"):
        described = watchdog.describe("all_gather 'params' of 12 bytes")
    assert (
        described == "all_gather 'params' of 12 bytes; ZeRO-3 all-gather of unit 'blocks.2' (training step 7, epoch 1)"
    )
    watchdog.at("")
    assert watchdog.describe("x") == "x"


def _stalled(scenario: str) -> dict:
    """Rank 0 all-reduces; rank 1 either sleeps (no collective) or waits in an all-gather on another group."""
    dist.init_process_group("gloo")
    other = dist.new_group(backend="gloo")
    watchdog.configure(2.0)
    rank = dist.get_rank()
    started = time.monotonic()
    try:
        if rank == 0:
            with watchdog.doing("gradient bucket 0"):
                comm.all_reduce(torch.ones(3), tag="grads")
        elif scenario == "sleeps":
            time.sleep(8)
            return {"error": "", "seconds": 0.0}
        else:
            comm.all_gather(torch.empty(4), torch.ones(2), group=other, tag="params")
    except watchdog.CollectiveTimeout as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    finally:
        watchdog.configure(None)
    return {"error": "no error", "seconds": time.monotonic() - started}


@pytest.mark.timeout(120)
def test_a_collective_whose_peer_never_comes_fails_naming_it_and_the_peers_wait():
    """Both ranks wait in collectives that never pair (different groups): each fails after ``collective_timeout``
    (2 s), naming its own wait and the other's."""
    zero, one = run_workers(_stalled, 2, "other_group", timeout=90)
    assert zero["error"].startswith("lightning_zero: rank 0 waited 2 s in all_reduce 'grads' of 12 bytes; gradient"), (
        zero
    )
    assert "Meanwhile rank 1: all_gather 'params' of 16 bytes." in zero["error"], zero
    assert one["error"].startswith("lightning_zero: rank 1 waited 2 s in all_gather 'params' of 16 bytes, and its"), one
    assert "Meanwhile rank 0: all_reduce 'grads' of 12 bytes; gradient bucket 0." in one["error"], one
    assert all(2 <= r["seconds"] < 8 for r in (zero, one)), (zero, one)


@pytest.mark.timeout(120)
def test_a_peer_that_runs_no_collective_is_named_as_such():
    zero, _ = run_workers(_stalled, 2, "sleeps", timeout=90)
    assert "rank 0 waited 2 s in all_reduce 'grads'" in zero["error"], zero
    assert "Meanwhile rank 1: no collective of ours pending." in zero["error"], zero
    assert 2 <= zero["seconds"] < 15, zero


_STUCK = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch, torch.distributed as dist
    from lightning_zero.comm import collectives as comm, watchdog
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
    signal.signal(signal.SIGTERM, lambda *_: print("handler ran", flush=True))  # as Lightning installs one
    watchdog.start()
    watchdog.at("training step 3, epoch 0")
    if rank == 0:
        print("waiting", flush=True)
        comm.all_reduce(torch.ones(2), tag="grads")  # rank 1 never joins; no collective_timeout
    else:
        time.sleep(60)
    """
)


@pytest.mark.timeout(120)
def test_sigterm_ends_a_rank_stuck_in_a_collective_naming_it():
    """A SIGTERM handler in Python never runs while the main thread waits inside gloo; the watchdog's thread sees
    the signal, and after its grace period the process exits with 143, saying what it was waiting in."""
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _STUCK, str(rank), port], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for rank in range(2)
    ]
    try:
        assert procs[0].stdout.readline().strip() == b"waiting"
        time.sleep(1)
        sent = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        code = procs[0].wait(timeout=60)
        took = time.monotonic() - sent
        err = procs[0].stderr.read().decode()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert code == 128 + signal.SIGTERM, (code, err)
    assert "lightning_zero: rank 0 received SIGTERM while waiting" in err, err
    assert "in all_reduce 'grads' of 8 bytes (training step 3, epoch 0); exiting (status 143)" in err, err
    assert watchdog.SIGTERM_GRACE_S <= took < watchdog.SIGTERM_GRACE_S + 5, took
