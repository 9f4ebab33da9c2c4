"""Recorded launch programs: an operator call replayed from the record of an earlier call with the same signature.

An operator call's orchestration (``ops.py``, :mod:`.forward`, :mod:`.backward`, the plans, the Gluon launchers)
decides everything from the arguments' shapes, strides, dtypes, alignments, the parameters' addresses, the stream
and the kernel options, never from the tensors' values: no host synchronisation is allowed on any path. So two
calls with the same signature make the same PyTorch operations (allocations, views, fills, copies) and the same
kernel launches, with the same grids and the same arguments, except for the tensors themselves and the addresses
derived from them. Deciding it again is most of an operator call's host time (docs/host.md).

:func:`run` records a call (:class:`_Recorder`): every ATen operation through a ``TorchDispatchMode``, every kernel
launch through :func:`launched` (called by :mod:`.launch` where it calls the driver's launch function), and every
call of a :func:`host_step` function (the pointer tables of :mod:`.tables`, whose result depends only on their
arguments). Each tensor the call touches is a *slot*: the call's tensor arguments first, then each tensor an
operation or host step returns. An argument of a recorded step is a slot, an address inside a slot's extent (kept
as the slot and the offset: a pointer table over a gradient buffer, an address passed to ``torch.full``), a host
tensor descriptor over a slot (made again over the new tensor, its encoding kept per address), or a constant
(kept as it was: the weights' tables and descriptors, which the signature's parameter addresses fix). A later call
with the same signature replays the steps with its own tensors in the slots: the operations are called again, the
kernels are launched through the driver's launch function with their recorded grids and arguments, and each slot
is released after its last use, so no transient lives longer than it did in the recorded call.

A signature's first call runs as usual (where the parameters move at every step, as FSDP2's unsharded ones may, no
call is recorded); its second is recorded. A record is refused (the call runs as usual, and later calls try again,
at most :data:`ATTEMPTS` records in all) when
anything in it could differ from call to call without the signature showing it: a launch through Triton's own path
(a first launch of a specialization, which compiles or autotunes, a profiler's hook, a kernel this module does not
key), an operation returning anything but tensors (``.item()``), a host tensor holding an address of the call's
tensors, or two of the call's tensor arguments overlapping. The caller keys programs by everything the
orchestration reads (``ops._programmed``) and keeps them with the parameters' units (:func:`.plan.keep`), so a
program goes with its parameters. For weights made for the call (cast under autocast) the caller keys no address
and makes the weights' tables and descriptors inside the recorded call, so that they are slots, not constants.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ATTEMPTS", "Counter", "Entry", "Program", "bump", "host_step", "interpreted", "launched", "recording",
           "refuse", "run", "stats"]

ATTEMPTS = 3  # records tried per signature (a first launch of a kernel's specialization refuses one)
_STATS = {"recorded": 0, "replayed": 0, "refused": 0}
_LOCAL = threading.local()  # .recorder: the _Recorder of this thread's call being recorded, or None
_ADDRESS_MIN = 1 << 32  # an int below this is never taken for an address (device addresses are far above it)


def stats() -> dict:
    """Calls recorded, replayed, and records refused so far."""
    return dict(_STATS)


def recording():
    """The recorder of this thread's call being recorded, or None."""
    return getattr(_LOCAL, "recorder", None)


def refuse(why: str) -> None:
    """Refuse the record of the call being recorded on this thread, if any (see the module doc)."""
    rec = recording()
    if rec is not None:
        rec.refuse(why)


def host_step(fn: Callable) -> Callable:
    """``fn`` (a function of ints, devices and dtypes returning a tensor, made again from its arguments alone),
    recorded as one step: a replay calls it with the addresses among its arguments moved to the new call's
    tensors (a pointer table over this call's gradient buffers), none of the operations inside it recorded."""
    @functools.wraps(fn)
    def call(*args):
        rec = recording()
        return fn(*args) if rec is None else rec.host(fn, args)
    return call


def launched(run, grid: tuple, stream: int, function, coop, pdl, metadata, args: tuple, descs: tuple,
             encode: Callable) -> None:
    """Record a driver launch (:mod:`.launch`): ``run(gx, gy, gz, stream, function, coop, pdl, None, None,
    metadata, None, None, None, *args)`` with each host descriptor at the positions ``(i, meta)`` of ``descs``
    replaced by ``encode(descriptor, meta)``. (The stream is the signature's: the caller keys programs by it.)"""
    rec = recording()
    if rec is not None:
        rec.launch(run, grid, stream, function, coop, pdl, metadata, args, descs, encode)


