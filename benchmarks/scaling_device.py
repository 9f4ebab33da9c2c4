"""The scaling benchmark's Python half (issue 41, point 4): what benchmarks/scaling_device.sh runs in every rank
before torchtitan's trainer (an extra model flavor), and what it runs after the trainings (the table).

  python benchmarks/scaling_device.py env OUTDIR --commit C --tokens-per-gpu N ...   # OUTDIR/env.json
  python benchmarks/scaling_device.py table OUTDIR                                   # OUTDIR/scaling.{json,md}

Each run lives in OUTDIR/<run>/: meta.json (written by the shell script: GPUs, parallelism, backend, exit status,
seconds, the timed steps), train.log (every rank's output, each line behind torchrun's "[rank<R>]:" prefix) and, for
moeblaze runs, moeblaze_report_rank<R>.json; the profile trace of the last step is SCRATCH/<run>/profile_traces.

tokens/s per GPU is torchtitan's own "tps" (tokens of the rank over the step's wall time, divided by the
non-data-parallel degree, which is 1 here: FSDP and EP both count as data parallel): the median over the timed steps
on each rank, then the mean over the ranks. Peak memory per GPU is torchtitan's "memory" (the caching allocator's
peak reserved GiB since the last log): the largest over the timed steps and the ranks. This file imports only the
standard library (torch for `env`; torchtitan's model table only in `register_flavor_in_rank`, inside a rank), so
its tests run without a GPU or torchtitan.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import math
import os
import re
import statistics
import sys

# torchtitan 0.2.2's metrics line (components/metrics.py, `MetricsProcessor.log`), behind its logging prefix
# "[titan] <time> - root - INFO - " and torchrun's "[rank<R>]:"; colors off (--metrics.disable_color_printing),
# and stripped here in case they are on.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RANK = re.compile(r"^\[(?:rank|default)?(\d+)\]:")
_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+0-9.eE]+|nan|inf)\s+.*?"
    r"memory:\s*(?P<mem>[0-9.]+)GiB\((?P<pct>[0-9.]+)%\)\s+tps:\s*(?P<tps>[0-9,]+)"
)
# An exception's last line in a rank's traceback ("[rank1]: RuntimeError: ..."); torchrun's own summary
# (ChildFailedError and its table) names no cause and is skipped.
_ERROR = re.compile(r"^(?:\[(?:rank)?\d+\]:)?\s*(?:[\w.]+\.)?"
                    r"(?P<name>\w*(?:Error|Exception|Interrupt|Failed))\b:?(?P<msg>.*)$")
_NOT_A_CAUSE = ("ChildFailedError",)


def parse_train_log(text: str) -> dict[int, dict[int, dict[str, float]]]:
    """{rank: {step: {"loss", "memory_gib", "tps"}}} from torchtitan's metrics lines; a line without a rank prefix
    (one process, no torchrun) counts as rank 0."""
    runs: dict[int, dict[int, dict[str, float]]] = {}
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        m = _STEP.search(line)
        if not m:
            continue
        r = _RANK.match(line)
        rank = int(r.group(1)) if r else 0
        runs.setdefault(rank, {})[int(m.group("step"))] = {
            "loss": float(m.group("loss")),
            "memory_gib": float(m.group("mem")),
            "tps": float(m.group("tps").replace(",", "")),
        }
    return runs


def last_error(text: str) -> str | None:
    """The last exception line any rank printed, or None."""
    found = None
    for raw in text.splitlines():
        line = _ANSI.sub("", raw).rstrip()
        m = _ERROR.match(line)
        if m and m.group("name") not in _NOT_A_CAUSE and not line.lstrip().startswith(("File ", "raise ")):
            found = _RANK.sub("", line).strip()
    return found


def operator_calls(trace_root: str) -> dict[int, int]:
    """moeblaze::moe_ffn forward events per rank in the last profiled iteration under trace_root (torchtitan's
    profile_traces folder); host-side events only (a kernel never carries the operator's name)."""
    calls: dict[int, int] = {}
    traces = glob.glob(os.path.join(trace_root, "iteration_*", "**", "rank*_trace.json"), recursive=True)
    traces.sort(key=lambda p: int(re.search(r"iteration_(\d+)", p).group(1)))
    for path in traces:  # the last iteration wins
        rank = int(re.search(r"rank(\d+)_trace", path).group(1))
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
        calls[rank] = sum(1 for e in events if e.get("name") == "moeblaze::moe_ffn"
                          and e.get("cat") not in ("kernel", "cuda_runtime", "gpu_memcpy", "gpu_memset"))
    return calls


def report_regions(run_dir: str) -> dict[int, dict]:
    """{rank: {"graphs", "rewritten", "skipped": [reasons]}} from the moeblaze report files of a run."""
    per_rank = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "moeblaze_report_rank*.json"))):
        rank = int(re.search(r"rank(\d+)\.json$", path).group(1))
        with open(path) as f:
            graphs = json.load(f)
        regions = [r for g in graphs for r in g["regions"]]
        per_rank[rank] = {
            "graphs": len(graphs),
            "rewritten": sum(r["status"] == "rewritten" for r in regions),
            "skipped": [f"{r.get('source')}: {r.get('reason')}" for r in regions if r["status"] != "rewritten"],
        }
    return per_rank


