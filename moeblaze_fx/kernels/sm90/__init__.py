"""The sm_90 (Hopper) kernels in Gluon: :mod:`.common` (the guarded Gluon imports and the helpers the kernels share),
:mod:`.down`, :mod:`.gather` (the gathering GEMM: forward up and backward dh) and :mod:`.dw`."""
