"""``compare``: one model before and after, eager vs default ``torch.compile`` vs ``backend="moeblaze"``.

For each variant (``eager``, ``inductor``, ``moeblaze-<policy>`` per memory policy) on the same module,
the same inputs and the same random seed::

    warm-up step (compiles; its gradients are the ones compared), then `steps` timed training steps
    (grads reset, forward, loss, backward; no optimizer step, so the parameters never change)

and per variant: the loss and its relative difference from eager, the largest relative gradient error
``||g - g_eager|| / ||g_eager||`` over the parameters (and inputs that require grad), the median step
time, the activation bytes saved for backward during one forward (``saved_tensors_hooks``: distinct
storages, parameters excluded, inputs included), the peak allocation above the step's start on a GPU,
and for the moeblaze variants the compile report (``moeblaze_fx`` region records, captured right after
the compile). Dynamo is reset between variants.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from .. import report as _report
from .layer import free_memory, is_oom, saved_activation_bytes, timer_label
from .results import JsonResult, mb_cell, number_cell
from .timing import StepTimes, spread_note, wall_step_times

__all__ = ["CompareRow", "CompareResult", "compare", "default_loss", "format_compare_table",
           "check_plot_requirements"]


@dataclasses.dataclass
class CompareRow:
    variant: str
    status: str = "ok"  # "ok", "out of memory" or "error"
    loss: Optional[float] = None
    loss_rel_diff: Optional[float] = None  # |loss - loss_eager| / |loss_eager|
    max_grad_rel_err: Optional[float] = None
    worst_grad: Optional[str] = None  # the parameter or input with the largest gradient error
    step_ms: Optional[float] = None  # median over the timed steps
    step_times_ms: Optional[list[float]] = None  # every timed step
    steps_timed: Optional[int] = None
    step_spread: Optional[float] = None  # (max - min) / median of the timed steps
    wide_spread: Optional[bool] = None  # step_spread > timing.WIDE_SPREAD: the cell is marked, the table says so
    first_step_s: Optional[float] = None  # the warm-up step, compile included
    saved_bytes: Optional[int] = None
    peak_bytes: Optional[int] = None  # CUDA only
    regions_rewritten: Optional[int] = None  # moeblaze variants: from the compile report
    regions_found: Optional[int] = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CompareResult(JsonResult):
    rows: list[CompareRow]
    reports: dict[str, list[dict[str, Any]]]  # variant -> compile-report records (RegionRecord.as_dict())
    meta: dict[str, Any]
    plot_path: Optional[str] = None
    plot_error: Optional[str] = None  # why the plot was not written (the results stand without it)

    def row(self, variant: str) -> CompareRow:
        for r in self.rows:
            if r.variant == variant:
                return r
        raise KeyError(f"no variant {variant!r}; variants: {[r.variant for r in self.rows]}")

    def table(self) -> str:
        return format_compare_table(self)

    def report_text(self, variant: str) -> str:
        records = [_report.RegionRecord(**r) for r in self.reports.get(variant, [])]
        return _report.format_table(records)

    def to_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "rows": [r.as_dict() for r in self.rows], "reports": self.reports}

    def plot(self, path: str) -> str:
        return plot_compare(self, path)


def default_loss(output: Any) -> Tensor:
    """``output.loss`` when the model computed one (Hugging Face with labels), else mean(first tensor ** 2)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, Tensor):
        return loss
    tensor = _first_tensor(output)
    if tensor is None:
        raise TypeError(f"compare: cannot derive a loss from a {type(output).__name__}; pass loss_fn=")
    return tensor.float().square().mean()


def _first_tensor(obj: Any) -> Optional[Tensor]:
    if isinstance(obj, Tensor):
        return obj
    if isinstance(obj, Mapping):
        for key in ("logits", "last_hidden_state"):
            if isinstance(obj.get(key), Tensor):
                return obj[key]
        values = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        values = list(obj)
    else:
        values = [getattr(obj, k) for k in ("logits", "last_hidden_state") if hasattr(obj, k)]
    for v in values:
        t = _first_tensor(v)
        if t is not None:
            return t
    return None


