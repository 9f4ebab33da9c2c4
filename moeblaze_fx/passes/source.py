"""Where a node came from: the ``file:line`` of the model's own code in a node's stack trace, for the report."""
from __future__ import annotations

import os

import torch.fx as fx

__all__ = ["is_plumbing", "source_of", "short_path"]

# Frames from these places are library plumbing, not the model's source.
_PLUMBING = (os.path.join("torch", ""), os.path.join("transformers", "integrations", ""))


def is_plumbing(path: str) -> bool:
    """A frame of the libraries above, installed (judged below site-packages: a virtual environment may live in a
    folder named torch) or checked out."""
    marker = "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1].startswith(_PLUMBING)
    return any(os.sep + p in path for p in _PLUMBING)


def source_of(*nodes: fx.Node) -> str:
    """``file:line`` of the innermost frame of a node's stack trace that is the model's own code: the first of
    ``nodes`` with such a frame (torch 2.11 records only library frames for some nodes in a checkpoint's body)."""
    first = None
    for node in nodes:
        frames = []
        for line in (node.meta.get("stack_trace") or "").strip().splitlines():
            line = line.strip()
            if line.startswith('File "'):
                path, _, rest = line[6:].partition('", line ')
                frames.append(f"{path}:{rest.split(',')[0]}")
        for frame in reversed(frames):
            if not is_plumbing(frame):
                return short_path(frame)
        first = first or (frames[-1] if frames else None)
    return short_path(first) if first else "<unknown>"


def short_path(frame: str) -> str:
    """Paths under the working directory relative to it; installed packages from their package."""
    marker = "site-packages" + os.sep
    if marker in frame:
        return frame.split(marker, 1)[1]
    cwd = os.getcwd() + os.sep
    return frame[len(cwd):] if frame.startswith(cwd) else frame
