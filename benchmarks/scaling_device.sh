#!/usr/bin/env bash
# Scaling of torchtitan's MoE training over GPUs, moeblaze against Inductor (issue 41, point 4). For each GPU count
# in NGPUS it trains torchtitan 0.2.2's Qwen3-MoE with FSDP2 alone and, from 2 GPUs on, with FSDP2 + expert
# parallelism (EP = the GPU count), each with the default compile backend (Inductor) and with `--compile.backend
# moeblaze`, for a few steps at TOKENS_PER_GPU tokens per GPU, and writes a table: tokens/s per GPU (torchtitan's
# "tps", median over the timed steps), peak memory per GPU (torchtitan's "memory", the allocator's peak reserved
# GiB), moeblaze / Inductor, scaling efficiency (tokens/s per GPU at N over 1 GPU, same backend), and whether every
# MoE block ran the moeblaze operator on every rank (moe_ffn events in the last step's profile).
#
#   bash benchmarks/scaling_device.sh OUTDIR               # NGPUS="1 2" (default); NGPUS="1 4" or "1 2 4" on 4 GPUs
#   bash benchmarks/scaling_device.sh --plan OUTDIR        # the runs and torchtitan's command lines; runs nothing
#   bash benchmarks/scaling_device.sh --dry-run OUTDIR     # install, text, each run's job config and model flavor
#   bash benchmarks/scaling_device.sh --table OUTDIR       # only the table, from OUTDIR's runs
#
# One run failing (an exception, a hang cut by RUN_TIMEOUT) is recorded as failed with its last error line and the
# others go on; runs that would start past BUDGET seconds are recorded as not run. The table is rewritten after
# every run, so a cut-off call still leaves the runs it finished. Order: 1 GPU, then 2 (FSDP2, then FSDP2 + EP),
# then 4; Inductor before moeblaze at each. NGPUS="1 2" is 6 runs, "1 4" 6, "1 2 4" 10 (more than one 9-minute call
# holds at the default sizes: raise BUDGET and RUN_TIMEOUT with the call's limit, or split the GPU counts).
#
# torchtitan, its wheels, tokenizer and text: as benchmarks/torchtitan_device.sh (sourced: WHL_DIR, PYARROW_DIR,
# TT_TARGET, SCRATCH, PYTHON mean the same). EP is torchtitan's `--parallelism.expert_parallel_degree` with its
# "standard" all-to-all; it borrows the FSDP degree (EP = FSDP = N: the experts are split over the ranks and not
# sharded further). Under EP, 0.2.2 compiles the expert function with its row count marked dynamic, runs the
# all-to-alls eagerly, and pads each local expert's rows to a multiple of 8 (16 for float8) before the products.
# At 1 GPU torchtitan has no FSDP and trains under torch.autocast(bf16) over float32 weights; from 2 GPUs on, FSDP2's
# MixedPrecisionPolicy (bf16 parameters) does it: the 1-GPU baseline of the scaling efficiency differs in that too.
#
# Model: FLAVOR (default debugmodel_moe: 8 blocks, d=256, 16 heads of 128, 64 experts of 768, top-8, vocab 2048).
# FLAVOR_OVERRIDES derives a new flavor named FLAVOR from FLAVOR_BASE (default debugmodel_moe), registered in
# every rank before the trainer reads its model table, e.g. FLAVOR=moe_d1024 FLAVOR_OVERRIDES=dim=1024,n_heads=8,
# n_kv_heads=4,moe_inter_dim=512 (issue 41's FSDP2 model: d=1024, 64 experts of 512, top-8, here 8 blocks).
#
# Settings (environment): NGPUS ("1 2"), PARALLELISMS ("fsdp fsdp-ep"), BACKENDS ("inductor moeblaze"),
# TOKENS_PER_GPU (16384), SEQ_LEN (4096; LOCAL_BATCH = TOKENS_PER_GPU / SEQ_LEN), STEPS (12), TIMED_FROM (4: the
# timed steps are TIMED_FROM..STEPS-2; the last two are the profiler's warm-up and its traced step), SEED (42),
# RUN_TIMEOUT (150 s a run, compile included), BUDGET (480 s for all runs: a run is started only if at least
# RUN_MIN (60) s are left), MOEBLAZE_COMMIT (the commit named in the table; default git's HEAD), MOEBLAZE_OPTIONS
# (passed on). Writes OUTDIR/<run>/{meta.json,train.log,moeblaze_report_rank<R>.json}, OUTDIR/env.json and
# OUTDIR/scaling.{md,json}; <run> = n<N>_<parallelism>_<backend>. Exit status 0 if every run finished, 1 if one
# failed or was not run, 2 if nothing could start.
set -euo pipefail