def _call(fn: Callable[..., Any], example_inputs: Any) -> Any:
    if isinstance(example_inputs, Mapping):
        return fn(**example_inputs)
    if isinstance(example_inputs, (list, tuple)):
        return fn(*example_inputs)
    return fn(example_inputs)


def _input_tensors(example_inputs: Any) -> list[tuple[str, Tensor]]:
    if isinstance(example_inputs, Mapping):
        items = list(example_inputs.items())
    elif isinstance(example_inputs, (list, tuple)):
        items = [(f"input[{i}]", v) for i, v in enumerate(example_inputs)]
    else:
        items = [("input", example_inputs)]
    return [(f"input:{k}" if not k.startswith("input") else k, v) for k, v in items if isinstance(v, Tensor)]


def _rel_err(actual: Tensor, expected: Tensor) -> float:
    a = actual.detach().double().cpu()
    e = expected.double()
    den = float(e.norm())
    num = float((a - e).norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


class _Runner:
    def __init__(self, model: torch.nn.Module, example_inputs: Any, loss_fn: Callable[[Any], Tensor], seed: int):
        self.model = model
        self.example_inputs = example_inputs
        self.loss_fn = loss_fn
        self.seed = seed
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.grad_inputs = [(n, t) for n, t in _input_tensors(example_inputs) if t.requires_grad]
        devices = {p.device for _, p in self.params} | {t.device for _, t in _input_tensors(example_inputs)}
        self.device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        if len(devices) > 1 and any(d.type == "cuda" for d in devices):
            self.device = next(d for d in devices if d.type == "cuda")

    def zero_grads(self) -> None:
        for _, t in self.params + self.grad_inputs:
            t.grad = None

    def step(self, fn: Callable[..., Any]) -> Tensor:
        self.zero_grads()
        torch.manual_seed(self.seed)  # dropout and other random ops draw the same numbers in every variant
        loss = self.loss_fn(_call(fn, self.example_inputs))
        loss.backward()
        return loss.detach()

    def grads(self) -> dict[str, Optional[Tensor]]:
        return {n: (None if t.grad is None else t.grad.detach().to("cpu", copy=True))
                for n, t in self.params + self.grad_inputs}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def compare(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Optional[Callable[[Any], Tensor]] = None,
    policies: Sequence[str] = ("activations", "recompute"),
    steps: int = 3,
    inductor: bool = True,
    compile_kwargs: Optional[dict[str, Any]] = None,
    moeblaze_options: Optional[dict[str, Any]] = None,
    seed: int = 0,
    plot: bool = False,
    plot_path: str = "moeblaze_compare.png",
    progress: bool = False,
) -> CompareResult:
    """Compare eager, default ``torch.compile`` and ``backend="moeblaze"`` (one variant per policy) on a model.

    Args:
        model: any ``nn.Module``; its parameters are shared by every variant and never updated.
        example_inputs: a tensor, a tuple/list of positional inputs, or a dict of keyword inputs.
        loss_fn: maps the model's output to a scalar (default: :func:`default_loss`).
        policies: ``checkpoint`` values of the moeblaze variants.
        steps: timed steps after the warm-up step (the median is reported).
        inductor: include the default-backend variant.
        compile_kwargs: extra ``torch.compile`` arguments for every compiled variant (``fullgraph=True``,
            ``dynamic=...``).
        moeblaze_options: extra backend options (e.g. ``{"verify": False}``).
        plot: write a PNG of step time and memory per variant to ``plot_path``. Its requirements (matplotlib)
            are checked before any work starts; a plot that fails afterwards leaves ``plot_error`` set and the
            results returned.
    """
    if steps < 1:
        raise ValueError(f"compare: steps must be >= 1, got {steps}")
    if plot:
        check_plot_requirements()
    loss_fn = loss_fn or default_loss
    compile_kwargs = dict(compile_kwargs or {})
    for key in ("backend", "options"):
        if key in compile_kwargs:
            raise ValueError(f"compare: compile_kwargs may not set {key!r}; it differs per variant")
    runner = _Runner(model, example_inputs, loss_fn, seed)
    device = runner.device

    variants: list[tuple[str, Callable[[], Callable[..., Any]]]] = [("eager", lambda: model)]
    if inductor:
        variants.append(("inductor", lambda: torch.compile(model, **compile_kwargs)))
    for policy in policies:
        options = {**(moeblaze_options or {}), "checkpoint": policy}
        variants.append((f"moeblaze-{policy}",
                         lambda options=options: torch.compile(model, backend="moeblaze", options=options,
                                                               **compile_kwargs)))

    rows: list[CompareRow] = []
    reports: dict[str, list[dict[str, Any]]] = {}
    eager_loss: Optional[float] = None
    eager_grads: Optional[dict[str, Optional[Tensor]]] = None
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(variants), desc="moeblaze compare", unit="variant", file=sys.stderr)
    try:
        for name, make in variants:
            if bar is not None:
                bar.set_postfix_str(name)
            torch._dynamo.reset()
            row, records, loss, grads = _run_variant(name, make, runner, steps)
            if name.startswith("moeblaze-") and (records or row.status == "ok"):
                reports[name] = [r.as_dict() for r in records]
                row.regions_found = len(records)
                row.regions_rewritten = sum(r.status == "rewritten" for r in records)
            if name == "eager":
                eager_loss, eager_grads = loss, grads
            elif loss is not None and eager_loss is not None and grads is not None and eager_grads is not None:
                row.loss_rel_diff = abs(loss - eager_loss) / max(abs(eager_loss), 1e-30)
                row.max_grad_rel_err, row.worst_grad, missing = _grad_errors(grads, eager_grads)
                if missing:
                    row.note = "; ".join(filter(None, [row.note, f"no gradient where eager has one: {missing}"]))
            if name == "eager" and row.status == "ok":
                row.loss_rel_diff, row.max_grad_rel_err = 0.0, 0.0
            rows.append(row)
            free_memory(device)
            if bar is not None:
                bar.update(1)
    finally:
        torch._dynamo.reset()
        runner.zero_grads()
        if bar is not None:
            bar.close()

    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "device_type": device.type,
        "torch": torch.__version__,
        "dtype": str(next((p.dtype for _, p in runner.params), torch.float32)).replace("torch.", ""),
        "steps": steps,
        "timer": timer_label(device, 1, steps),
        "compile_kwargs": {k: repr(v) for k, v in compile_kwargs.items()},
        "parameters": sum(p.numel() for _, p in runner.params),
    }
    result = CompareResult(rows, reports, meta)
    if plot:
        try:
            result.plot_path = plot_compare(result, plot_path)
        except (RuntimeError, OSError) as exc:
            result.plot_error = f"{type(exc).__name__}: {exc}"
    return result