def interpreted(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)`` under Triton's interpreter (kernels run as Python on the CPU), recorded as one
    step where a call is being recorded: a replay makes the same call with its own tensors."""
    rec = recording()
    if rec is None:
        kernel[grid](*args, **kwargs)
    else:
        rec.interpreted(kernel, grid, args, kwargs)


class Counter:
    """A count of launches of one kind (tests read them), bumped by :func:`bump`: a replay bumps it too."""

    __slots__ = ("n",)

    def __init__(self):
        self.n = 0


@host_step
def bump(counter: Counter, by: int = 1) -> None:
    """``counter.n += by``, again at each replay of the call."""
    counter.n += by


_NOT_TENSORS = "an operation returned something other than tensors"


class _Addr:
    """An address ``offset`` bytes into slot ``slot``'s tensor."""

    __slots__ = ("slot", "offset")

    def __init__(self, slot: int, offset: int):
        self.slot, self.offset = slot, offset


class _DescRef:
    """A host tensor descriptor over slot ``slot``'s tensor: the same descriptor over the new call's tensor."""

    __slots__ = ("slot", "cls", "fields")

    def __init__(self, slot: int, cls: type, fields: dict):
        self.slot, self.cls, self.fields = slot, cls, fields

    def over(self, base: Tensor):
        desc = object.__new__(self.cls)
        desc.__dict__.update(self.fields)
        desc.base = base
        return desc


class _Ref:
    """Slot ``slot``'s tensor."""

    __slots__ = ("slot",)

    def __init__(self, slot: int):
        self.slot = slot


