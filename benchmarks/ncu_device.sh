#!/usr/bin/env bash
# Hardware counters of single expert-kernel launches (Nsight Compute), on the GPU machine, one call:
#
#   bash benchmarks/ncu_device.sh OUT [CONFIG] [JOBS]
#
# CONFIG: a layer shape of BENCHMARKS.md (default C). JOBS: comma-separated "name=kernel-regex@pinned-config"
# or "name=kernel-regex" (the autotuned configs). Each job runs two layer steps (router included,
# "activations" policy) in a fresh process, MOEBLAZE_KERNEL_CONFIG pinned where given; the first step
# compiles and autotunes unprofiled, and the first LAUNCHES (default 2) launches of the second step whose
# name matches are profiled (cudaProfilerStart, --profile-from-start off). Writes OUT/NAME.txt (ncu's details page:
# speed of light, memory workload, warp stalls, occupancy, launch statistics). `--clock-control none`: the
# card's clocks stay as they are (METHOD.md). NCU_EXTRA: more ncu arguments, e.g. "--section SourceCounters".
set -uo pipefail
out=${1:?usage: bash benchmarks/ncu_device.sh OUT [CONFIG] [JOBS]}
config=${2:-C}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
default_jobs="dh=_expert_dh_kernel;dw=_expert_dw_kernel;up=_expert_up_kernel"
IFS=';' read -ra jobs <<< "${3:-$default_jobs}"
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
          --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats ${NCU_EXTRA:-})
for job in "${jobs[@]}"; do
    name=${job%%=*}; rest=${job#*=}; regex=${rest%%@*}; pin=""
    [[ $rest == *@* ]] && pin=${rest#*@}
    echo "=== $name: $regex with ${pin:-the tuned configs} at $config ($(date -u +%H:%M:%S))"
    MOEBLAZE_KERNEL_CONFIG=$pin timeout 240 "$ncu" --clock-control none --kernel-name "regex:$regex" \
        --profile-from-start off \
        --launch-count "${LAUNCHES:-2}" "${sections[@]}" -f -o "$out/$name" \
        python3 -c "
import torch
from moeblaze_fx.bench.layer import CONFIGS, make_inputs, _moeblaze_layer, _grads
cfg = CONFIGS['$config']
inp = make_inputs(cfg, torch.device('cuda'), torch.bfloat16, 0, rotate=1)
layer = _moeblaze_layer('activations')
_grads(layer, inp, 0)
torch.cuda.synchronize()
torch.cuda.profiler.start()
_grads(layer, inp, 0)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
" > "$out/$name.log" 2>&1
    echo "rc $?"; tail -3 "$out/$name.log"
    "$ncu" --import "$out/$name.ncu-rep" --page details > "$out/$name.txt" 2>&1
    [[ -n ${KEEP_REP:-} ]] || rm -f "$out/$name.ncu-rep"  # large; the text page is what comes back
    keys="^  [a-zA-Z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput"
    keys+="|DRAM Throughput|Registers Per|Achieved Occupancy|Issued Ipc|No Eligible|Stall"
    grep -E "$keys" "$out/$name.txt" | head -40
done