def _run_variant(name: str, make: Callable[[], Callable[..., Any]], runner: _Runner, steps: int):
    row = CompareRow(name)
    records: list[_report.RegionRecord] = []
    loss = grads = None
    device = runner.device
    n_reports = len(_report.all_reports())
    error = None
    try:
        fn = make()
        runner.sync()
        t0 = time.perf_counter()
        loss_t = runner.step(fn)  # warm-up: compiles
        runner.sync()
        row.first_step_s = time.perf_counter() - t0
        records = [r for graph in _report.all_reports()[n_reports:] for r in graph]
        loss = float(loss_t)
        row.loss = loss
        grads = runner.grads()

        if device.type == "cuda":  # one step at a time: each waited for before the next starts
            times = []
            for _ in range(steps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                runner.step(fn)
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end))
        else:
            times = wall_step_times(lambda i: runner.step(fn), steps)
        timed = StepTimes.of(times)
        row.step_ms = timed.median
        row.step_times_ms = list(timed.times_ms)
        row.steps_timed = timed.n
        row.step_spread = timed.spread
        row.wide_spread = timed.wide

        runner.zero_grads()
        params = [p for _, p in runner.params]
        row.saved_bytes = saved_activation_bytes(
            lambda: runner.loss_fn(_call(fn, runner.example_inputs)), params)

        if device.type == "cuda":
            runner.zero_grads()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            runner.step(fn)
            torch.cuda.synchronize(device)
            row.peak_bytes = torch.cuda.max_memory_allocated(device) - base
        # The records of a recompile during the timed steps count too.
        records = [r for graph in _report.all_reports()[n_reports:] for r in graph]
    except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
        row.status = "out of memory" if is_oom(exc) else "error"
        error = describe_error(exc)
    if error:
        row.note = error
        records = [r for graph in _report.all_reports()[n_reports:] for r in graph]
    runner.zero_grads()
    return row, records, loss, grads


