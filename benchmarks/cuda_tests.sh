#!/usr/bin/env bash
# The cuda-marked tests (bf16 kernels against the float32 reference, bitwise determinism, CUDA graphs, the e2e
# models on the GPU) in NGROUPS parallel pytest processes (default 6): most of their time is Triton compiling the
# autotuning candidates of each new shape, which is CPU work, so groups sharing the GPU finish several times sooner
# than one process.
#
#   pip install <your CUDA build of torch 2.11-2.13>
#   pip install -e ".[test]"
#   bash benchmarks/cuda_tests.sh OUT [pytest selection, default: tests]
#
# A collection error (a test module that does not import) fails the run. Writes OUT/group-I.log per group and
# prints each group's last line and every failure's summary. TESTS_S (default 500) bounds each group's seconds.
set -uo pipefail
out=${1:?usage: bash benchmarks/cuda_tests.sh OUT [paths]}
shift
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# The e2e tests compile with backend="moeblaze", which the package's entry point registers.
python3 -c "import importlib.metadata as m; m.distribution('moeblaze-fx')" 2>/dev/null \
    || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || echo "note: 'pip install -e .' failed: the e2e tests will not find backend=\"moeblaze\""
groups=${NGROUPS:-6}
python3 -m pytest -q -p no:cacheprovider -m cuda --collect-only "${@:-tests}" > "$out/collect.log" 2>&1
grep "::" "$out/collect.log" > "$out/ids.txt"
if grep -qE "^ERROR|[0-9]+ errors? " "$out/collect.log"; then
    echo "collection errors:"; grep -E -A3 "^ERROR|^E  " "$out/collect.log" | head -30
    exit 1
fi
echo "$(wc -l < "$out/ids.txt") cuda tests in $groups groups"
pids=()
for ((g = 0; g < groups; g++)); do
    mapfile -t ids < <(awk -v g="$g" -v n="$groups" '(NR - 1) % n == g' "$out/ids.txt")
    ((${#ids[@]})) || continue
    timeout "${TESTS_S:-500}" python3 -m pytest -q -p no:cacheprovider -m cuda "${ids[@]}" > "$out/group-$g.log" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for f in "$out"/group-*.log; do echo "$(basename "$f"): $(tail -1 "$f")"; done
grep -h "^FAILED\|^ERROR" "$out"/group-*.log | head -30
exit $rc