def summarize_run(meta: dict, log_text: str, calls: dict[int, int], regions: dict[int, dict]) -> dict:
    """One row of the table from one run's meta.json, log, operator counts and report."""
    row = {k: meta[k] for k in ("run", "ngpu", "parallelism", "backend")}
    row.update(rc=meta.get("rc"), seconds=meta.get("seconds"), tps=None, memory_gib=None, timed_steps=[],
               operator_every_block=None, operator_calls=calls, regions=regions, error=None)
    lo, hi = meta["timed_from"], meta["timed_to"]
    per_rank = parse_train_log(log_text)
    medians, peaks = [], []
    for rank in sorted(per_rank):
        steps = {s: v for s, v in per_rank[rank].items() if lo <= s <= hi}
        if steps:
            medians.append(statistics.median(v["tps"] for v in steps.values()))
            peaks.append(max(v["memory_gib"] for v in steps.values()))
    complete = len(per_rank) == meta["ngpu"] and all(
        all(s in per_rank[r] for s in range(lo, hi + 1)) for r in per_rank)
    if meta.get("rc") == 0 and complete:
        row["status"] = "ok"
    elif meta.get("rc") is None:
        row["status"] = "not run"
        row["error"] = meta.get("why")
    else:
        row["status"] = "failed"
        why = f"exit {meta.get('rc')}" + (" (timed out)" if meta.get("rc") in (124, 137) else "")
        if meta.get("rc") == 0:
            why = f"steps {lo}..{hi} missing on some rank ({len(per_rank)} of {meta['ngpu']} ranks logged)"
        err = last_error(log_text)
        row["error"] = f"{why}: {err}" if err else why
    if medians:  # a failed run that got far enough still shows what it measured
        row["tps"] = sum(medians) / len(medians)
        row["memory_gib"] = max(peaks)
        row["timed_steps"] = [lo, hi]
    if meta["backend"] == "moeblaze" and row["status"] != "not run":
        moe_blocks = meta["moe_blocks"]
        row["operator_every_block"] = (len(calls) == meta["ngpu"]
                                       and all(n == moe_blocks for n in calls.values()))
    return row


def add_ratios(rows: list[dict]) -> list[dict]:
    """moeblaze / inductor at the same GPUs and parallelism; scaling efficiency: tokens/s per GPU at N over the
    1-GPU run of the same backend (one GPU has no sharding and no expert parallelism)."""
    by_key = {(r["ngpu"], r["parallelism"], r["backend"]): r for r in rows}
    for r in rows:
        peer = by_key.get((r["ngpu"], r["parallelism"], "inductor"))
        r["vs_inductor"] = (r["tps"] / peer["tps"] if r["backend"] == "moeblaze" and r["tps"] and peer
                            and peer["tps"] else None)
        one = by_key.get((1, "fsdp", r["backend"]))
        r["scaling_efficiency"] = r["tps"] / one["tps"] if r["tps"] and one and one["tps"] else None
    return rows