def describe_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line``, of the backend's own exception when Dynamo wrapped it (BackendCompilerFailed)."""
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = getattr(exc, "inner_exception", None) or exc.__cause__
    parts = []
    for e in (seen[0], seen[-1]) if len(seen) > 1 else seen[:1]:
        text = str(e).strip()
        first = text.splitlines()[0] if text else ""
        if isinstance(e, torch._dynamo.exc.BackendCompilerFailed):
            first = first.rstrip(": ") or first
        parts.append(f"{type(e).__name__}: {first}" if first else type(e).__name__)
    return " <- ".join(reversed(parts))[:limit]


def _grad_errors(grads: dict[str, Optional[Tensor]], eager: dict[str, Optional[Tensor]]):
    worst, worst_name, missing = 0.0, None, []
    for name, ref in eager.items():
        got = grads.get(name)
        if ref is None:
            continue
        if got is None:
            missing.append(name)
            continue
        err = _rel_err(got, ref)
        if err > worst or worst_name is None:
            worst, worst_name = err, name
    if missing:
        worst = math.inf
    return worst, worst_name, missing


def format_compare_table(result: CompareResult) -> str:
    """Markdown: one row per variant."""
    m = result.meta
    lines = [
        f"{m['device']}, torch {m['torch']}, {m['dtype']}; step = forward + loss + backward, "
        f"{m['timer']} (first step excluded).",
        "",
        "| variant | loss | loss rel diff | max grad rel err | step ms (n steps) | first step s | saved MB | peak MB | "
        "MoE regions | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.rows:
        regions = "-" if r.regions_found is None else f"{r.regions_rewritten}/{r.regions_found} rewritten"
        note = r.note if r.status == "ok" else f"{r.status}: {r.note}" if r.note else r.status
        if r.worst_grad and r.max_grad_rel_err:
            note = "; ".join(filter(None, [note, f"worst grad: {r.worst_grad}"]))
        step = StepTimes.of(r.step_times_ms).cell(".2f") if r.step_times_ms else number_cell(r.step_ms, ".2f")
        lines.append(
            f"| {r.variant} | {number_cell(r.loss, '.6g')} | {number_cell(r.loss_rel_diff, '.1e')} | "
            f"{number_cell(r.max_grad_rel_err, '.1e')} | {step} | {number_cell(r.first_step_s, '.1f')} | "
            f"{mb_cell(r.saved_bytes, '.2f')} | {mb_cell(r.peak_bytes, '.2f')} | {regions} | {note.replace('|', '/')} |"
        )
    note = spread_note([r.wide_spread for r in result.rows])
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def check_plot_requirements() -> None:
    """Raise ``RuntimeError`` (what is missing, how to install it) when a plot cannot be drawn here."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib, which is not installed: pip install matplotlib (or "
                           "'moeblaze-fx[bench]'), or leave out the plot") from exc


def plot_compare(result: CompareResult, path: str) -> str:
    check_plot_requirements()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result.rows if r.status == "ok"]
    metrics = [("step_ms", "step time (ms)", 1.0), ("saved_bytes", "saved activations (MB)", 2 ** -20)]
    if any(r.peak_bytes is not None for r in ok):
        metrics.append(("peak_bytes", "peak memory (MB)", 2 ** -20))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 4), squeeze=False)
    names = [r.variant for r in ok]
    for ax, (key, label, scale) in zip(axes[0], metrics):
        values = [(getattr(r, key) or 0) * scale for r in ok]
        ax.bar(range(len(ok)), values, color=[f"C{i}" for i in range(len(ok))])
        ax.set_xticks(range(len(ok)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=9)
    m = result.meta
    fig.suptitle(f"moeblaze compare: {m['device']}, torch {m['torch']}, {m['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
