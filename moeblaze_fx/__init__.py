"""moeblaze-fx: a torch.compile backend that rewrites Mixture-of-Experts layers into MoEBlaze operators."""
from .config import KernelOptions, MoEBlazeConfig, patch
from .ops import moe_ffn
from . import report
from . import backend  # noqa: F401  (hashes the package's source as imported, for its compile-cache tag)
from .report import RegionRecord, last_report

__all__ = ["MoEBlazeConfig", "KernelOptions", "patch", "moe_ffn", "RegionRecord", "last_report", "report", "compare"]


def __getattr__(name: str):
    # compare() lives in the benchmark harness, which `import moeblaze_fx` does not load: imported on first use.
    if name == "compare":
        from .bench.compare import compare

        return compare
    raise AttributeError(f"module 'moeblaze_fx' has no attribute {name!r}")