def _fmt(x, spec):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


PARALLELISM_NAMES = {"fsdp": "FSDP2", "fsdp-ep": "FSDP2 + EP"}


def markdown(rows: list[dict], env: dict) -> str:
    head = (f"torchtitan {env.get('torchtitan', '0.2.2')} {env.get('flavor')}"
            f"{' (' + env['flavor_overrides'] + ')' if env.get('flavor_overrides') else ''}, "
            f"{env.get('tokens_per_gpu')} tokens per GPU (seq {env.get('seq_len')} x {env.get('local_batch')}), "
            f"{env.get('steps')} steps, tokens/s per GPU = median of steps "
            f"{env.get('timed_from')}..{env.get('timed_to')}; "
            f"{env.get('device')}, torch {env.get('torch')}, triton {env.get('triton')}, {env.get('date')}, "
            f"commit {env.get('commit')}")
    lines = [head, "",
             "| GPUs | parallelism | backend | tokens/s per GPU | peak GiB per GPU | moeblaze / inductor "
             "| scaling efficiency | operator in every MoE block | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        par = PARALLELISM_NAMES.get(r["parallelism"], r["parallelism"])
        if r["ngpu"] == 1:
            par += " (1 GPU: none)"
        op = "—" if r["operator_every_block"] is None else ("yes" if r["operator_every_block"] else
                                                            f"no {dict(sorted(r['operator_calls'].items()))}")
        status = r["status"] if not r["error"] else f"{r['status']}: {r['error']}"
        status = status.replace("|", "\\|")
        lines.append(f"| {r['ngpu']} | {par} | {r['backend']} | {_fmt(r['tps'], ',.0f')} | "
                     f"{_fmt(r['memory_gib'], '.2f')} | {_fmt(r['vs_inductor'], '.3f')} | "
                     f"{_fmt(r['scaling_efficiency'], '.3f')} | {op} | {status} |")
    return "\n".join(lines) + "\n"


_ORDER = {"fsdp": 0, "fsdp-ep": 1}


def build_table(out: str) -> tuple[list[dict], dict]:
    env_path = os.path.join(out, "env.json")
    if not os.path.exists(env_path):
        raise SystemExit(f"error: {env_path} is missing: {out} holds no runs of this benchmark (run "
                         f"`bash benchmarks/scaling_device.sh {out}` first; --table only rebuilds the table)")
    with open(env_path) as f:
        env = json.load(f)
    rows = []
    for meta_path in glob.glob(os.path.join(out, "*", "meta.json")):
        with open(meta_path) as f:
            meta = json.load(f)
        run_dir = os.path.dirname(meta_path)
        log_path = os.path.join(run_dir, "train.log")
        text = open(log_path, errors="replace").read() if os.path.exists(log_path) else ""
        calls = operator_calls(os.path.join(env["scratch"], meta["run"], "profile_traces"))
        rows.append(summarize_run(meta, text, calls, report_regions(run_dir)))
    rows.sort(key=lambda r: (r["ngpu"], _ORDER.get(r["parallelism"], 9), r["backend"] != "inductor", r["backend"]))
    add_ratios(rows)
    with open(os.path.join(out, "scaling.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1, default=str)
    with open(os.path.join(out, "scaling.md"), "w") as f:
        f.write(markdown(rows, env))
    return rows, env


# ---- an extra model flavor, registered in every rank before torchtitan's trainer reads its model table ----

def parse_overrides(spec: str) -> dict[str, str]:
    """"dim=1024,moe_args.num_experts=32" -> {"dim": "1024", "moe_args.num_experts": "32"}."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"FLAVOR_OVERRIDES item {item!r} is not key=value: write e.g. "
                             f"'dim=1024,moe_inter_dim=512,moe_args.num_experts=64'")
        out[key.strip()] = value.strip()
    return out


def _convert(old, value: str):
    if isinstance(old, bool):
        if value not in ("true", "false", "True", "False", "1", "0"):
            raise ValueError(f"{value!r} is not a boolean (true or false)")
        return value in ("true", "True", "1")
    return type(old)(value)


def derive_flavor(base, overrides: dict[str, str]):
    """A copy of the dataclass `base` (torchtitan's model args) with fields replaced; "moe_args.x" replaces a field
    of its nested moe_args."""
    top, nested = {}, {}
    for key, value in overrides.items():
        owner, _, field = key.rpartition(".")
        target = getattr(base, owner, None) if owner else base
        if owner not in ("", "moe_args") or not dataclasses.is_dataclass(target) or not hasattr(target, field):
            names = [f.name for f in dataclasses.fields(base)]
            raise ValueError(f"FLAVOR_OVERRIDES: {key!r} is not a field of {type(base).__name__} (fields: "
                             f"{', '.join(names)}; moe_args.<field> for the MoE's)")
        (nested if owner else top)[field] = _convert(getattr(target, field), value)
    if nested:
        top["moe_args"] = dataclasses.replace(base.moe_args, **nested)
    return dataclasses.replace(base, **top)


def expected_moe_blocks(default_layers: int, overrides: dict[str, str]) -> int:
    """Every block of torchtitan's Qwen3 is a MoE block when moe_enabled: the flavor's layer count."""
    return int(overrides.get("n_layers", default_layers))


def register_flavor(table: dict, name: str, base: str, spec: str) -> None:
    """table[name] = table[base] with the overrides of spec; an existing flavor is never replaced."""
    if name in table:
        if spec:
            raise ValueError(f"FLAVOR={name} is one of torchtitan's own flavors: give the derived flavor a new name "
                             f"(e.g. FLAVOR={base}_x) or leave FLAVOR_OVERRIDES empty")
        return
    if base not in table:
        raise ValueError(f"FLAVOR_BASE={base} is not a flavor of this model (flavors: {', '.join(sorted(table))})")
    table[name] = derive_flavor(table[base], parse_overrides(spec))


def register_flavor_in_rank() -> None:  # the launcher's prelude: torchtitan is importable there
    flavor = os.environ.get("TT_FLAVOR", "")
    if flavor:
        from torchtitan.models.qwen3 import qwen3_args
        register_flavor(qwen3_args, flavor, os.environ["TT_FLAVOR_BASE"], os.environ.get("TT_FLAVOR_OVERRIDES", ""))


# ---- command line ----

def _env(args) -> None:
    env = {k: getattr(args, k) for k in ("commit", "tokens_per_gpu", "seq_len", "local_batch", "steps", "timed_from",
                                          "timed_to", "flavor", "flavor_overrides", "scratch", "torchtitan")}
    env["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    try:
        import torch
        env["torch"] = torch.__version__
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        env["device"] = f"{n} x {torch.cuda.get_device_name(0)}" if n else "no CUDA device"
    except ImportError:
        env["torch"], env["device"] = None, "no torch"
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    with open(os.path.join(args.out, "env.json"), "w") as f:
        json.dump(env, f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env", help="write OUTDIR/env.json (device, versions, date, commit, settings)")
    e.add_argument("out")
    for name, typ in (("commit", str), ("tokens-per-gpu", int), ("seq-len", int), ("local-batch", int),
                      ("steps", int), ("timed-from", int), ("timed-to", int), ("flavor", str),
                      ("flavor-overrides", str), ("scratch", str), ("torchtitan", str)):
        e.add_argument(f"--{name}", type=typ, required=True)
    t = sub.add_parser("table", help="OUTDIR/scaling.{json,md} from the runs under OUTDIR")
    t.add_argument("out")
    b = sub.add_parser("moe-blocks", help="the MoE blocks the flavor has (the layers of a derived one)")
    b.add_argument("--default", type=int, required=True)
    b.add_argument("--overrides", default="")
    args = p.parse_args(argv)
    if args.cmd == "env":
        _env(args)
    elif args.cmd == "table":
        rows, env = build_table(args.out)
        print(markdown(rows, env), end="")
    else:
        print(expected_moe_blocks(args.default, parse_overrides(args.overrides)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
