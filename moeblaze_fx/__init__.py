"""moeblaze-fx: a torch.compile backend that rewrites Mixture-of-Experts layers into MoEBlaze operators."""
from .config import MoEBlazeConfig, patch
from .ops import moe_ffn
from . import report
from . import backend  # noqa: F401  (hashes the package's source as imported, for its compile-cache tag)
from .bench.compare import compare
from .report import RegionRecord, last_report

__all__ = ["MoEBlazeConfig", "patch", "moe_ffn", "RegionRecord", "last_report", "report", "compare"]
