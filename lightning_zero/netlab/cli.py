"""``lightning-zero-netlab``: run a command's ranks as if on separate nodes joined by rate-limited links.

Runbook (as root; ``ip`` and ``tc`` from iproute2)::

    lightning-zero-netlab --nodes 2 --inter-node 1gbit -- \\
        lightning-zero-train strategy=ddp_scratch trainer.devices=1 trainer.num_nodes=2
    lightning-zero-netlab --nodes 2 --ranks-per-node 2 --inter-node 300mbit --intra-node 10gbit -- \\
        python benchmarks/step_time.py
    lightning-zero-netlab --nodes 2 --inter-node 1gbit --check --json link.json   # rate, α and β per collective
    lightning-zero-netlab --cleanup          # remove what a killed lab left behind (names starting with lzlab-)

Each node is a network namespace; node k's ranks start there under torchrun (``--nnodes``, rendezvous on node 0's
address) and reach the other nodes only over the lab's links, each node's egress shaped with ``tc tbf`` at
``--inter-node`` ([Note: lab topology] in ``lightning_zero/netlab/topology.py``). Ranks of one node talk over its
loopback, unshaped unless ``--intra-node``. The lab prints what it built (rates and the tbf burst derived from each
MTU, [Note: tbf burst] in ``lightning_zero/netlab/rates.py``), removes it on exit, on Ctrl-C and on error, and exits
with the command's exit code. Refusals are one line and exit 2: not root, ``ip``/``tc`` missing, a lab name already
taken, a rate that does not parse.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from lightning_zero.comm.rates import FORMS, parse_rate
from lightning_zero.netlab.lab import LabError, NetLab, cleanup
from lightning_zero.netlab.launch import DEFAULT_PORT, run_command
from lightning_zero.netlab.rates import parse_size
from lightning_zero.netlab.topology import MAX_NODES, LabPlan


def _count(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` (to ``high``), else argparse's one-line error naming the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected an integer from {low}" + (f" to {high}" if high else " up")
            )
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-zero-netlab",
        description="Run COMMAND's ranks on simulated nodes joined by rate-limited links (network namespaces, tc).",
        usage="lightning-zero-netlab [options] -- COMMAND [ARGS...] | --cleanup",
    )
    parser.add_argument("--nodes", type=_count(1, MAX_NODES), default=2, help="simulated nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=_count(1), default=1, help="ranks torchrun starts on each node")
    parser.add_argument("--inter-node", default="1gbit", help=f"each node's egress rate: {FORMS} (default 1gbit)")
    parser.add_argument("--intra-node", default="unlimited", help="the rate between ranks of one node (loopback)")
    parser.add_argument(
        "--master-port", type=_count(1, 65535), default=DEFAULT_PORT, help="torchrun's rendezvous port on node 0"
    )
    parser.add_argument("--cleanup", action="store_true", help="remove every lab namespace (lzlab-*) and exit")
    parser.add_argument(
        "--check", action="store_true", help="measure each link and the collectives over the lab (before COMMAND)"
    )
    parser.add_argument("--check-max-size", default="256MiB", help="the largest collective --check times (256MiB)")
    parser.add_argument("--json", type=Path, default=None, help="where --check writes its results as JSON")
    return parser


def _plan(args: argparse.Namespace) -> LabPlan:
    return LabPlan(
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        inter_node=parse_rate("--inter-node", args.inter_node),
        intra_node=parse_rate("--intra-node", args.intra_node),
    )


def _exit_on_signal(number: int, _frame: FrameType | None) -> None:
    print(f"lightning-zero-netlab: {signal.Signals(number).name}; removing the lab", file=sys.stderr, flush=True)
    raise SystemExit(128 + number)  # unwinds through the lab's `with`: it removes what it made


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    args = _parser().parse_args(argv)
    try:
        if args.cleanup:
            removed = cleanup()
            print(f"netlab: removed {', '.join(removed)}" if removed else "netlab: nothing to remove")
            return 0
        if not command and not args.check:
            raise LabError("no command to run: give it after `--` (lightning-zero-netlab --nodes 2 -- COMMAND ...)")
        plan = _plan(args)
        largest = parse_size("--check-max-size", args.check_max_size)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _exit_on_signal)
        # Ctrl-C ends the lab even where a shell started it in the background (with SIGINT ignored).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with NetLab(plan):
            print(plan.describe(), flush=True)
            if args.check:
                from lightning_zero.netlab.check import run_check  # imports torch: not for a refusal or --cleanup

                run_check(plan, largest, args.json)
            return run_command(plan, command, port=args.master_port) if command else 0
    except (LabError, ValueError) as err:
        print(f"lightning-zero-netlab: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lightning-zero-netlab: interrupted; the lab is removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
