"""Faults as real jobs meet them: a rank SIGKILLed mid-step, preemption signals, every rank killed during a save.

Each case runs ``tests/scripts/train_faults.py`` (the parity model, 2 ranks, 16 steps, a ``StatefulDataLoader`` so
that a mid-epoch checkpoint resumes exactly) as a subprocess: under Lightning's popen launcher (``python script``)
or under ``torchrun --max-restarts 1``. Resumed runs are compared, tensor by tensor and bit for bit, with an
uninterrupted run of the same strategy (:func:`uninterrupted`, once per strategy).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import clean_env, run_script
from tests.helpers.workers import free_port

SCRIPT = "tests/scripts/train_faults.py"
RUN_TIMEOUT = 240
SLOW = pytest.mark.slow


def _popen(strategy: str, ckpt_dir: Path, out: Path, *extra: str) -> tuple[int | None, str]:
    cmd = [sys.executable, SCRIPT, "--strategy", strategy, "--ckpt-dir", str(ckpt_dir), "--out", str(out), *extra]
    return run_script(cmd, clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())), RUN_TIMEOUT)


_UNINTERRUPTED: dict[str, dict[str, torch.Tensor]] = {}


def uninterrupted(strategy: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final weights of an uninterrupted fit under ``strategy`` (one run per strategy per session)."""
    if strategy not in _UNINTERRUPTED:
        tmp = tmp_path_factory.mktemp(f"uninterrupted_{strategy}")
        code, output = _popen(strategy, tmp / "ckpt", tmp / "params.pt")
        assert code == 0, output[-4000:]
        _UNINTERRUPTED[strategy] = torch.load(tmp / "params.pt")
    return _UNINTERRUPTED[strategy]


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), (name, (got[name] - want[name]).abs().max().item())


# ---------------------------------------------------------------- a rank that dies
@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.parametrize(
    ("strategy", "victim"),
    [("zero3_scratch", 0), pytest.param("zero2_scratch", 0, marks=SLOW), pytest.param("ddp_scratch", 1, marks=SLOW)],
)
def test_a_killed_rank_is_named_and_the_survivor_exits_at_once(tmp_path, strategy, victim):
    """SIGKILL of one rank mid-training under the popen launcher: the survivor fails within seconds (not at the
    30-minute collective timeout), non-zero, and the output names the dead rank.

    Rank 0 killed: the survivor's collective fails and its note says the store rank 0 hosted is gone too. Rank 1
    killed: Lightning's launcher in rank 0 watches its children and kills the job naming the child's rank and exit
    code, unless our note (rank 0 checked rank 1's process: exited) comes first; either names rank 1."""
    start = time.monotonic()
    code, output = _popen(
        strategy, tmp_path / "ckpt", tmp_path / "p.pt", "--hurt", "SIGKILL", "--hurt-rank", str(victim)
    )
    elapsed = time.monotonic() - start
    assert code is not None and code != 0, output[-4000:]
    assert elapsed < 120, elapsed
    if victim == 0:
        assert "lightning_zero: a collective failed because a peer is gone." in output, output[-4000:]
        assert "rank 1: the rendezvous store at 127.0.0.1:" in output and "is gone too" in output, output[-4000:]
    else:
        ours = re.search(r"rank 0: rank 1 \([^)]*:\d+, exited\) did not answer within 3 s", output)
        lightnings = re.search(r"\[rank: 1\] Child process with PID \d+ terminated with code -9", output)
        assert ours or lightnings, output[-4000:]
    assert not (tmp_path / "p.pt").exists()


