"""What the benchmarks' results share: JSON output, and the markdown cells of numbers and byte sizes."""
from __future__ import annotations

import json
from typing import Optional

__all__ = ["JsonResult", "number_cell", "mb_cell"]


class JsonResult:
    """A result with ``to_dict()`` gets ``to_json``: the dict as indented JSON (values JSON does not know as
    their ``str``), also written to ``path`` when given."""

    def to_json(self, path: Optional[str] = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, default=str)
        if path:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text


def number_cell(value: Optional[float], spec: str, tiny: bool = False) -> str:
    """``value`` formatted with ``spec``, ``"-"`` for None. ``tiny``: a nonzero value that a fixed-point ``spec``
    would show as zero gets two significant digits instead (tiny sizes on the CPU)."""
    if value is None:
        return "-"
    if tiny and spec.endswith("f") and value != 0 and abs(value) < 10 ** -int(spec[1:-1]):
        return format(value, ".2g")
    return format(value, spec)


def mb_cell(n: Optional[int], spec: Optional[str] = None) -> str:
    """Bytes as MiB with ``spec``, ``"-"`` for None; no ``spec``: whole MiB from 10 MiB up, two decimals below."""
    if n is None:
        return "-"
    if spec is None:
        spec = ".0f" if n >= 10 * 2 ** 20 else ".2f"
    return format(n / 2 ** 20, spec)
