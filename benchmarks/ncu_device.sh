#!/usr/bin/env bash
# Hardware counters of single expert-kernel launches (Nsight Compute), on the GPU machine, one call:
#
#   bash benchmarks/ncu_device.sh OUT [CONFIG] [JOBS]
#
# CONFIG: a layer shape of BENCHMARKS.md (default C). JOBS: comma-separated "name=kernel-regex@pinned-config"
# (default: the dh, dw and up kernels at their tuned shapes). Each job runs one layer step (router included,
# "activations" policy) in a fresh process with MOEBLAZE_KERNEL_CONFIG pinned (no autotuning launches to
# profile), profiles the first launches whose name matches, and writes OUT/NAME.txt (ncu's details page:
# speed of light, memory workload, warp stalls, occupancy, launch statistics). `--clock-control none`: the
# card's clocks stay as they are (METHOD.md).
set -uo pipefail
out=${1:?usage: bash benchmarks/ncu_device.sh OUT [CONFIG] [JOBS]}
config=${2:-C}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
default_jobs="dh=_expert_dh_kernel@block_m=128,block_n=64,block_k=64,num_warps=8,num_stages=4,split_n=2,group_m=16"
default_jobs+=";dw=_expert_dw_kernel@block_m=128,block_n=256,block_k=64,num_warps=8,num_stages=4"
default_jobs+=";up=_expert_up_kernel@block_m=128,block_n=128,block_k=64,num_warps=8,num_stages=3"
IFS=';' read -ra jobs <<< "${3:-$default_jobs}"
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
          --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats)
for job in "${jobs[@]}"; do
    name=${job%%=*}; rest=${job#*=}; regex=${rest%%@*}; pin=${rest#*@}
    echo "=== $name: $regex with $pin at $config ($(date -u +%H:%M:%S))"
    MOEBLAZE_KERNEL_CONFIG=$pin timeout 240 "$ncu" --clock-control none --kernel-name "regex:$regex" \
        --launch-count "${LAUNCHES:-2}" "${sections[@]}" -f -o "$out/$name" \
        python3 -c "
import torch
from moeblaze_fx.bench.layer import CONFIGS, make_inputs, _moeblaze_layer, _grads
cfg = CONFIGS['$config']
inp = make_inputs(cfg, torch.device('cuda'), torch.bfloat16, 0, rotate=1)
_grads(_moeblaze_layer('activations'), inp, 0)
torch.cuda.synchronize()
" > "$out/$name.log" 2>&1
    echo "rc $?"; tail -3 "$out/$name.log"
    "$ncu" --import "$out/$name.ncu-rep" --page details > "$out/$name.txt" 2>&1
    grep -E "^  [a-zA-Z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Issued Ipc|No Eligible|Stall" "$out/$name.txt" | head -40
done
