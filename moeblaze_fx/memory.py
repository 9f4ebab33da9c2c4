"""Activation memory accounting: the bytes autograd keeps for backward.

One measure for the report's "before", the demo, ``moeblaze bench`` and ``moeblaze compare``: the
distinct storages packed by ``torch.autograd.graph.saved_tensors_hooks`` while a forward runs,
the storages of ``exclude`` (the parameters) left out, the inputs included.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import Tensor

__all__ = ["SavedTensorBytes", "saved_activation_bytes"]


class SavedTensorBytes:
    """``with SavedTensorBytes(params) as meter: loss = model(x)`` then ``meter.total``."""

    def __init__(self, exclude: Iterable[Tensor] = ()):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @torch._dynamo.disable
    def _pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.exclude and ptr != 0:  # 0: an empty tensor owns no memory
            self.storages[ptr] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def saved_activation_bytes(forward: Callable[[], Any], exclude: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages packed for backward during ``forward()``."""
    with SavedTensorBytes(exclude) as meter:
        result = forward()
    del result
    return meter.total
