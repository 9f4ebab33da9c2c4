#!/usr/bin/env bash
# torchtitan's trainer with `--compile.backend moeblaze` against its default backend (Inductor), on NGPU GPUs with FSDP2
# (issue 41, point 2). One command trains torchtitan's Qwen3-MoE debug model (8 blocks, d=256, 64 experts, top-8)
# twice from the same seed, 50 steps each, every block compiled as torchtitan compiles it, then prints the losses
# step by step, their largest difference, and how many MoE blocks ran the moeblaze operator.
#
#   NGPU=2 bash benchmarks/torchtitan_device.sh OUTDIR           # or NGPU=4
#   bash benchmarks/torchtitan_device.sh --check                  # which of torchtitan's needs are missing here
#   bash benchmarks/torchtitan_device.sh --dry-run OUTDIR         # install, data, parse both configs; no training
#   bash benchmarks/torchtitan_device.sh --compare OUTDIR         # only the comparison, on OUTDIR's logs
#
# Which torchtitan: 0.2.2. torchtitan 0.3.0 does not import on torch 2.11 (`from torch.distributed.fsdp import
# DataParallelMeshDims`, also `_fsdp_common.ShardPlacementResult`: both newer than 2.11); 0.2.2 imports and runs on it.
# 0.2.2 compiles a MoE block's children one by one (router, norms, attention) and the grouped-product expert
# function `_run_experts_grouped_mm` on its own, so the graph the backend sees holds only the local expert
# computation over rows already grouped by expert, with counts; the routing and the combine run eagerly.
#
# Needs, beside this checkout: torch with CUDA, triton, torchtitan 0.2.2 and its Python dependencies (with a network:
# `pip install torchtitan==0.2.2 tyro torchdata datasets tensorboard`) and its test tokenizer. A machine without a
# network takes them as wheel files (cp312, manylinux) in WHL_DIR (default .whl/torchtitan: base/, pandas/,
# assets/tokenizer/) and PYARROW_DIR (default .whl/torchtitan_pyarrow, only where pyarrow is missing), installed
# into TT_TARGET with `pip install --no-index --no-deps --target` and put on sys.path *after* the machine's own
# site-packages (site.addsitedir), so a package the machine has is never shadowed. The tokenizer is torchtitan's
# test tokenizer (its repository's tests/assets/tokenizer at v0.2.2), read from WHL_DIR/assets/tokenizer; the text is
# generated here from a fixed seed (torchtitan's c4_test file is not in its wheel), in c4_test's format.
#
# Settings (environment): NGPU (2 or 4, default 2), STEPS (50), SEQ_LEN (2048), LOCAL_BATCH (4 sequences per GPU),
# SEED (42), DETERMINISTIC (1: --debug.deterministic --debug.deterministic_warn_only), EP (1: FSDP2 alone; NGPU:
# FSDP2 + expert parallelism over every GPU, --parallelism.expert_parallel_degree NGPU), TOL_LOSS (2e-2: largest
# allowed |loss difference| at any step), MOE_BLOCKS (8: MoE blocks of the debug model), PYTHON (python3),
# WHL_DIR, PYARROW_DIR, TT_TARGET (/tmp/tt), SCRATCH (/tmp/tt_run: the text, the datasets cache, torchtitan's dump
# folders with the profile traces, kept out of OUTDIR for their size), MOEBLAZE_OPTIONS (passed on; the script adds
# a per-rank report path). Writes OUTDIR/<run>/train.log (rank 0), OUTDIR/<run>/loss.tsv,
# OUTDIR/<run>/moeblaze_report_rank<R>.json and OUTDIR/compare.txt, with <run> = inductor, moeblaze; the traces
# are SCRATCH/<run>/profile_traces/iteration_<STEPS>/rank<R>_trace.json. Exit status: 0 if the losses agree within
# TOL_LOSS and every rank ran the operator in every MoE block; 1 if not; 2 if a run failed or could not start.
# Sized for well under 5 minutes on 2 or 4 H100s (8192 tokens per GPU a step); not yet timed there.
set -euo pipefail

