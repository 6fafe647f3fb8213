#!/usr/bin/env bash
# GPU readiness check: every test marked `gpu` (python -m pytest -m gpu) and a one-GPU step-time comparison of the
# strategies (benchmarks/gpu_step_time.py), bounded to finish in under 8 minutes. Everything goes to stdout; the exit
# status is pytest's when the tests fail (124: they hit their time limit), 4 when torch sees no CUDA device (the gpu
# tests then skip), 3 when only the benchmark failed, 2 when the environment is not usable, 0 otherwise.
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine, from anywhere in the repo
#   bash benchmarks/gpu_check.sh --prepare  # beforehand, on a machine that reaches PyPI (see below)
#
# Environment: an interpreter with torch (CUDA) and lightning; $PYTHON, else the first of python3/python that imports
# torch. lightning_zero is used from this checkout (PYTHONPATH), not installed: `pip install -e .` would ask for
# torch>=2.13 and, offline, fail, or, online, replace a machine's CUDA torch. The test suite's conftest imports hydra
# and omegaconf; where they are missing they are installed from build/gpu-wheels/ (made by --prepare; pure-Python
# wheels, a few hundred KB; build/ is git-ignored) into a temporary --target directory, or else from PyPI if it can be
# reached. Limits (seconds): GPU_CHECK_BUDGET (total, default 450), GPU_CHECK_TEST_TIMEOUT (pytest, default 280);
# the benchmark gets what is left, at most 150. GPU_STEP_TIME_ARGS overrides the benchmark's arguments.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
WHEELS=build/gpu-wheels
# module to import : distribution (wheel file prefix) : version --prepare fetches
NEEDED="hydra:hydra_core:1.3.8 omegaconf:omegaconf:2.3.1 antlr4:antlr4_python3_runtime:4.9.3 pytest_timeout:pytest_timeout:2.4.0"

if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
else
    PY=""
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
            PY=$candidate
            break
        fi
    done
    if [ -z "$PY" ]; then
        echo "gpu_check: no python3/python that imports torch (set PYTHON)"
        exit 2
    fi
fi

if [ "${1:-}" = "--prepare" ]; then
    mkdir -p "$WHEELS"
    specs=""
    for entry in $NEEDED; do
        IFS=: read -r _ dist version <<<"$entry"
        specs="$specs ${dist//_/-}==$version"
    done
    # shellcheck disable=SC2086
    "$PY" -m pip wheel --quiet --no-deps --wheel-dir "$WHEELS" $specs || exit 2
    ls -l "$WHEELS"
    exit 0
fi

SITE=""
LOG=""
trap 'rm -rf "$SITE" "$LOG"' EXIT
BUDGET=${GPU_CHECK_BUDGET:-450}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-280}
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# One machine: let NCCL bootstrap over loopback when nothing else is configured (a world of one process).
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}

echo "== environment ($(date -u +%FT%TZ), $ROOT)"
"$PY" -c "import sys, torch, lightning; print(sys.executable, sys.version.split()[0]); print('torch', torch.__version__,\
 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), torch.cuda.device_count(), 'device(s)');\
 print('lightning', lightning.__version__)" || { echo "gpu_check: torch/lightning not importable with $PY"; exit 2; }
nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
cuda_ok=1
"$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || {
    cuda_ok=0
    echo "gpu_check: torch sees no CUDA device: the gpu tests will skip and the benchmark cannot run"
}

missing=""
for entry in $NEEDED; do
    IFS=: read -r module dist _ <<<"$entry"
    "$PY" -c "import $module" >/dev/null 2>&1 || missing="$missing $module:$dist"
done
if [ -n "$missing" ]; then
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site.XXXXXX")
    wheels=""
    for entry in $missing; do
        dist=${entry#*:}
        found=$(ls "$WHEELS/$dist"-*.whl 2>/dev/null | head -n 1)
        [ -n "$found" ] && wheels="$wheels $found"
    done
    echo "== installing into $SITE:$missing"
    if [ -n "$wheels" ]; then
        # shellcheck disable=SC2086
        "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --target "$SITE" $wheels
    else
        specs=""
        for entry in $missing; do dist=${entry#*:}; specs="$specs ${dist//_/-}"; done
        # shellcheck disable=SC2086
        timeout 120 "$PY" -m pip install --quiet --disable-pip-version-check --retries 0 --timeout 10 --no-deps --target "$SITE" $specs
    fi
    export PYTHONPATH="$PYTHONPATH:$SITE"
    for entry in $missing; do
        module=${entry%%:*}
        "$PY" -c "import $module" >/dev/null 2>&1 || {
            echo "gpu_check: cannot import $module; run 'bash benchmarks/gpu_check.sh --prepare' where PyPI is reachable"
            echo "and bring $WHEELS/ along"
            exit 2
        }
    done
fi
"$PY" -c "import lightning_zero; print('lightning_zero', lightning_zero.__version__, 'from', lightning_zero.__file__)" ||
    { echo "gpu_check: lightning_zero not importable"; exit 2; }

LOG=$(mktemp "${TMPDIR:-/tmp}/gpu-check-pytest.XXXXXX")
echo
echo "== python -m pytest -m gpu (limit ${TEST_TIMEOUT}s)"
timeout -k 5 "$TEST_TIMEOUT" "$PY" -m pytest -m gpu -q -rA -s -p no:cacheprovider 2>&1 | tee "$LOG"
test_rc=${PIPESTATUS[0]}
[ "$test_rc" -eq 124 ] && echo "gpu_check: pytest stopped at its ${TEST_TIMEOUT}s limit"

bench_limit=$((BUDGET - SECONDS - 10))
[ "$bench_limit" -gt 150 ] && bench_limit=150
echo
if [ "$bench_limit" -lt 30 ]; then
    echo "== one-GPU step time: skipped, ${bench_limit}s left of the ${BUDGET}s budget"
    bench_rc=0
else
    # shellcheck disable=SC2086
    set -- ${GPU_STEP_TIME_ARGS:-}
    echo "== python benchmarks/gpu_step_time.py $* (limit ${bench_limit}s)"
    timeout -k 5 "$bench_limit" "$PY" benchmarks/gpu_step_time.py "$@" 2>&1
    bench_rc=$?
    [ "$bench_rc" -eq 124 ] && echo "gpu_check: the benchmark stopped at its ${bench_limit}s limit"
fi

echo
echo "== summary (${SECONDS}s)"
grep -E "on CUDA|CUDA/NCCL|cuda parity" "$LOG" || true
grep -E "^(PASSED|FAILED|ERROR|SKIPPED) " "$LOG" || true
tail -n 1 "$LOG"
echo "pytest exit status $test_rc, benchmark exit status $bench_rc"
if [ "$test_rc" -ne 0 ]; then
    exit "$test_rc"
fi
[ "$cuda_ok" -eq 1 ] || { echo "gpu_check: no CUDA device, nothing was checked"; exit 4; }
[ "$bench_rc" -eq 0 ] || exit 3
exit 0
