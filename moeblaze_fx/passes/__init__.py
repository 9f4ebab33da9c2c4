"""The passes, one module a step: normalize -> find -> extract -> prove -> rewrite; ``pipeline`` drives them."""
from .pipeline import format_graph, run_passes, saved_bytes_after

__all__ = ["run_passes", "saved_bytes_after", "format_graph"]