@pytest.mark.timeout(2 * RUN_TIMEOUT + 120)
@pytest.mark.parametrize(
    "strategy", [pytest.param("zero3_scratch", marks=SLOW), pytest.param("zero1_scratch", marks=SLOW)]
)
def test_torchrun_restarts_a_killed_rank_and_resumes_bit_identically(tmp_path, tmp_path_factory, strategy):
    """``torchrun --max-restarts 1``: rank 1 SIGKILLed at step 5 of 16; the agent restarts both ranks, which resume
    from ``last.ckpt`` (saved after every step) and end with exactly the uninterrupted run's weights."""
    want = uninterrupted(strategy, tmp_path_factory)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
        "--monitor-interval", "0.5", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        SCRIPT, "--strategy", strategy, "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "p.pt"),
        "--hurt", "SIGKILL", "--hurt-rank", "1", "--hurt-step", "5", "--every-step",
    ]  # fmt: skip
    code, output = run_script(cmd, clean_env(), 2 * RUN_TIMEOUT)
    assert code == 0, output[-6000:]
    assert "exitcode: -9" in output and "Restored all states from the checkpoint" in output, output[-6000:]
    assert_bit_identical(torch.load(tmp_path / "p.pt"), want)


# ---------------------------------------------------------------- preemption
@pytest.mark.timeout(3 * RUN_TIMEOUT)
@pytest.mark.parametrize(
    ("strategy", "signal_name", "rank"),
    [
        ("zero2_scratch", "SIGTERM", 1),
        pytest.param("zero3_scratch", "SIGUSR1", -1, marks=SLOW),
        pytest.param("ddp_scratch", "SIGUSR1", 1, marks=SLOW),
        pytest.param("zero1_scratch", "SIGTERM", 0, marks=SLOW),
        pytest.param("robust_ddp_scratch", "SIGTERM", -1, marks=SLOW),
        pytest.param("zero2_scratch_spawn", "SIGTERM", 1, marks=SLOW),
        pytest.param("ddp", "SIGTERM", 1, marks=SLOW),  # Lightning's own: PreemptionCheckpoint is for any strategy
    ],
)
def test_a_preemption_signal_saves_exits_cleanly_and_resumes_bit_identically(
    tmp_path, tmp_path_factory, strategy, signal_name, rank
):
    """The signal reaches one rank (or all) at step 5: every rank stops after step 6, a checkpoint is written
    collectively (``last-preempted.ckpt``), every process exits 0; the next launch resumes it (``ckpt_path="last"``)
    and ends with exactly the uninterrupted run's weights."""
    want = uninterrupted(strategy, tmp_path_factory)
    ckpt = tmp_path / "ckpt"
    code, output = _popen(strategy, ckpt, tmp_path / "p.pt", "--hurt", signal_name, "--hurt-rank", str(rank))
    assert code == 0, output[-4000:]
    for r in range(2):
        assert f"rank {r}: {signal_name if rank in (-1, r) else 'a signal to another rank'}: saving" in output, output
    assert (ckpt / "last-preempted.ckpt").exists() and not (tmp_path / "p.pt").exists()
    assert output.count("at step 6") == 2, output[-4000:]
    code, output = _popen(strategy, ckpt, tmp_path / "p.pt")
    assert code == 0, output[-4000:]
    assert "last-preempted.ckpt" in output  # what Lightning restored
    assert_bit_identical(torch.load(tmp_path / "p.pt"), want)


# ---------------------------------------------------------------- every rank killed during a save
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_every_rank_killed_during_a_sharded_save_leaves_the_last_checkpoint_resumable(tmp_path, tmp_path_factory):
    """Both ranks SIGKILL themselves inside the 7th sharded save (their shards written, nothing renamed): the
    previous ``last.ckpt`` stays complete, the partial save is no checkpoint, and resuming gives exactly the
    uninterrupted run's weights."""
    strategy = "zero2_scratch"
    want = uninterrupted(strategy, tmp_path_factory)
    ckpt = tmp_path / "ckpt"
    code, output = _popen(strategy, ckpt, tmp_path / "p.pt", "--every-step", "--kill-in-save", "7")
    assert code is not None and code != 0, output[-4000:]
    partial = sorted(p.name for p in ckpt.glob("*.partial"))
    assert partial, sorted(p.name for p in ckpt.iterdir())
    assert all(not (ckpt / name / "meta.pt").exists() for name in partial)
    assert (ckpt / "last.ckpt" / "meta.pt").is_file()
    code, output = _popen(strategy, ckpt, tmp_path / "p.pt", "--every-step")
    assert code == 0, output[-4000:]
    assert_bit_identical(torch.load(tmp_path / "p.pt"), want)
