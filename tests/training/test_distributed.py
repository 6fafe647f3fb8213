"""The process group at exit (``lightning_zero/training/distributed.py``, [Note: process group torn down at exit])."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.workers import free_port

# gloo's worker threads are C++ threads: counted from /proc, which the threading module does not see.
SCRIPT = r"""
import gc, os, sys
import torch, torch.distributed as dist
from lightning_zero.training import distributed as plumbing

def threads():
    return len(os.listdir("/proc/self/task"))

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
dist.all_reduce(torch.ones(3))
before = threads()
gc.disable()  # the cycle below waits for a collection, as a trainer's often does until the end of the process

class Holder:  # a group only a reference cycle holds, as a finished trainer holds its strategy's groups
    pass

holder = Holder()
holder.me, holder.group = holder, dist.new_group([0])
dist.all_reduce(torch.ones(3), group=holder.group)
with_group = threads()
del holder
plumbing._destroy_process_group_at_exit()
print(before, with_group, threads(), dist.is_initialized())
plumbing._destroy_process_group_at_exit()  # nothing left: a no-op
"""


@pytest.mark.timeout(120)
def test_the_exit_handler_destroys_the_group_and_joins_the_workers_of_groups_nothing_reaches() -> None:
    """A gloo group held by a reference cycle keeps its worker threads after ``destroy_process_group``; the exit
    handler frees it while the interpreter is whole, so no worker is left to take the GIL during finalization."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port())], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, with_group, after, initialized = proc.stdout.split()
    assert int(with_group) > int(before)  # the new group's workers (and its transport loop) exist
    assert int(after) < int(before)  # the default group's too are gone: nothing held it
    assert initialized == "False"