mode=run
case "${1:-}" in
    --plan) mode=plan; shift ;;
    --dry-run) mode=dry-run; shift ;;
    --table) mode=table; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
out=${1:?"usage: bash benchmarks/scaling_device.sh [--plan|--dry-run|--table] OUTDIR (see --help)"}
mkdir -p "$out"
out=$(cd "$out" && pwd)

# shellcheck source=benchmarks/torchtitan_device.sh
source "$(dirname "${BASH_SOURCE[0]}")/torchtitan_device.sh"   # repo, PYTHON, WHL_DIR, ..., install_wheels, LAUNCH
cd "$repo"
here=$repo/benchmarks
NGPUS=${NGPUS:-1 2}
PARALLELISMS=${PARALLELISMS:-fsdp fsdp-ep}
BACKENDS=${BACKENDS:-inductor moeblaze}
TOKENS_PER_GPU=${TOKENS_PER_GPU:-16384}
SEQ_LEN=${SEQ_LEN:-4096}
STEPS=${STEPS:-12}
TIMED_FROM=${TIMED_FROM:-4}
SEED=${SEED:-42}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
BUDGET=${BUDGET:-480}
RUN_MIN=${RUN_MIN:-60}
FLAVOR=${FLAVOR:-debugmodel_moe}
FLAVOR_BASE=${FLAVOR_BASE:-debugmodel_moe}
FLAVOR_OVERRIDES=${FLAVOR_OVERRIDES:-}
MOEBLAZE_COMMIT=${MOEBLAZE_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}

die() { echo "error: $*" >&2; exit 2; }
for v in TOKENS_PER_GPU SEQ_LEN STEPS TIMED_FROM SEED RUN_TIMEOUT BUDGET RUN_MIN; do
    [[ ${!v} =~ ^[0-9]+$ ]] || die "$v=${!v} is not a whole number"
done
for n in $NGPUS; do
    [[ $n =~ ^[1-9][0-9]*$ ]] || die "NGPUS='$NGPUS': '$n' is not a GPU count (write e.g. NGPUS=\"1 2 4\")"
