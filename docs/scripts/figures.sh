#!/usr/bin/env bash
# Regenerate the figures of the docs from real runs: every PNG under docs/images/ but the screenshots
# (docs/scripts/screenshots.sh makes those). Nothing is drawn by hand: each figure is what lightning-zero-report
# plots from a sweep run here and now.
#
#   bash docs/scripts/figures.sh             # both figures (the robust sweep is 112 jobs: ~15 min on 2 cores)
#   bash docs/scripts/figures.sh sweep       # only docs/images/sweep_step_time_memory.png (~5 min on 2 cores)
#   bash docs/scripts/figures.sh robust      # only docs/images/robust_digits_heatmap.png
#
# Needs the package with the report and examples extras (pip install -e ".[examples,report]"). The runs go into a
# temporary directory; the commands are the ones docs/operations/sweeps.md and docs/guide/robust.md show.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
images="$root/docs/images"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
which="${1:-all}"

latest_sweep() { ls -d "$1"/multiruns/*/ | sort | tail -n 1; }

if [[ "$which" == all || "$which" == sweep ]]; then
    # The 5-strategy sweep of docs/operations/sweeps.md: step time (min-max over its steps) and model-state MiB.
    (cd "$work" && lightning-zero-train -m \
        strategy=ddp_scratch,zero1_scratch,zero2_scratch,zero3_scratch,ddp trainer.max_steps=200 \
        paths.log_dir="$work/sweep" >"$work/sweep.log" 2>&1) || { tail -n 40 "$work/sweep.log"; exit 1; }
    sweep="$(latest_sweep "$work/sweep")"
    lightning-zero-report "$sweep" >/dev/null
    cp "$sweep/step_time_memory.png" "$images/sweep_step_time_memory.png"
    echo "wrote docs/images/sweep_step_time_memory.png (from $(ls -d "$sweep"/[0-9]* | wc -l) jobs)"
fi

if [[ "$which" == all || "$which" == robust ]]; then
    # The robust-aggregation sweep of docs/guide/robust.md, one process x 8 workers.
    (cd "$work" && lightning-zero-train -m experiment=robust_digits \
        aggregator=mean,median,trimmed_mean,krum,multi_krum,geometric_median,centered_clipping \
        attack=none,sign_flip,ipm,alie,gaussian,mimic,nan_gradient,label_flip data.worker_split=iid,label_sorted \
        trainer=cpu strategy.workers_per_rank=8 data.batch_size=128 \
        paths.log_dir="$work/robust" >"$work/robust.log" 2>&1) || { tail -n 40 "$work/robust.log"; exit 1; }
    sweep="$(latest_sweep "$work/robust")"
    lightning-zero-report "$sweep" --heatmap aggregator attack --facet data.worker_split >/dev/null
    cp "$sweep/heatmap.png" "$images/robust_digits_heatmap.png"
    echo "wrote docs/images/robust_digits_heatmap.png"
fi
