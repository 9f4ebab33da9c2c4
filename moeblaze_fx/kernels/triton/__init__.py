"""The portable Triton kernels, one module per GEMM unit (:mod:`.up`, :mod:`.down`, :mod:`.dh`, :mod:`.dw`,
:mod:`.combine`), and :mod:`.common`, the device and host helpers they share."""
