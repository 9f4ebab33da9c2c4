#!/usr/bin/env bash
# One device call: install, the cuda-marked tests, the kernels' bf16 feature checks, then the parts
# named in PARTS (default "tests,features,scale"; also "windows", "stack", "bench"). Results under OUT.
#   bash benchmarks/check_device.sh OUT
set -uo pipefail
out=${1:?usage: bash benchmarks/check_device.sh OUT}
cd "$(dirname "$0")/.."
mkdir -p "$out"
source benchmarks/device_env.sh
export MOEBLAZE_COMMIT=${MOEBLAZE_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
IFS=, read -ra parts <<< "${PARTS:-tests,features,scale}"
for part in "${parts[@]}"; do
    echo "=== $part ($(date -u +%H:%M:%S))"
    case $part in
        tests) TESTS_S=${TESTS_S:-300} bash benchmarks/cuda_tests.sh "$out/tests" ${TESTS_PATHS:-tests} 2>&1 \
               | tail -25 | tee "$out/tests.log" ;;
        features) MB_PARTS=small,features,accumulate MB_BUDGET_S=${FEATURES_S:-150} timeout 240 \
                  python3 benchmarks/expert_device.py "$out/features" 2>&1 | tail -40 ;;
        scale) timeout "${SCALE_TIMEOUT_S:-200}" python3 benchmarks/scale_device.py "$out/scale" --budget-s "${SCALE_S:-120}" 2>&1 | tail -15 ;;
        windows) timeout "${WINDOWS_S:-300}" python3 benchmarks/chunk_device.py "$out/windows" --configs "${CONFIGS:-A,B,C,D}" \
                 --budgets-mib "${BUDGETS_MIB:-0,2048,512,256,128}" 2>&1 | tail -45 ;;
        stack) timeout 200 python3 benchmarks/stack_device.py "$out/stack" 2>&1 | tail -12 ;;
        bench) MOEBLAZE_COMMIT=$MOEBLAZE_COMMIT BUDGET_S=${BENCH_S:-300} MAX_TOKENS=${MAX_TOKENS:-1048576} \
               bash benchmarks/run_device.sh "$out/bench" 2>&1 | tail -60 ;;
    esac
done
