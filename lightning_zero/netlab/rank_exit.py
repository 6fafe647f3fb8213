"""``python -m lightning_zero.netlab.rank_exit DIR COMMAND ARGS``: run one rank's COMMAND and keep its exit code.

torchrun reports a failed worker with exit code 1 whatever the worker returned; the lab returns the command's own
code (:func:`lightning_zero.netlab.launch.exit_code`), so each rank's wrapper writes ``DIR/rank<RANK>.rc``. Signals
torchrun sends the wrapper (SIGTERM when another rank failed, SIGINT on Ctrl-C) go on to the command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m lightning_zero.netlab.rank_exit DIR COMMAND [ARGS...]", file=sys.stderr)
        return 2
    out, command = Path(argv[0]), argv[1:]
    child = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _frame: child.send_signal(number))
    code = child.wait()
    rc = code if code >= 0 else 128 - code  # killed by signal N: the shell's 128 + N
    final = out / f"rank{os.environ.get('RANK', '0')}.rc"
    partial = final.with_suffix(".tmp")
    partial.write_text(f"{rc}\n")
    partial.replace(final)  # whole or absent: the lab polls these files while ranks end
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