done
[[ -n ${NGPUS// /} ]] || die "NGPUS is empty: give the GPU counts, e.g. NGPUS=\"1 2\""
for p in $PARALLELISMS; do
    [[ $p == fsdp || $p == fsdp-ep ]] || die "PARALLELISMS='$PARALLELISMS': '$p' is neither fsdp nor fsdp-ep"
done
for b in $BACKENDS; do
    [[ $b == inductor || $b == moeblaze ]] || die "BACKENDS='$BACKENDS': '$b' is neither inductor nor moeblaze"
done
((SEQ_LEN > 0 && TOKENS_PER_GPU % SEQ_LEN == 0 && TOKENS_PER_GPU >= SEQ_LEN)) ||
    die "TOKENS_PER_GPU=$TOKENS_PER_GPU is not a multiple of SEQ_LEN=$SEQ_LEN: each GPU trains whole sequences"
LOCAL_BATCH=$((TOKENS_PER_GPU / SEQ_LEN))
TIMED_TO=$((STEPS - 2))
((TIMED_FROM >= 2 && TIMED_FROM <= TIMED_TO)) ||
    die "TIMED_FROM=$TIMED_FROM, STEPS=$STEPS: the timed steps TIMED_FROM..STEPS-2 must be non-empty" \
        "and leave step 1 (compile) out"
[[ $FLAVOR != "$FLAVOR_BASE" || -z $FLAVOR_OVERRIDES ]] ||
    die "FLAVOR_OVERRIDES is set but FLAVOR=$FLAVOR is the base flavor: name the derived flavor (e.g. FLAVOR=moe_d1024)"
MOE_BLOCKS=$("$PYTHON" "$here/scaling_device.py" moe-blocks --default 8 --overrides "$FLAVOR_OVERRIDES") ||
    die "FLAVOR_OVERRIDES='$FLAVOR_OVERRIDES' (above)"

runs=()   # n<N>_<parallelism>_<backend>, in the order they run
for n in $NGPUS; do
    for p in $PARALLELISMS; do
        [[ $p == fsdp-ep && $n == 1 ]] && continue   # one GPU: no expert parallelism
        for b in $BACKENDS; do runs+=("n${n}_${p}_${b}"); done
    done
done

# torchtitan's command line for one run.
train_args() {
    local n=$1 par=$2 backend=$3 dump=$4
    local args=(
        --model.name qwen3 --model.flavor "$FLAVOR" --model.hf_assets_path "$WHL_DIR/assets/tokenizer"
        --training.dataset c4_test --training.dataset_path "$SCRATCH/data"
        --training.steps "$STEPS" --training.seq_len "$SEQ_LEN" --training.local_batch_size "$LOCAL_BATCH"
        --parallelism.data_parallel_shard_degree "$n"
        --compile.enable --compile.components model --compile.backend "$backend"
        --activation_checkpoint.mode none
        --lr_scheduler.warmup_steps 2
        --metrics.log_freq 1 --metrics.disable_color_printing
        --debug.seed "$SEED"
        --job.dump_folder "$dump"
    )
    if [[ $par == fsdp-ep ]]; then args+=(--parallelism.expert_parallel_degree "$n"); fi
    if [[ $backend == moeblaze ]]; then   # the operator is counted in the last step's trace
        args+=(--profiling.enable_profiling --profiling.profile_freq "$STEPS" --profiling.profiler_warmup 1
               --profiling.profiler_active 1)
    fi
    printf '%s\n' "${args[@]}"
}

# The extra flavor (if any), registered before LAUNCH starts torchtitan's trainer.
PRELUDE='
import os, site, sys
site.addsitedir(os.environ["TT_TARGET"])
sys.path.insert(0, os.path.join(os.environ["MOEBLAZE_REPO"], "benchmarks"))
import scaling_device
scaling_device.register_flavor_in_rank()
'

write_meta() {  # run ngpu parallelism backend rc seconds why
    "$PYTHON" - "$out/$1/meta.json" "$@" "$TIMED_FROM" "$TIMED_TO" "$MOE_BLOCKS" <<'PY'
import json, sys
path, run, n, par, backend, rc, secs, why, lo, hi, blocks = sys.argv[1:]
json.dump({"run": run, "ngpu": int(n), "parallelism": par, "backend": backend,
           "rc": None if rc == "" else int(rc), "seconds": None if secs == "" else int(secs),
           "why": why or None, "timed_from": int(lo), "timed_to": int(hi), "moe_blocks": int(blocks)},
          open(path, "w"), indent=1)
PY
}

run_one() {
    local run=$1 n par backend
    IFS=_ read -r n par backend <<<"$run"; n=${n#n}
    local dir=$out/$run
    rm -rf "$dir" "${SCRATCH:?}/$run"; mkdir -p "$dir"
    local left=$((BUDGET - (SECONDS - t_start)))
    if ((left < RUN_MIN)); then
        echo "== $run: not run ($left s of BUDGET=$BUDGET left, RUN_MIN=$RUN_MIN)"
        write_meta "$run" "$n" "$par" "$backend" "" "" "not started: $left s of BUDGET=$BUDGET s were left"
        return 1
    fi
    if ((n > ngpu_here)); then
        echo "== $run: not run (this machine has $ngpu_here GPU(s))"
        write_meta "$run" "$n" "$par" "$backend" "" "" "needs $n GPUs; the machine has $ngpu_here"
        return 1
    fi
    local limit=$((left < RUN_TIMEOUT ? left : RUN_TIMEOUT))
    mapfile -t args < <(train_args "$n" "$par" "$backend" "$SCRATCH/$run")
    echo "== $run: torchrun --nproc_per_node=$n torchtitan.train ${args[*]} (limit $limit s)"
    local t0=$SECONDS rc=0 report_dir=""
    if [[ $backend == moeblaze ]]; then report_dir=$dir; fi
    # every rank's lines, each behind torchrun's "[rank<R>]:" prefix (--tee 3 with --role rank)
    TT_TARGET=$TT_TARGET MOEBLAZE_REPO=$repo MOEBLAZE_REPORT_DIR=$report_dir \
        TT_FLAVOR=$FLAVOR TT_FLAVOR_BASE=$FLAVOR_BASE TT_FLAVOR_OVERRIDES=$FLAVOR_OVERRIDES \
        timeout --signal=TERM --kill-after=15 "$limit" \
        "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$n" --role rank --tee 3 \
        --no-python "$PYTHON" -c "$PRELUDE$LAUNCH" "${args[@]}" >"$dir/train.log" 2>&1 || rc=$?
    echo "   $run: exit $rc after $((SECONDS - t0)) s"
    if ((rc != 0)); then tail -n 15 "$dir/train.log"; fi
    write_meta "$run" "$n" "$par" "$backend" "$rc" "$((SECONDS - t0))" ""
    return $rc
}

write_env() {
    "$PYTHON" "$here/scaling_device.py" env "$out" --commit "$MOEBLAZE_COMMIT" --tokens-per-gpu "$TOKENS_PER_GPU" \
        --seq-len "$SEQ_LEN" --local-batch "$LOCAL_BATCH" --steps "$STEPS" --timed-from "$TIMED_FROM" \
        --timed-to "$TIMED_TO" --flavor "$FLAVOR" --flavor-overrides "$FLAVOR_OVERRIDES" --scratch "$SCRATCH" \
        --torchtitan "$TT_VERSION"
}

table() { "$PYTHON" "$here/scaling_device.py" table "$out"; }

case $mode in
plan)
    echo "${#runs[@]} runs, $TOKENS_PER_GPU tokens per GPU (seq $SEQ_LEN x local batch $LOCAL_BATCH), $STEPS steps," \
         "timed $TIMED_FROM..$TIMED_TO, flavor $FLAVOR ($MOE_BLOCKS MoE blocks)${FLAVOR_OVERRIDES:+ = $FLAVOR_BASE + $FLAVOR_OVERRIDES}"
    for run in "${runs[@]}"; do
        IFS=_ read -r n par backend <<<"$run"; n=${n#n}
        mapfile -t args < <(train_args "$n" "$par" "$backend" "$SCRATCH/$run")
        echo "$run: torchrun --nproc_per_node=$n torchtitan.train ${args[*]}"
    done
    ;;
dry-run)
    install_wheels
    modules_check || echo "note: modules missing (above): a training run would fail"
    make_data "$SCRATCH/data"
    echo "== the job configs torchtitan parses, and the model flavor"
    for run in "${runs[@]}"; do
        IFS=_ read -r n par backend <<<"$run"; n=${n#n}
        mapfile -t args < <(train_args "$n" "$par" "$backend" "$SCRATCH/$run")
        TT_TARGET=$TT_TARGET MOEBLAZE_REPO=$repo TT_FLAVOR=$FLAVOR TT_FLAVOR_BASE=$FLAVOR_BASE \
            TT_FLAVOR_OVERRIDES=$FLAVOR_OVERRIDES "$PYTHON" - "$run" "${args[@]}" <<'PY'
import os, site, sys
site.addsitedir(os.environ["TT_TARGET"])
sys.path.insert(0, os.path.join(os.environ["MOEBLAZE_REPO"], "benchmarks"))
import scaling_device
scaling_device.register_flavor_in_rank()
from torchtitan.config import ConfigManager
from torchtitan.models.qwen3 import qwen3_args
c = ConfigManager().parse_args(sys.argv[2:])
m = qwen3_args[c.model.flavor]
p = c.parallelism
print(f"  {sys.argv[1]:22s} backend={c.compile.backend} fsdp={p.data_parallel_shard_degree} "
      f"ep={p.expert_parallel_degree}:{p.expert_parallel_comm_backend} seq_len={c.training.seq_len} "
      f"local_batch={c.training.local_batch_size} steps={c.training.steps} profile={c.profiling.enable_profiling} | "
      f"{c.model.flavor}: layers={m.n_layers} d={m.dim} heads={m.n_heads}/{m.n_kv_heads}x{m.head_dim} "
      f"experts={m.moe_args.num_experts} top_k={m.moe_args.top_k} moe_inter_dim={m.moe_inter_dim} "
      f"vocab={m.vocab_size} max_seq_len={m.max_seq_len}")
PY
    done
    ;;
table)
    table
    ;;
run)
    t_start=$SECONDS
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    ngpu_here=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
    ((ngpu_here >= 1)) || die "no CUDA device here: this benchmark trains on GPUs"
    install_wheels
    modules_check || die "torchtitan's needs are missing (above): install them, or put their wheels in WHL_DIR" \
        "(see bash benchmarks/torchtitan_device.sh --help)"
    make_data "$SCRATCH/data"
    write_env
    echo "moeblaze-fx at $MOEBLAZE_COMMIT, $(date -u +%F), ${#runs[@]} runs, budget $BUDGET s"
    status=0
    for run in "${runs[@]}"; do
        run_one "$run" || status=1
        table >/dev/null || { echo "error: the table could not be built (above)" >&2; status=1; }
    done
    table
    exit $status
    ;;
esac
