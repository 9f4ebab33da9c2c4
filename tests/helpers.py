"""Helpers shared by the end-to-end tests: compile with the backend, compare with eager."""
from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from moeblaze_fx.backend import rewrite_graph
from moeblaze_fx.passes import format_graph

# relative error ||compiled - eager|| / ||eager|| allowed per dtype (output and every gradient)
TOL = {torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 1e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_eager_and_compiled(model: torch.nn.Module, inputs: tuple, *, options=None, loss=None, dtype=torch.float32,
                           fullgraph=True, tol=None, seed=None):
    """Forward + backward eagerly and under backend="moeblaze"; assert equal within tolerance (``tol``, else
    ``TOL[dtype]``). ``seed``: torch's generator is seeded with it before each step (a model that samples).
    Returns the moeblaze counters of the compile."""
    loss = loss or (lambda out: (out.float() * torch.linspace(-1, 1, out.numel(), device=out.device).view(out.shape)).sum())
    params = [p for p in model.parameters() if p.requires_grad]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def step(fn):
        for t in params + leaves:
            t.grad = None
        if seed is not None:
            torch.manual_seed(seed)
        out = fn(*inputs)
        out = getattr(out, "logits", out)  # a transformers model output
        # more than one output (the MoE output and an auxiliary loss, or the routing): every float one is in the loss
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        # compare the output tensors themselves: a scalar loss over them can cancel and magnify rounding
        sum(o if o.dim() == 0 else loss(o) for o in outs if o.requires_grad).backward()
        return [o.detach() for o in outs], [t.grad.detach().clone() if t.grad is not None else None
                                            for t in params + leaves]

    want_out, want_grads = step(model)
    counters.clear()
    options = {"inductor": False} if options is None else options  # {}: the defaults, through Inductor
    compiled = torch.compile(model, backend="moeblaze", fullgraph=fullgraph, options=options)
    got_out, got_grads = step(compiled)
    tol = TOL[dtype] if tol is None else tol
    assert len(got_out) == len(want_out)
    for i, (got, want) in enumerate(zip(got_out, want_out)):
        if want.is_floating_point():
            assert _rel(got, want) <= tol, f"output {i}: relative error {_rel(got, want):.3g}"
        else:
            assert torch.equal(got, want), f"output {i} differs"
    names = [n for n, p in model.named_parameters() if p.requires_grad] + [f"input{i}" for i in range(len(leaves))]
    for name, a, b in zip(names, got_grads, want_grads):
        assert (a is None) == (b is None), f"gradient of {name}: present in one run only"
        if a is not None:
            assert _rel(a, b) <= tol, f"gradient of {name}: relative error {_rel(a, b):.3g}"
    return dict(counters["moeblaze"])


def rewritten_graph(module: torch.nn.Module, *inputs, options=None) -> str:
    """The rewritten Dynamo graph of ``module`` in format_graph's form."""
    graphs = []

    def capture(gm, example_inputs):
        new = rewrite_graph(gm, example_inputs, options)
        graphs.append(format_graph(new))
        return new.forward

    torch._dynamo.reset()
    torch.compile(module, backend=capture, fullgraph=True)(*inputs)
    assert len(graphs) == 1, f"expected one graph, Dynamo made {len(graphs)}"
    return graphs[0]


def cpu_peak_bytes(fn) -> int:
    """The most bytes that ``fn`` holds at once on the CPU beyond what was alive before it (torch.profiler's memory
    events summed in time order: Inductor's output code allocates outside any Python dispatch)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak
