#!/usr/bin/env bash
# The layer benchmark on the GPU machine in one command: configs A-D of BENCHMARKS.md, the token-scaling
# sweep ((d,h,E,K) = (1024,4096,8,2), T doubling from 8192 to MAX_TOKENS or each provider's first
# out-of-memory) and the dispatch micro-benchmark, all in one process (one dense-GEMM ceiling, one run).
#
#   bash benchmarks/run_device.sh OUTDIR [more `moeblaze bench` options, which override the defaults]
#
# Writes OUTDIR/bench.json, OUTDIR/bench.md, OUTDIR/configs.png and OUTDIR/sweep.png (when matplotlib
# imports), and OUTDIR/bench.log. Sized for about 8 minutes on one H100/H200: no new layer shape starts
# after BUDGET_S seconds (what was skipped is listed under "Not run"); the dispatch benchmark (about a
# minute) runs after that in any case.
#
# Optional wheels (the GPU machine has neither liger-kernel nor, as far as we know, matplotlib): put them
# in .whl/ here and carry .whl (run's carry: [".whl"]):
#   python3 -m pip download --no-deps -d .whl liger-kernel==0.8.5      # the `liger` provider (pure Python)
#   matplotlib contourpy cycler fonttools kiwisolver pyparsing python-dateutil six pillow for cp312
#   manylinux x86_64, as /work/.library/device/README.md describes      # the plots
# Environment: MAX_TOKENS (default 1048576), BUDGET_S (default 360), REPS (default 10),
#   MOEBLAZE_COMMIT (the commit for the tables; git rev-parse when .git is there),
#   LIGER_FUSED_MOE_AUTOTUNE (default 0: pinned, as the peers in BENCHMARKS.md were measured).
set -euo pipefail
out=${1:?usage: bash benchmarks/run_device.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$out"

if compgen -G ".whl/*.whl" >/dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "note: the wheels in .whl did not install here; going on without them"
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# the package itself, editable: its entry point registers backend="moeblaze", which the graphs provider compiles with
# (a fresh machine has no install)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || echo "note: editable install failed"
export LIGER_FUSED_MOE_AUTOTUNE=${LIGER_FUSED_MOE_AUTOTUNE:-0}
export MOEBLAZE_COMMIT=${MOEBLAZE_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}

plot=()
if python3 -c "import matplotlib" 2>/dev/null; then plot=(--plot); else echo "note: matplotlib not importable: no PNGs"; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# What `moeblaze bench` runs, without needing the console script installed.
python3 - --configs A,B,C,D --sweep --sweep-start 8192 --max-tokens "${MAX_TOKENS:-1048576}" \
    --reps "${REPS:-10}" --warmup 2 --budget-s "${BUDGET_S:-360}" --out "$out" "${plot[@]}" "${@:2}" \
    2>&1 <<'PY' | tee "$out/bench.log"
import argparse
import sys

from moeblaze_fx.bench.cli import add_bench_args, run_bench

parser = argparse.ArgumentParser(prog="moeblaze bench")
add_bench_args(parser)
sys.exit(run_bench(parser.parse_args(sys.argv[1:])))
PY
