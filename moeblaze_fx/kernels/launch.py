"""Kernel launches without Triton's per-launch binding, once a launch's specialization is compiled.

``kernel[grid](*args, **kwargs)`` spends about 80 us of host time a launch in Triton 3.6 before the driver call: the
binder specializes every argument, the cache key is built, the kernel's globals are checked, the launch metadata
is made (H100, docs/host.md: 0.7 of the 1.3 ms that 14 launches take a layer step at
config C). A step of a few milliseconds is then bound by its host.

:func:`launch` does the first launch of a specialization through ``kernel[grid]`` and keeps the compiled kernel
under a key of everything Triton's specialization reads: each constexpr's value (by position or keyword),
each tensor's dtype and 16-byte alignment, each int's value being 1, divisible by 16 and its width, each
descriptor's dtype, block, layout, padding and alignments, the keyword arguments (constexprs, the values of
``triton.heuristics``, options) and the device. A later launch with the same key calls the compiled kernel's
launcher directly with the same arguments Triton would pass, or, where that launcher is Triton 3.6's
``CudaLauncher`` with no scratch to allocate, the driver's launch function under it, each host tensor descriptor
replaced by its encoding as the launcher would (kept on the descriptor: see :func:`_encoded`). The key holds more
than Triton specializes on,
never less: a miss only costs one ordinary launch. One of Triton's per-launch checks is not repeated on a hit:
that the globals a kernel read when compiled are unchanged (the kernels here read only constants). A kernel
with a pre-run hook, and a runtime argument passed by keyword, take Triton's path.

A driver launch is also handed to :mod:`.program` (recorded where an operator call is being recorded), as is a launch
under Triton's interpreter (a Python call); any other launch through Triton's own path refuses that record.

It is used where Triton 3.6 is installed, for launches with a tuple grid and no launch hook added to Triton's
(empty) hook chains (a profiler's hook sees every launch through Triton's own path); anywhere else it is
``kernel[grid](*args, **kwargs)``.
"""
from __future__ import annotations

import inspect

import torch
import triton

from ..config import interpreting
from . import program as _program

__all__ = ["TOKEN_SIZED", "direct", "enabled", "launch", "sized", "stats"]

# Runtime ints that follow the number of tokens: pairs, tiles, chunks, the end of a window. Triton specializes an int
# argument on being 1 and on being divisible by 16, and compiles a kernel per pattern of those across its arguments;
# where the token count changes from call to call (the rows an expert-parallel rank receives, ``dynamic=True``, a
# short last batch), every new pattern of these was one more compile of each kernel. Not specialized, they cost
# one compile per kernel whatever the count. The weights' sizes and every stride stay specialized.
TOKEN_SIZED = frozenset({"N", "T", "n_tiles", "num_tiles", "tiles_total", "num_tile_programs", "num_chunks",
                         "num_m", "slot1", "own_end"})


def sized(jit):
    """``jit`` (``triton.jit`` or ``gluon.jit``) with the kernel's :data:`TOKEN_SIZED` parameters not specialized."""
    def wrap(fn):
        return jit(fn, do_not_specialize=[n for n in inspect.signature(fn).parameters if n in TOKEN_SIZED])
    return wrap

# the launcher's calling convention and the compiled kernel's attributes relied on here are Triton 3.6's
_SUPPORTED = triton.__version__.startswith("3.6.") and not interpreting()
_CACHE: dict = {}
_PARAM_KINDS: dict = {}  # id(kernel) -> (kernel, its parameters' kinds)
_STATS = {"fast": 0, "slow": 0}

try:  # pragma: no cover - depends on the Triton build
    from triton import knobs as _knobs
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
    from triton.runtime.autotuner import Heuristics as _Heuristics
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # pragma: no cover
    _knobs = _GluonDescriptor = _Heuristics = _JITFunction = None
    _SUPPORTED = False
try:  # pragma: no cover - depends on the Triton build
    from triton.backends.nvidia.driver import make_tensordesc_arg as _make_tensordesc_arg
except ImportError:  # pragma: no cover
    _make_tensordesc_arg = None


class _Unkeyed(Exception):
    """An argument of a kind this module does not key: the launch takes Triton's own path."""


def enabled() -> bool:
    """Whether launches may skip Triton's binding (Triton 3.6, not interpreted)."""
    return _SUPPORTED


