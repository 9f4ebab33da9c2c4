"""Every option of the backend, in one dataclass.

Options reach the backend through ``torch.compile(model, backend="moeblaze", options={...})``; the
defaults can be changed for a block of code with ``moeblaze_fx.patch(checkpoint="recompute")``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

__all__ = ["MoEBlazeConfig", "patch", "current", "from_options"]

CHECKPOINT_CHOICES = ("activations", "recompute", "auto")


@dataclasses.dataclass(frozen=True)
class MoEBlazeConfig:
    # Memory policy of every rewritten region: "activations" saves x, the ids, the combine weights and
    # the gate/up pre-activations; "recompute" saves x, the ids and the weights and recomputes the up
    # projection in backward; "auto" picks "recompute" for a region whose pre-activations would
    # exceed `memory_budget` bytes, "activations" otherwise.
    checkpoint: str = "activations"
    # Bytes of pre-activations a region may save under checkpoint="auto".
    memory_budget: int = 1 << 30
    # Bytes of transient per-slot buffers the operator may hold at once: the Triton path runs windows of
    # the expert-sorted slots that fit, the PyTorch path chunks of tokens. 0: everything at once.
    transient_budget: int = 2 << 30
    # Prove each candidate numerically (forward and every gradient, small random inputs at compile
    # time) before rewriting it. Off: shapes and structure alone decide.
    verify: bool = True
    # Path of a JSON file the compile report is written to (appended per compiled graph), or None.
    report: Optional[str] = None
    # Hand the rewritten graph to Inductor (compile_fx). Off: run the rewritten FX graph eagerly.
    inductor: bool = True
    # Run the passes at all. Off: the backend is the default Inductor backend.
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.checkpoint not in CHECKPOINT_CHOICES:
            raise ValueError(f"moeblaze: checkpoint must be one of {CHECKPOINT_CHOICES}, got {self.checkpoint!r}")
        for budget in ("memory_budget", "transient_budget"):
            value = getattr(self, budget)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"moeblaze: {budget} must be a non-negative number of bytes, got {value!r}")
        for flag in ("verify", "inductor", "enabled"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"moeblaze: option {flag!r} must be True or False, got {getattr(self, flag)!r}")
        if self.report is not None and not isinstance(self.report, str):
            raise TypeError(f"moeblaze: option 'report' must be a file path (str) or None, got {self.report!r}")


_FIELDS = tuple(f.name for f in dataclasses.fields(MoEBlazeConfig))
_current = MoEBlazeConfig()


def current() -> MoEBlazeConfig:
    return _current


def from_options(options: Optional[dict[str, Any]]) -> MoEBlazeConfig:
    """The config in force, updated by ``torch.compile(..., options=...)``; unknown keys are an error."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(_FIELDS))
    if unknown:
        raise ValueError(f"moeblaze: unknown option(s) {unknown}; valid options are {list(_FIELDS)}")
    return dataclasses.replace(_current, **options)


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[MoEBlazeConfig]:
    """Change the defaults inside a ``with`` block: ``with moeblaze_fx.patch(verify=False): ...``."""
    global _current
    saved = _current
    _current = from_options(changes)
    try:
        yield _current
    finally:
        _current = saved