def _extent(t: Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()


class _Recorder(TorchDispatchMode):
    """Records one call (see the module doc)."""

    def __init__(self, inputs: Sequence[Tensor]):
        super().__init__()
        self.slots = WeakIdKeyDictionary()  # tensor -> slot (weakly: the call frees its transients as usual)
        self.ranges: list[tuple[int, int, int]] = []  # (start, end, slot) of each slot's bytes
        self.alive: list[weakref.ref] = []  # per slot
        self.steps: list[tuple] = []
        self.uses: dict[int, int] = {}  # slot -> index of the last step using it
        self.n_slots = 0
        self.why: str | None = None
        self.paused = 0
        self.n_inputs = len(inputs)
        for t in inputs:
            if t in self.slots:
                self.refuse("one tensor passed twice")
            self._new_slot(t)
        for i, (s0, e0, _) in enumerate(self.ranges):
            if any(s0 < e1 and s1 < e0 for s1, e1, _ in self.ranges[:i]):
                self.refuse("two of the call's tensors overlap")

    def refuse(self, why: str) -> None:
        if self.why is None:
            self.why = why

    def _new_slot(self, t: Tensor) -> int:
        slot = self.n_slots
        self.n_slots += 1
        self.slots[t] = slot
        self.alive.append(weakref.ref(t))
        size = _extent(t)
        if size:
            self.ranges.append((t.data_ptr(), t.data_ptr() + size, slot))
        return slot

    def _address(self, a: int):
        """``a``, or where it points: the newest live slot holding it (the allocator hands a freed slot's memory to
        a later one)."""
        for start, end, slot in reversed(self.ranges):
            if start <= a < end and self.alive[slot]() is not None:
                return _Addr(slot, a - start)
        return a

    def _arg(self, a: Any, used: set) -> Any:
        """The template of one argument (see the module doc)."""
        if isinstance(a, Tensor):
            slot = self.slots.get(a)
            if slot is not None:
                used.add(slot)
                return _Ref(slot)
            if a.device.type == "cpu" and not a.is_floating_point() and a.numel() and a.dtype != torch.bool \
                    and any(type(self._address(int(v))) is _Addr for v in a.reshape(-1).tolist() if v >= _ADDRESS_MIN):
                self.refuse("a host tensor holds an address of the call's tensors")
            return a  # a constant: a tensor from before the call (kept tables, kept descriptors' bases)
        if isinstance(getattr(a, "base", None), Tensor):  # a host tensor descriptor
            slot = self.slots.get(a.base)
            if slot is None:
                return a  # over a tensor from before the call: a constant
            if not hasattr(a, "__dict__"):
                self.refuse(f"a {type(a).__name__} over the call's tensors")
                return a
            used.add(slot)
            return _DescRef(slot, type(a), {k: v for k, v in vars(a).items()  # (not launch's kept encoding)
                                             if k != "base" and not k.startswith("_moeblaze")})
        if type(a) is int and a >= _ADDRESS_MIN:
            got = self._address(a)
            if type(got) is _Addr:
                used.add(got.slot)
            return got
        if isinstance(a, (list, tuple)):
            out = [self._arg(v, used) for v in a]
            if all(o is v for o, v in zip(out, a)):
                return a  # (as it was, not a copy: a constant)
            return out if isinstance(a, list) else tuple(out)
        if isinstance(a, dict):
            out = {k: self._arg(v, used) for k, v in a.items()}
            return a if all(out[k] is v for k, v in a.items()) else out
        return a

    def _outputs(self, out: Any, used: set) -> Any:
        """The slots of an operation's outputs (new tensors get new ones); ``used`` gets them."""
        if out is None:
            return None
        if isinstance(out, Tensor):
            slot = self.slots.get(out)
            slot = self._new_slot(out) if slot is None else slot
            used.add(slot)
            return _Ref(slot)
        if isinstance(out, (list, tuple)) and all(isinstance(t, Tensor) or t is None for t in out):
            return [self._outputs(t, used) for t in out]
        self.refuse(_NOT_TENSORS)
        return None

    def _step(self, step: tuple, used: set) -> None:
        index = len(self.steps)
        self.steps.append(step)
        for slot in used:
            self.uses[slot] = index

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused or self.why is not None:
            return out
        used: set = set()
        args_t, kwargs_t = self._arg(tuple(args), used), self._arg(dict(kwargs), used)
        outs = self._outputs(out, used)
        if self.why == _NOT_TENSORS:
            self.why = f"{func} returned {type(out).__name__}"
        self._step(("op", func, args_t, kwargs_t, outs), used)
        return out

    def host(self, fn, args: tuple):
        outer = self.paused
        self.paused += 1  # what fn runs is not recorded: a replay calls fn
        try:
            out = fn(*args)
            if not outer and self.why is None:
                used: set = set()
                args_t = self._arg(tuple(args), used)
                self._step(("host", fn, args_t, {}, self._outputs(out, used)), used)
        finally:
            self.paused -= 1
        return out

    def launch(self, run, grid, stream, function, coop, pdl, metadata, args: tuple, descs: tuple, encode) -> None:
        if self.paused or self.why is not None:
            return
        self.paused += 1  # (inspecting a host tensor runs operations)
        try:
            used: set = set()
            args_t = list(self._arg(tuple(args), used))
            for i, meta in descs:  # each one expanded to its encoding, as the launch expanded it
                ref = args_t[i]
                args_t[i] = _SlotDesc(ref, meta, encode, len(encode(args[i], meta))) if type(ref) is _DescRef \
                    else _ConstDesc(encode(args[i], meta))  # (over a tensor from before the call: the weights)
            self._step(("launch", run, (grid, stream, function, coop, pdl, metadata), args_t, None), used)
        finally:
            self.paused -= 1

    def interpreted(self, kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
        outer = self.paused
        self.paused += 1  # (the interpreter's own tensor operations are the launch's, not the call's)
        try:
            kernel[grid](*args, **kwargs)
            if not outer and self.why is None:
                used: set = set()
                args_t, kwargs_t = self._arg(tuple(args), used), self._arg(dict(kwargs), used)
                self._step(("interpreted", kernel[grid], args_t, kwargs_t, None), used)
        finally:
            self.paused -= 1

    def program(self, result: Any) -> "Program | None":
        """The program of the recorded call returning ``result``, or None where the record was refused."""
        self.paused += 1
        try:
            kept: set = set()
            outputs = self._result(result, kept)
        finally:
            self.paused -= 1
        return None if self.why is not None else Program(self, outputs, kept)

    def _result(self, result: Any, kept: set) -> Any:
        if isinstance(result, Tensor):
            slot = self.slots.get(result)
            if slot is None or slot < self.n_inputs:
                self.refuse("the call returned a tensor it did not make")
                return None
            kept.add(slot)
            return _Ref(slot)
        if isinstance(result, (list, tuple)):
            out = [self._result(r, kept) for r in result]
            return out if isinstance(result, list) else tuple(out)
        if result is not None:
            self.refuse(f"the call returned {type(result).__name__}")
        return None


class _ConstDesc:
    """A host descriptor over a tensor from before the call: its encoding, kept."""

    __slots__ = ("encoded",)

    def __init__(self, encoded: list):
        self.encoded = encoded


class _SlotDesc:
    """A driver launch's host descriptor over a slot's tensor (``ref``): made again over the new tensor and encoded,
    once per address."""

    __slots__ = ("ref", "slot", "meta", "encode", "size", "kept")

    def __init__(self, ref: _DescRef, meta, encode, size: int):
        self.ref, self.slot, self.meta, self.encode, self.size = ref, ref.slot, meta, encode, size
        # address -> encoding (the allocator hands the same addresses back; a program over weights made for the call
        # serves every layer of its shapes, each with its weights' addresses)
        self.kept: dict[int, list] = {}

    def encoded(self, base: Tensor) -> list:
        ptr = base.data_ptr()
        got = self.kept.get(ptr)
        if got is None:
            got = self.encode(self.ref.over(base), self.meta)
            if len(self.kept) >= 128:
                self.kept.clear()
            self.kept[ptr] = got
        return got


def _filler(template: Any):
    """A function of the slots' tensors giving ``template`` with its slots and addresses filled, or None where it
    holds none (it is then its own value)."""
    kind = type(template)
    if kind is _Ref:
        slot = template.slot
        return lambda vals: vals[slot]
    if kind is _Addr:
        slot, offset = template.slot, template.offset
        return lambda vals: vals[slot].data_ptr() + offset
    if kind is _DescRef:
        return lambda vals: template.over(vals[template.slot])
    if kind is list or kind is tuple:
        fills = [(i, f) for i, f in enumerate(map(_filler, template)) if f is not None]
        if not fills:
            return None
        base = list(template)

        def fill(vals):
            out = base.copy()
            for i, f in fills:
                out[i] = f(vals)
            return out if kind is list else tuple(out)
        return fill
    if kind is dict:
        fills = [(k, f) for k, f in ((k, _filler(v)) for k, v in template.items()) if f is not None]
        if not fills:
            return None

        def fill_dict(vals):
            out = dict(template)
            for k, f in fills:
                out[k] = f(vals)
            return out
        return fill_dict
    return None


def _plain(kwargs: dict) -> bool:
    """Whether a factory's keyword arguments ask for nothing beyond a dtype and a device (a strided, unpinned,
    contiguous tensor)."""
    return kwargs.get("layout") in (None, torch.strided) and not kwargs.get("pin_memory") \
        and kwargs.get("memory_format") in (None, torch.contiguous_format) \
        and set(kwargs) <= {"dtype", "layout", "device", "pin_memory", "memory_format"} \
        and not any(isinstance(v, (_Ref, _Addr, _DescRef)) for v in kwargs.values())


def _fast_op(fn, kwargs: dict) -> tuple:
    """(function, keyword arguments) doing what ``fn(*args, **kwargs)`` did, through PyTorch's Python bindings where
    they do the same for these arguments: an ``OpOverload`` call parses its arguments against the schema, 2-3x the
    binding's host time (7-13 us against 3-5 for an allocation, H200)."""
    aten = torch.ops.aten
    if fn in (aten.empty.memory_format, aten.new_empty.default, aten.empty_strided.default, aten.zeros.default) \
            and _plain(kwargs):
        kept = {k: kwargs[k] for k in ("dtype", "device") if kwargs.get(k) is not None}
        return {aten.empty.memory_format: torch.empty, aten.new_empty.default: Tensor.new_empty,
                aten.empty_strided.default: torch.empty_strided, aten.zeros.default: torch.zeros}[fn], kept
    if fn is aten.as_strided.default and not kwargs:
        return Tensor.as_strided, kwargs
    return fn, kwargs


def _slots_of(template: Any) -> list:
    """The slots an operation's outputs take, in the structure it returns them (None: not a tensor)."""
    if type(template) is _Ref:
        return template.slot
    if isinstance(template, list):
        return [_slots_of(t) for t in template]
    return None


class Program:
    """A recorded call, replayed with another call's tensors (see the module doc)."""

    def __init__(self, rec: _Recorder, outputs: Any, kept: set):
        self.n_slots, self.n_inputs = rec.n_slots, rec.n_inputs
        release: list[list[int]] = [[] for _ in rec.steps]
        for slot, last in rec.uses.items():
            if slot >= rec.n_inputs and slot not in kept:
                release[last].append(slot)
        self.steps = tuple(self._compile(step, tuple(rel)) for step, rel in zip(rec.steps, release))
        self.outputs = _filler(outputs) or (lambda vals, _o=outputs: _o)
        self.kinds = tuple(step[0] for step in rec.steps)

    def _compile(self, step: tuple, release: tuple) -> Callable:
        kind, fn, args_t, kwargs_t, outs = step
        if kind == "launch":
            return _launch_step(fn, args_t, kwargs_t, release)
        if kind == "op":
            fn, kwargs_t = _fast_op(fn, kwargs_t)
        args_f, kwargs_f = _filler(args_t), _filler(kwargs_t)
        args_c, kwargs_c = args_t, kwargs_t
        out_slots = _slots_of(outs)

        def op(vals):
            out = fn(*(args_f(vals) if args_f else args_c), **(kwargs_f(vals) if kwargs_f else kwargs_c))
            if type(out_slots) is int:
                vals[out_slots] = out
            elif out_slots is not None:
                for slot, t in zip(out_slots, out):
                    if slot is not None:
                        vals[slot] = t
            for slot in release:
                vals[slot] = None
        return op

    def replay(self, inputs: Sequence[Tensor]) -> Any:
        vals: list = [None] * self.n_slots
        vals[:self.n_inputs] = inputs
        for step in self.steps:
            step(vals)
        return self.outputs(vals)


def _launch_step(run, head: tuple, args_t: list, release: tuple) -> Callable:
    grid, stream, function, coop, pdl, metadata = head
    gx, gy, gz = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
    flat, tensors, addresses, descs = [], [], [], []
    for a in args_t:
        if type(a) is _ConstDesc:
            flat.extend(a.encoded)
            continue
        if type(a) is _SlotDesc:
            descs.append((len(flat), a))
            flat.extend([None] * a.size)
            continue
        if type(a) is _Ref:
            tensors.append((len(flat), a.slot))
        elif type(a) is _Addr:
            addresses.append((len(flat), a.slot, a.offset))
        elif isinstance(a, (list, tuple, dict)) and _filler(a) is not None:
            raise AssertionError("a kernel argument nesting the call's tensors")  # (launch keys refuse those)
        flat.append(a)
    head = (gx, gy, gz, stream, function, coop, pdl, None, None, metadata, None, None, None)

    def launch(vals):
        args = flat.copy()
        for i, slot in tensors:
            args[i] = vals[slot]
        for i, slot, offset in addresses:
            args[i] = vals[slot].data_ptr() + offset
        for i, d in descs:
            args[i:i + d.size] = d.encoded(vals[d.slot])
        run(*head, *args)
        for slot in release:
            vals[slot] = None
    return launch


class Entry:
    """What is kept for one signature: its program once recorded, and the records tried."""

    __slots__ = ("program", "calls", "attempts", "why", "__weakref__")

    def __init__(self):
        self.program: Program | None = None
        self.calls = 0
        self.attempts = 0
        self.why: str | None = None  # why the last record was refused


def run(entry: Entry, inputs: Sequence[Tensor], body: Callable[[], Any]) -> Any:
    """``body()``, the call whose tensor arguments are ``inputs``: replayed from ``entry``'s program, or recorded
    into it (see the module doc)."""
    program = entry.program
    if program is not None:
        _STATS["replayed"] += 1
        return program.replay(inputs)
    entry.calls += 1
    if entry.calls == 1 or entry.attempts >= ATTEMPTS or recording() is not None:
        return body()  # (a signature is recorded from its second call: one that comes once costs no record)
    entry.attempts += 1
    rec = _Recorder(inputs)
    _LOCAL.recorder = rec
    try:
        with rec:
            result = body()
    finally:
        _LOCAL.recorder = None
    entry.program = rec.program(result)
    entry.why = rec.why
    _STATS["refused" if entry.program is None else "recorded"] += 1
    return result
