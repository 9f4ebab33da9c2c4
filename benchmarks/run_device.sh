#!/usr/bin/env bash
# The layer benchmark on one GPU in one command: configs A-D (docs/benchmarks.md), the token-scaling sweep
# ((d, h, E, K) = (1024, 4096, 8, 2), T doubling from 8192 to MAX_TOKENS or each provider's first out-of-memory) and
# the dispatch micro-benchmark, every provider in one process (one dense-GEMM ceiling, one run). It produces
# benchmarks/RESULTS.md's "Layer A-D with every peer" table.
#
#   pip install <your CUDA build of torch 2.11-2.13>
#   pip install -e ".[bench]"          # the package, plus liger-kernel (the `liger` provider) and matplotlib (plots)
#   bash benchmarks/run_device.sh OUTDIR [more `moeblaze bench` options, which override the defaults]
#
# Without liger-kernel the `liger` provider is listed as skipped; without matplotlib no PNGs are written.
# Writes OUTDIR/bench.json, OUTDIR/bench.md, OUTDIR/configs.png and OUTDIR/sweep.png (with matplotlib), and
# OUTDIR/bench.log. Sized for about 8 minutes on one H100/H200: no new layer shape starts after BUDGET_S seconds
# (what was skipped is listed under "Not run"); the dispatch benchmark (about a minute) runs after that in any case.
# Environment: MAX_TOKENS (default 1048576), BUDGET_S (default 360), REPS (default 10),
#   MOEBLAZE_COMMIT (the commit for the tables; git rev-parse when .git is there),
#   LIGER_FUSED_MOE_AUTOTUNE (default 0: Liger's autotuning pinned, as the peers in docs/benchmarks.md were measured).
set -euo pipefail
out=${1:?usage: bash benchmarks/run_device.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$out"

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# The graphs provider compiles with backend="moeblaze", which the package's entry point registers: install this
# checkout (editable, no dependencies) when that has not been done.
python3 -c "import importlib.metadata as m; m.distribution('moeblaze-fx')" 2>/dev/null \
    || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || echo "note: 'pip install -e .' failed: the moeblaze-graphs provider will not find the backend"
export LIGER_FUSED_MOE_AUTOTUNE=${LIGER_FUSED_MOE_AUTOTUNE:-0}
export MOEBLAZE_COMMIT=${MOEBLAZE_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}

plot=()
if python3 -c "import matplotlib" 2>/dev/null; then plot=(--plot); else echo "note: matplotlib not importable: no PNGs"; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# What `moeblaze bench` runs, without needing the console script on PATH.
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
