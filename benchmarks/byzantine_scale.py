"""Messages and bytes of one fault-free step of the Byzantine ranks mode from 16 to 1024 ranks, for the protocol as
built (PBFT-style) and a HotStuff-style variant ([Note: step costs] in ``lightning_zero/byzantine/costs.py``, whose
formulas ``tests/byzantine/test_costs.py`` checks against the ledger of real steps byte for byte).

Runbook::

    python benchmarks/byzantine_scale.py                       # the GPT benchmark model: d = 27.4M fp32, k = 1
    python benchmarks/byzantine_scale.py --d 1000000 --ranks 4 7 16 64

For each N (f = floor((N - 1) / 3), the most the mode tolerates, or ``--f``) it prints, per variant, the frames and
the GiB sent by all ranks together, split into *data* (the rows to the 2f + 1 aggregators of each shard, the
requests, the shard results and partial sums) and *control* (echo and agreement), and the control bytes per rank.
"""

from __future__ import annotations

import argparse

from lightning_zero.byzantine.costs import hotstuff_step, pbft_step

DATA = ("byzantine_inputs", "byzantine_request", "byzantine_results", "byzantine_totals")
CONTROL = ("byzantine_echo", "agreement")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=27_400_000, help="columns (parameters) of a worker row")
    parser.add_argument("--k", type=int, default=1, help="worker rows per rank")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--f", type=int, default=None, help="faulty ranks tolerated (default: floor((N - 1) / 3))")
    args = parser.parse_args()
    print(f"d = {args.d}, k = {args.k}, fp32; totals of the median (n k counts, one distance); per step, all ranks")
    print("| N | f | variant | frames | data GiB | control GiB | control MiB per rank |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for n in args.ranks:
        f = (n - 1) // 3 if args.f is None else args.f
        for name, model in (("PBFT-style (built)", pbft_step), ("HotStuff-style", hotstuff_step)):
            costs = model(n, f, args.d, args.k, totals=[n * args.k * 4, 4])
            frames = sum(v[0] for v in costs.values())
            data = sum(costs[t][1] for t in DATA if t in costs) / 2**30
            control = sum(costs[t][1] for t in CONTROL) / 2**30
            print(f"| {n} | {f} | {name} | {frames:,} | {data:,.1f} | {control:,.3f} | {control * 1024 / n:,.2f} |")


if __name__ == "__main__":
    main()