# The part benchmarks/scaling_device.sh sources (it ends at the `return` below): where torchtitan's wheels, its
# tokenizer and the scratch space are, and the functions that check and install its needs, make the text and launch
# its trainer in every rank.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
WHL_DIR=${WHL_DIR:-$repo/.whl/torchtitan}
PYARROW_DIR=${PYARROW_DIR:-$repo/.whl/torchtitan_pyarrow}
TT_TARGET=${TT_TARGET:-/tmp/tt}
SCRATCH=${SCRATCH:-/tmp/tt_run}
TT_VERSION=0.2.2
export PYTHONUNBUFFERED=1
export HF_DATASETS_CACHE=${HF_DATASETS_CACHE:-$SCRATCH/hf_datasets_cache}

# The Python modules torchtitan 0.2.2's trainer imports that a plain torch environment may lack, each with the
# statement that proves it usable (tensorboard's generated code needs protobuf >= 6).
modules_check() {
    "$PYTHON" - "$TT_TARGET" <<'PY'
import importlib, site, sys
site.addsitedir(sys.argv[1])  # after the machine's own site-packages
checks = {
    "torch (CUDA)": "import torch; assert torch.cuda.is_available(), 'no CUDA device'",
    "triton": "import triton",
    "torchtitan 0.2.2": "import torchtitan.train, importlib.metadata as m; v = m.version('torchtitan'); assert v == '0.2.2', v",
    "tyro": "import tyro", "typeguard": "import typeguard", "docstring_parser": "import docstring_parser", "torchdata": "import torchdata",
    "tokenizers": "import tokenizers", "safetensors": "import safetensors",
    "protobuf>=6": "import google.protobuf as p; assert int(p.__version__.split('.')[0]) >= 6, p.__version__",
    "tensorboard": "from torch.utils.tensorboard import SummaryWriter",
    "absl-py": "import absl", "pyarrow": "import pyarrow", "pandas": "import pandas",
    "datasets": "import datasets", "dill": "import dill", "multiprocess": "import multiprocess",
    "xxhash": "import xxhash", "requests": "import requests", "fsspec": "import fsspec",
}
missing = []
for name, stmt in checks.items():
    try:
        exec(stmt, {})
        top = stmt.split()[1].split(".")[0].replace(",", "")
        mod = sys.modules.get(top)
        where = getattr(mod, "__file__", None) or ""
        print(f"  ok       {name:18s} {getattr(mod, '__version__', ''):12s} {where}")
    except Exception as e:  # noqa: BLE001 - report every failure the same way
        missing.append(name)
        print(f"  MISSING  {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
print("missing:", ", ".join(missing) if missing else "none")
sys.exit(1 if missing else 0)
PY
}

# Installs the wheels of WHL_DIR whose module the machine lacks (a machine's own package always wins: see above).
install_wheels() {
    mkdir -p "$TT_TARGET"
    local whl=() f
    for f in "$WHL_DIR"/base/*.whl "$WHL_DIR"/pandas/*.whl "$PYARROW_DIR"/*.whl; do
        [[ -f $f ]] && whl+=("$f")
    done
    if ((${#whl[@]} == 0)); then
        echo "note: no wheels in $WHL_DIR/{base,pandas} or $PYARROW_DIR: using what the machine has"
        return
    fi
    # One wheel per distribution: pip refuses two versions at once.
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TT_TARGET" \
            "${whl[@]}" >"$TT_TARGET.pip.log" 2>&1; then
        cat "$TT_TARGET.pip.log"
        echo "error: pip could not install the wheels of $WHL_DIR into $TT_TARGET (above)" >&2
        exit 2
    fi
    echo "installed ${#whl[@]} wheels into $TT_TARGET (searched after the machine's site-packages)"
}

# c4_test's format (one JSON object a line with a "text" field), from a fixed seed: the same text on every machine.
make_data() {
    local dir=$1
    mkdir -p "$dir"
    "$PYTHON" - "$dir/data.json" <<'PY'
import json, random, sys
rng = random.Random(20261127)
words = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an had "
         "they you were their one all we can her has there been if more when will would who so no expert token model "
         "layer weight train step loss graph kernel memory device rank shard gather reduce scatter route gate sum "
         "matrix vector tensor value order group block split count offset index batch sequence attention norm").split()
with open(sys.argv[1], "w") as f:
    for _ in range(4000):
        sentences = []
        for _ in range(rng.randint(4, 24)):
            n = rng.randint(5, 18)
            sentences.append(" ".join(rng.choice(words) for _ in range(n)).capitalize() + ".")
        f.write(json.dumps({"text": " ".join(sentences)}) + "\n")
PY
}

# Runs in every rank: torchtitan found after the machine's site-packages, moeblaze registered as a backend where
# its entry point is not installed, a per-rank report file, then torchtitan's own entry point.
LAUNCH='
import os, runpy, site, sys
site.addsitedir(os.environ["TT_TARGET"])
sys.path.insert(0, os.environ["MOEBLAZE_REPO"])
if os.environ.get("MOEBLAZE_REPORT_DIR"):
    rep = "report=" + os.path.join(os.environ["MOEBLAZE_REPORT_DIR"], "moeblaze_report_rank%s.json" % os.environ["RANK"])
    os.environ["MOEBLAZE_OPTIONS"] = ";".join(x for x in (os.environ.get("MOEBLAZE_OPTIONS", ""), rep) if x)
import torch._dynamo
if "moeblaze" not in torch._dynamo.list_backends(exclude_tags=()):
    from moeblaze_fx.backend import moeblaze_backend
    torch._dynamo.register_backend(moeblaze_backend, name="moeblaze")
sys.argv = ["torchtitan.train"] + sys.argv[1:]
runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
'

[[ ${BASH_SOURCE[0]} == "$0" ]] || return 0  # sourced: the definitions above only

mode=train
case "${1:-}" in
    --check) mode=check; shift ;;
    --dry-run) mode=dry-run; shift ;;
    --compare) mode=compare; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
if [[ $mode != check ]]; then
    out=${1:?"usage: bash benchmarks/torchtitan_device.sh [--check|--dry-run|--compare] OUTDIR (see --help)"}
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
fi

cd "$repo"
NGPU=${NGPU:-2}
STEPS=${STEPS:-50}
SEQ_LEN=${SEQ_LEN:-2048}
LOCAL_BATCH=${LOCAL_BATCH:-4}
SEED=${SEED:-42}
DETERMINISTIC=${DETERMINISTIC:-1}
EP=${EP:-1}
TOL_LOSS=${TOL_LOSS:-2e-2}
MOE_BLOCKS=${MOE_BLOCKS:-8}

for v in NGPU STEPS SEQ_LEN LOCAL_BATCH SEED MOE_BLOCKS EP; do
    [[ ${!v} =~ ^[0-9]+$ ]] || { echo "error: $v=${!v} is not a whole number" >&2; exit 2; }
done
[[ $NGPU == 2 || $NGPU == 4 ]] || { echo "error: NGPU=$NGPU: this benchmark runs on 2 or 4 GPUs (set NGPU=2 or NGPU=4)" >&2; exit 2; }
(( STEPS >= 2 )) || { echo "error: STEPS=$STEPS: at least 2 (the operator is counted in the last step's profile)" >&2; exit 2; }
[[ $DETERMINISTIC == 0 || $DETERMINISTIC == 1 ]] || { echo "error: DETERMINISTIC=$DETERMINISTIC: 0 or 1" >&2; exit 2; }
[[ $EP == 1 || $EP == "$NGPU" ]] || { echo "error: EP=$EP: 1 (FSDP2 alone) or NGPU=$NGPU (experts over every GPU)" >&2; exit 2; }

# torchtitan's own command line for one run (backend = inductor or moeblaze).
train_args() {
    local backend=$1 dump=$2
    local args=(
        --model.name qwen3 --model.flavor debugmodel_moe --model.hf_assets_path "$WHL_DIR/assets/tokenizer"
        --training.dataset c4_test --training.dataset_path "$SCRATCH/data"
        --training.steps "$STEPS" --training.seq_len "$SEQ_LEN" --training.local_batch_size "$LOCAL_BATCH"
        --parallelism.data_parallel_shard_degree "$NGPU"
        --compile.enable --compile.components model --compile.backend "$backend"
        --activation_checkpoint.mode none
        --lr_scheduler.warmup_steps 2
        --metrics.log_freq 1 --metrics.disable_color_printing
        --profiling.enable_profiling --profiling.profile_freq "$STEPS" --profiling.profiler_warmup 1
        --profiling.profiler_active 1
        --debug.seed "$SEED"
        --job.dump_folder "$dump"
    )
    if [[ $DETERMINISTIC == 1 ]]; then args+=(--debug.deterministic --debug.deterministic_warn_only); fi
    if ((EP > 1)); then args+=(--parallelism.expert_parallel_degree "$EP"); fi
    printf '%s\n' "${args[@]}"
}

parse_config() {  # the job config torchtitan parses from these arguments, or its error
    local backend=$1
    mapfile -t args < <(train_args "$backend" "$SCRATCH/$backend")
    TT_TARGET=$TT_TARGET "$PYTHON" - "${args[@]}" <<'PY'
import os, site, sys
site.addsitedir(os.environ["TT_TARGET"])
from torchtitan.config import ConfigManager
c = ConfigManager().parse_args(sys.argv[1:])
print(f"  {c.compile.backend:9s} model={c.model.name}/{c.model.flavor} steps={c.training.steps} "
      f"seq_len={c.training.seq_len} local_batch={c.training.local_batch_size} "
      f"fsdp={c.parallelism.data_parallel_shard_degree} ep={c.parallelism.expert_parallel_degree} compile={c.compile.enable}:{','.join(c.compile.components)} "
      f"ac={c.activation_checkpoint.mode} deterministic={c.debug.deterministic} seed={c.debug.seed} "
      f"profile_freq={c.profiling.profile_freq} dataset={c.training.dataset}:{c.training.dataset_path}")
PY
}

run_one() {
    local backend=$1 dir=$out/$1
    rm -rf "$dir" "${SCRATCH:?}/$backend"; mkdir -p "$dir"
    mapfile -t args < <(train_args "$backend" "$SCRATCH/$backend")
    echo "== $backend: torchrun --nproc_per_node=$NGPU torchtitan.train ${args[*]}"
    local t0=$SECONDS rc=0 report_dir=""
    if [[ $backend == moeblaze ]]; then report_dir=$dir; fi
    TT_TARGET=$TT_TARGET MOEBLAZE_REPO=$repo MOEBLAZE_REPORT_DIR=$report_dir \
        "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
        --local-ranks-filter 0 --role rank --tee 3 \
        --no-python "$PYTHON" -c "$LAUNCH" "${args[@]}" >"$dir/train.log" 2>&1 || rc=$?
    echo "   $backend: exit $rc after $((SECONDS - t0)) s (log: $dir/train.log)"
    if ((rc != 0)); then tail -n 40 "$dir/train.log"; fi
    return $rc
}

compare() {
    "$PYTHON" - "$out" "$TOL_LOSS" "$MOE_BLOCKS" "$STEPS" "$SCRATCH" "$repo/benchmarks" <<'PY' | tee "$out/compare.txt"
import math, os, re, sys

out, tol, moe_blocks, steps, scratch = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
sys.path.insert(0, sys.argv[6])
from scaling_device import operator_calls, report_regions  # the trace and report readers the scaling table uses
# torchtitan's metrics line: "step:  7  loss:  6.12345  grad_norm: ...", possibly behind a "[rank0]:" prefix
STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+0-9.eE]+|nan|inf)")


def losses(run):
    path = os.path.join(out, run, "train.log")
    if not os.path.exists(path):
        sys.exit(f"error: {path} is missing: run the training first (this script without --compare)")
    found = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = STEP.search(line)
            if m:
                found[int(m.group(1))] = float(m.group(2))
    with open(os.path.join(out, run, "loss.tsv"), "w") as f:
        f.write("step\tloss\n" + "".join(f"{s}\t{v!r}\n" for s, v in sorted(found.items())))
    return found


base, mine = losses("inductor"), losses("moeblaze")
common = sorted(set(base) & set(mine))
print(f"{'step':>4}  {'inductor':>10}  {'moeblaze':>10}  {'|diff|':>9}")
worst = 0.0
for s in common:
    d = abs(base[s] - mine[s])
    worst = max(worst, d) if not math.isnan(d) else math.inf
    print(f"{s:4d}  {base[s]:10.5f}  {mine[s]:10.5f}  {d:9.2e}")
ok_steps = len(common) == steps and len(base) == steps and len(mine) == steps
ok_loss = ok_steps and worst <= tol
print(f"losses: {len(common)} common steps of {steps} (inductor {len(base)}, moeblaze {len(mine)}); "
      f"max |diff| = {worst:.3e}, tolerance {tol:g}: {'PASS' if ok_loss else 'FAIL'}")

calls = operator_calls(os.path.join(scratch, "moeblaze", "profile_traces"))
rep = report_regions(os.path.join(out, "moeblaze"))
base_calls = operator_calls(os.path.join(scratch, "inductor", "profile_traces"))
ok_ops = bool(calls) and all(n == moe_blocks for n in calls.values())
for rank in sorted(set(calls) | set(rep)):
    n = calls.get(rank)
    r = rep.get(rank, {"graphs": 0, "rewritten": 0, "skipped": []})
    rewritten, skipped, graphs = r["rewritten"], r["skipped"], r["graphs"]
    print(f"moeblaze rank {rank}: operator calls in the last step's forward: "
          f"{'no trace' if n is None else n} of {moe_blocks} MoE blocks; report: {graphs} compiled graph(s), "
          f"{rewritten} region(s) rewritten, {len(skipped)} skipped")
    for reason in skipped:
        print(f"    skipped: {reason}")
if not calls:
    print("moeblaze: no profile trace found: the operator calls were not counted")
if any(base_calls.values()):
    print(f"error: the inductor run shows moeblaze operator calls {base_calls}: the runs were mixed up")
    ok_ops = False
print(f"every MoE block ran the moeblaze operator on every rank: {'PASS' if ok_ops else 'FAIL'}")
sys.exit(0 if ok_loss and ok_ops else 1)
PY
}

case $mode in
check)
    echo "== what torchtitan $TT_VERSION needs (TT_TARGET=$TT_TARGET after the machine's own packages)"
    modules_check
    ;;
dry-run)
    install_wheels
    modules_check || echo "note: modules missing (above): a training run would fail"
    make_data "$SCRATCH/data"
    echo "== the job configs torchtitan parses"
    parse_config inductor
    parse_config moeblaze
    ;;
compare)
    compare
    ;;
train)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda devices', torch.cuda.device_count())"
    ngpu_here=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
    ((ngpu_here >= NGPU)) || { echo "error: NGPU=$NGPU but this machine has $ngpu_here CUDA device(s)" >&2; exit 2; }
    install_wheels
    modules_check || { echo "error: torchtitan's needs are missing (above): install them, or put their wheels in WHL_DIR (see --help)" >&2; exit 2; }
    make_data "$SCRATCH/data"
    echo "moeblaze-fx at $(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown), $(date -u +%F)"
    run_one inductor || exit 2
    run_one moeblaze || exit 2
    compare
    ;;
esac