def direct() -> bool:
    """Whether a launch with a compiled specialization goes to the driver now: :func:`enabled`, and no launch hook in
    Triton's chains (a profiler's hook must see every launch through Triton's own path)."""
    runtime = _knobs.runtime if _SUPPORTED else None
    return runtime is not None and not _active(runtime.launch_enter_hook) and not _active(runtime.launch_exit_hook)


def stats() -> dict:
    """Launches so far through the compiled kernel's launcher ("fast") and through ``kernel[grid]`` ("slow")."""
    return dict(_STATS)


def _arg_key(a):
    """What Triton's specialization of a runtime argument may depend on (more is harmless, less is not)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    t = type(a)
    if t is int:
        return int, a == 1, a % 16 == 0, -2**31 <= a < 2**31, -2**63 <= a < 2**63
    if t is bool or a is None:
        return t, a
    if t is float:
        return float
    if _GluonDescriptor is not None and t is _GluonDescriptor:
        return (t, a.base.dtype, tuple(a.block_shape), a.layout, a.padding, a.base.data_ptr() % 16 == 0,
                tuple(s % 16 == 0 for s in a.shape), tuple(s % 16 == 0 for s in a.strides))
    raise _Unkeyed(t)


def _param_kinds(kernel) -> tuple:
    """Per positional parameter: True for a constexpr (keyed by its value), "width" for an int Triton does not
    specialize (keyed by its width only), False for the others; and the names of the non-constexprs (one of those
    passed by keyword is not keyed: Triton's path takes it)."""
    got = _PARAM_KINDS.get(id(kernel))
    if got is None:  # keyed by identity (a kernel's own hash rebuilds its source key), holding the kernel: its id
        # stays its own
        got = _PARAM_KINDS[id(kernel)] = (kernel, (
            tuple(True if p.is_constexpr else "width" if getattr(p, "do_not_specialize", False) else False
                  for p in kernel.params),
            frozenset(p.name for p in kernel.params if not p.is_constexpr)))
    return got[1]


def _width_key(a):
    """An unspecialized argument: an int by its width, as Triton still types it; anything else as usual."""
    return (int, -2**31 <= a < 2**31, -2**63 <= a < 2**63) if type(a) is int else _arg_key(a)


def _key(kernel, args, kwargs):
    positional, runtime_names = _param_kinds(kernel)
    if not runtime_names.isdisjoint(kwargs) or getattr(kernel, "pre_run_hooks", None):
        return None
    try:
        args_key = tuple(a if kind is True else _width_key(a) if kind else _arg_key(a)
                         for a, kind in zip(args, positional))
    except _Unkeyed:
        return None
    # Triton's own options from its knobs: a kernel compiled without device asserts is not reused with them
    options = (_knobs.runtime.debug, _knobs.compilation.instrumentation_mode)
    return id(kernel), torch.cuda.current_device(), args_key, tuple(kwargs.items()), options  # (see _param_kinds)


def _remaining_args(kernel, n_positional: int, kwargs: dict) -> tuple:
    """The kernel's parameters after the positional ones, in signature order, as Triton binds them (a keyword
    argument, else the default); options such as num_warps are not parameters."""
    out = []
    for p in kernel.params[n_positional:]:
        name = p.name
        if name in kwargs:
            out.append(kwargs[name])
        elif p.has_default:
            out.append(p.default)
        else:
            raise _Unkeyed(name)
    return tuple(out)


def _resolve(kernel, args, kwargs: dict):
    """The JIT function Triton launches for ``kernel[grid](*args, **kwargs)`` and the keyword arguments it gets:
    ``triton.heuristics`` values computed as Triton 3.6's ``Heuristics.run`` computes them (into ``kwargs``).
    None for anything else (an autotuner)."""
    while _Heuristics is not None and isinstance(kernel, _Heuristics):
        for name, heuristic in kernel.values.items():
            kwargs[name] = heuristic({**dict(zip(kernel.arg_names, args)), **kwargs})
        kernel = kernel.fn
    return kernel if _JITFunction is not None and isinstance(kernel, _JITFunction) else None


def _active(hook) -> bool:
    """Whether a launch hook would run: Triton 3.6 keeps a chain of hooks, empty until one is added."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` (a ``triton.jit`` or ``gluon.jit`` function, a tuple grid), without
    Triton's binding once this specialization has been launched before (see the module doc)."""
    resolved = dict(kwargs)  # with the heuristics' values: they are keyed like any constexpr
    if not direct() or type(grid) is not tuple or (jitted := _resolve(kernel, args, resolved)) is None:
        _STATS["slow"] += 1
        if interpreting() and type(grid) is tuple:  # a Python call: a program replays it as such
            _program.interpreted(kernel, grid, args, kwargs)
            return
        _program.refuse("a launch through Triton's own path")
        kernel[grid](*args, **kwargs)
        return
    kernel, kwargs = jitted, resolved
    key = _key(kernel, args, kwargs)
    try:
        entry = _CACHE.get(key) if key is not None else None
    except TypeError:  # an unhashable keyword argument
        key = entry = None
    if entry is None:
        _STATS["slow"] += 1
        _program.refuse("a first launch of a kernel's specialization (compiled or tuned), or one not keyed")
        compiled = kernel[grid](*args, **kwargs)
        if key is not None and hasattr(compiled, "packed_metadata") and getattr(compiled, "function", None):
            try:
                _CACHE[key] = (compiled, _remaining_args(kernel, len(args), kwargs), _raw_launcher(compiled.run))
            except _Unkeyed:
                pass
        return
    compiled, rest, raw = entry
    _STATS["fast"] += 1
    stream = torch._C._cuda_getCurrentRawStream(key[1])
    gx, gy, gz = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
    if raw is None:
        _program.refuse("a launch through the compiled kernel's launcher")
        compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata, None, None, None, *args,
                     *rest)  # no launch metadata, no hooks: none would run
        return
    run, coop, pdl, descs = raw
    full = args + rest
    # no scratch, no launch metadata, no hooks
    run(gx, gy, gz, stream, compiled.function, coop, pdl, None, None, compiled.packed_metadata, None, None, None,
        *(_expand(full, descs) if descs else full))
    _program.launched(run, (gx, gy, gz), stream, compiled.function, coop, pdl, compiled.packed_metadata, full, descs,
                      _encoded)


