"""How many steps a time is from, and whether they agree well enough to mean something.

A median of two or three steps on a busy CPU can be off by a factor; a table that prints it beside a careful GPU
median invites a wrong comparison. Every benchmark of this package therefore keeps, with a median step time, the
number of steps it came from and their spread, ``(max - min) / median``. A spread above ``WIDE_SPREAD`` marks the
time's cell with ``*`` and the table prints ``SPREAD_NOTE`` once below itself.

``host_enqueue_ms`` is the host's side of a step: the milliseconds the host spends enqueueing one step on an idle
GPU, which is what bounds the step when the GPU work is short (issue 39).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["WIDE_SPREAD", "SPREAD_MARK", "SPREAD_NOTE", "L2_FLUSH_BYTES", "StepTimes", "spread_note", "sync",
           "wall_step_times", "cuda_step_times", "host_enqueue_ms"]

WIDE_SPREAD = 0.25  # (max - min) / median above this: the steps disagree by more than a quarter of the time shown
SPREAD_MARK = "*"
SPREAD_NOTE = (f"{SPREAD_MARK} the timed steps of this cell spread by more than {WIDE_SPREAD:.0%} of their median "
               "((max - min) / median): the machine was busy or the steps differ; take the time as rough, or rerun "
               "with more steps on an idle machine.")
L2_FLUSH_BYTES = 256 << 20  # larger than any current GPU's L2 (H100 50 MB, H200 60 MB)


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """The step times (ms) of one measurement."""

    times_ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.times_ms:
            raise ValueError("StepTimes needs at least one step time")

    @classmethod
    def of(cls, times_ms: Sequence[float]) -> "StepTimes":
        return cls(tuple(float(t) for t in times_ms))

    @property
    def n(self) -> int:
        return len(self.times_ms)

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def spread(self) -> float:
        """``(max - min) / median``; 0 for a single step (nothing to compare it with)."""
        med = self.median
        if med <= 0:
            return 0.0
        return (max(self.times_ms) - min(self.times_ms)) / med

    @property
    def wide(self) -> bool:
        return self.spread > WIDE_SPREAD

    def cell(self, spec: str = ".2f") -> str:
        """``"12.34 (n=3)"``, with ``SPREAD_MARK`` appended when the spread is wide."""
        return f"{format(self.median, spec)} (n={self.n})" + (SPREAD_MARK if self.wide else "")

    def fields(self, times: bool = True) -> dict[str, Any]:
        """A result row's fields of this measurement: ``ms`` (the median), ``step_times_ms`` (all of them; only
        with ``times``), ``steps_timed``, ``ms_spread``, ``wide_spread``."""
        return {"ms": self.median, **({"step_times_ms": list(self.times_ms)} if times else {}), "steps_timed": self.n,
                "ms_spread": self.spread, "wide_spread": self.wide}

    def as_dict(self) -> dict[str, Any]:
        return {"median_ms": self.median, "n": self.n, "min_ms": min(self.times_ms), "max_ms": max(self.times_ms),
                "spread": self.spread, "wide_spread": self.wide}


def spread_note(flags: Sequence[Optional[bool]]) -> Optional[str]:
    """``SPREAD_NOTE`` when any cell was flagged, else None."""
    return SPREAD_NOTE if any(bool(f) for f in flags) else None


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_step_times(step: Callable[[int], Any], reps: int, first: int = 0) -> list[float]:
    """Each of ``reps`` steps' wall-clock time in ms (``step(first)``, ``step(first + 1)``, ...): the CPU's timer,
    where nothing runs asynchronously."""
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        step(first + i)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def cuda_step_times(step: Callable[[int], Any], device: torch.device, reps: int, first: int = 0) -> list[float]:
    """Each of ``reps`` steps' time in ms (``step(first)``, ``step(first + 1)``, ...): CUDA events, the L2 flushed
    before each step, the steps enqueued back to back (the host's time: ``host_enqueue_ms``)."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        starts[i].record()
        step(first + i)
        ends[i].record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def host_enqueue_ms(step: Callable[[], Any], device: torch.device, reps: int) -> list[float]:
    """The host's ms to enqueue ``step()``, once per rep: each step starts on an idle device (synchronised before
    the clock starts, so a full launch queue never blocks the host) and the clock stops when ``step`` returns,
    without waiting for the device. On the CPU nothing is asynchronous: this is the step's wall time."""
    if reps < 1:
        raise ValueError(f"host_enqueue_ms needs reps >= 1, got {reps}")
    cuda = torch.device(device).type == "cuda"
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)
    return times
