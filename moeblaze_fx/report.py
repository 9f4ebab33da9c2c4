"""The compile report: one record per candidate region, rewritten or left alone (and why).

Reached through
* the ``moeblaze_fx`` logger: a compact table at INFO (``TORCH_LOGS="+moeblaze_fx"`` or
  ``logging.getLogger("moeblaze_fx").setLevel(logging.INFO)``);
* a structured trace artifact named ``moeblaze_report`` (``TORCH_TRACE=dir``, read with tlparse);
* the Python API: ``moeblaze_fx.last_report()`` (records of the most recent compiled graph) and
  ``moeblaze_fx.report.all_reports()`` (every graph compiled in this process);
* ``options={"report": "path.json"}``: the records appended to a JSON file.

Saved-activation bytes: "before" is measured while the region is proven (``saved_tensors_hooks``
over the original region at its traced sizes, distinct storages, parameters excluded); "after" is
what the operator saves, from shapes: ``x`` (T·d), ``ids`` and ``weights`` (T·K each), on the Triton path
(CUDA, 16-bit floats) the forward's dispatch plan (int32: 2·T·K plus E+1 offsets and two tile tables)
and, under the ``"activations"`` policy, the pre-activations (T·K·2h; T·K·h for a plain activation).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Optional

__all__ = ["RegionRecord", "last_report", "all_reports", "format_table", "emit", "write_json", "discard_last"]

log = logging.getLogger("moeblaze_fx")
_reports: list[list["RegionRecord"]] = []


@dataclasses.dataclass
class RegionRecord:
    status: str  # "rewritten" or "skipped"
    source: str  # user file:line of the region's output
    idiom: str
    T: Any = None  # int, or the symbolic expression as a string
    d: Optional[int] = None
    h: Optional[int] = None
    E: Optional[int] = None
    K: Optional[int] = None
    dtype: Optional[str] = None
    policy: Optional[str] = None
    layout: Optional[str] = None
    saved_bytes_before: Optional[int] = None
    saved_bytes_after: Optional[int] = None
    reason: Optional[str] = None
    check: Optional[str] = None  # how it was proven

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def last_report() -> list[RegionRecord]:
    """The records of the most recently compiled graph (empty before any compile)."""
    return list(_reports[-1]) if _reports else []


def discard_last() -> None:
    """Forget the most recent graph's records (its compile was abandoned)."""
    if _reports:
        _reports.pop()


def all_reports() -> list[list[RegionRecord]]:
    return [list(r) for r in _reports]


def _bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_table(records: list[RegionRecord]) -> str:
    """A compact, fixed-format table (golden-tested)."""
    if not records:
        return "moeblaze: no MoE candidates in this graph"
    rewritten = sum(r.status == "rewritten" for r in records)
    lines = [f"moeblaze: {rewritten} of {len(records)} MoE candidate(s) rewritten"]
    for i, r in enumerate(records):
        dims = f"T={r.T} d={r.d} h={r.h} E={r.E} K={r.K} {r.dtype}"
        lines.append(f"  [{i}] {r.status:<9} {r.source}  {r.idiom}")
        if r.status == "rewritten":
            lines.append(f"      {dims}  policy={r.policy}  saved for backward: {_bytes(r.saved_bytes_before)} -> "
                         f"{_bytes(r.saved_bytes_after)}")
            lines.append(f"      layout: {r.layout}; check: {r.check}")
        else:
            if r.d is not None:
                lines.append(f"      {dims}")
            lines.append(f"      reason: {r.reason}")
    return "\n".join(lines)


def emit(records: list[RegionRecord]) -> None:
    """Log the records, emit the trace artifact and keep them for ``last_report()``."""
    _reports.append(list(records))
    if records:
        log.info("%s", format_table(records))
    payload = [r.as_dict() for r in records]
    try:
        from torch._logging import trace_structured

        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "moeblaze_report", "encoding": "json"},
            payload_fn=lambda: json.dumps(payload),
        )
    except ImportError:  # pragma: no cover - every supported torch has it
        pass


def write_json(records: list[RegionRecord], path: str) -> None:
    """Append one graph's records to the JSON list in ``path``."""
    existing: list[Any] = []
    if os.path.exists(path):
        with open(path) as f:
            existing = json.load(f)
    existing.append({"regions": [r.as_dict() for r in records]})
    with open(path, "w") as f:
        json.dump(existing, f, indent=2)
