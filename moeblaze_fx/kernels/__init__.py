"""The expert kernels, cut by GEMM unit and by backend:

- ``forward.py`` / ``backward.py``: the forward's and the backward's orchestration (windows, transients, which unit
  runs where), ``expert_forward`` and ``expert_backward``;
- ``triton/``: the portable Triton kernels, one module per unit (``up``, ``down``, ``dh``, ``dw``, ``combine``) and
  ``common`` (their shared device and host helpers);
- ``sm90/``: the Gluon kernels for Hopper (``down``, ``gather``: up and dh's GEMM, ``dw``) and ``common``;
- ``dispatch.py`` (the routing plan), ``reference.py`` (plain PyTorch ground truth), ``act.py`` (the activations'
  arithmetic), ``tables.py`` (weight pointer tables), ``autotune.py``, ``launch.py`` and ``program.py`` (an
  operator call replayed from the record of an earlier call with the same signature).
"""