# The driver-level launch (Triton 3.6's ``CudaLauncher``): ``compiled.run(...)`` allocates the kernel's scratch
# buffers (none for the kernels here) and, for a kernel taking host tensor descriptors, hands its arguments to a
# Python loop that replaces each descriptor by its CUtensorMap and shape and strides, encoded again at every launch
# (``make_tensordesc_arg``). :func:`launch` calls the driver's launch function itself with those arguments in place,
# and keeps each descriptor's encoding on the descriptor: a descriptor over the weights, kept from call to call
# with its plan's units (``kernels.plan``), is encoded once. Measured: 0.17-0.35 ms less host time an operator step
# at two layer shapes, against the launcher's own call in alternate processes (H200, docs/host.md).
_DESC_ATTR = "_moeblaze_encoded"


def _raw_launcher(run):
    """``(launch function, cooperative grid, PDL, ((position, metadata), ...) of the descriptors among the
    arguments))`` of a compiled kernel's launcher, or None where its form is not Triton 3.6's ``CudaLauncher`` with no
    scratch (then ``compiled.run`` is called)."""
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    fn = getattr(run, "launch", None)
    code = getattr(fn, "__code__", None)
    if fn is None or not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl"):
        return None
    if code is None:  # the compiled launch function itself: no descriptor among the arguments
        return fn, run.launch_cooperative_grid, run.launch_pdl, ()
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"} or _make_tensordesc_arg is None:
        return None  # (not wrap_handle_tensordesc's inner)
    descs = tuple(zip(sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"]))
    return cells["launcher"], run.launch_cooperative_grid, run.launch_pdl, descs


def _expand(args: tuple, descs: tuple) -> tuple:
    """``args`` with each descriptor at the positions of ``descs`` replaced by its encoding, as
    ``wrap_handle_tensordesc`` does."""
    out, prev = [], 0
    for i, meta in descs:
        out.extend(args[prev:i])
        out.extend(_encoded(args[i], meta))
        prev = i + 1
    out.extend(args[prev:])
    return tuple(out)


def _encoded(desc, meta) -> list:
    """``make_tensordesc_arg(desc, meta)``, kept on the descriptor for the same metadata and base address (a
    descriptor's base, shape and strides are fixed when it is made)."""
    got = getattr(desc, _DESC_ATTR, None)
    ptr = desc.base.data_ptr()
    if got is not None and got[0] is meta and got[1] == ptr:
        return got[2]
    encoded = _make_tensordesc_arg(desc, meta)
    setattr(desc, _DESC_ATTR, (meta, ptr, encoded))
    return encoded
