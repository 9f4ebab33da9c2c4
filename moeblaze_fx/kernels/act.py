"""The expert activations' elementwise arithmetic, in fp32, shared by the Triton kernels (``triton.up``,
``triton.dh``) and the Gluon ones (``sm90.gather``, which call these functions from their epilogues): one copy, so
the two compute each H, dL/dA and dL/dB with the same operations and give bitwise the same results.

``ACT`` is a constexpr, one of :data:`ACT_CODES`' values. Clamps keep NaN (Triton's plain minimum and maximum return
the operand that is not NaN on the GPU, and hid a NaN token); tanh is built from exp (Triton's core has no tanh, and
the interpreter runs no libdevice).
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["ACT_CODES", "act_forward", "act_backward"]

# The ACT constexpr of the kernels (the GATED constexpr says whether there is an up projection).
ACT_CODES = {"swiglu": 0, "geglu": 1, "swiglu_oai": 2, "silu": 3, "gelu": 4, "relu": 5, "swiglu_clamp": 6,
             "relu2": 7, "geglu_tanh": 8, "gelu_tanh": 9, "swiglu_softcap": 10}
_SWIGLU = tl.constexpr(0)
_GEGLU = tl.constexpr(1)
_SWIGLU_OAI = tl.constexpr(2)
_SILU = tl.constexpr(3)
_GELU = tl.constexpr(4)
_RELU = tl.constexpr(5)
_SWIGLU_CLAMP = tl.constexpr(6)
_RELU2 = tl.constexpr(7)
_GEGLU_TANH = tl.constexpr(8)
_GELU_TANH = tl.constexpr(9)
_SWIGLU_SOFTCAP = tl.constexpr(10)


@triton.jit
def _gelu(v):
    """erf GELU (torch's default ``F.gelu``), fp32."""
    return 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))


@triton.jit
def _gelu_grad(v):
    cdf = 0.5 * (1.0 + tl.math.erf(v * 0.7071067811865476))
    return cdf + v * tl.exp(-0.5 * v * v) * 0.3989422804014327


@triton.jit
def _gelu_tanh_cdf(v):
    """0.5 (1 + tanh(u)) = sigmoid(2u), u = sqrt(2/pi) (v + 0.044715 v^3): no cancellation for negative v."""
    return tl.sigmoid(1.5957691216057308 * (v + 0.044715 * v * v * v))


@triton.jit
def _gelu_tanh(v):
    """tanh-approximated GELU (``F.gelu(v, approximate="tanh")``), fp32: v * :func:`_gelu_tanh_cdf`."""
    return v * _gelu_tanh_cdf(v)


@triton.jit
def _gelu_tanh_grad(v):
    """d/dv of :func:`_gelu_tanh`: s + 2 v s (1 - s) u', s = sigmoid(2u), u' = sqrt(2/pi) (1 + 3 * 0.044715 v^2)."""
    s = _gelu_tanh_cdf(v)
    return s + v * s * (1.0 - s) * (1.5957691216057308 * (1.0 + 0.134145 * v * v))


@triton.jit
def _tanh(v):
    """tanh in fp32 from exp (Triton's core has no tanh, and the interpreter runs no libdevice): (1 - e) / (1 + e),
    e = exp(-2|v|), and below |v| = 0.1, where 1 - e cancels, the odd Taylor series to v^7 (relative error under
    1e-9 there). NaN stays NaN."""
    m = tl.abs(v)
    e = tl.exp(-2.0 * m)
    v2 = v * v
    small = m * (1.0 + v2 * (-0.3333333333333333 + v2 * (0.13333333333333333 + v2 * -0.05396825396825397)))
    t = tl.where(m < 0.1, small, (1.0 - e) / (1.0 + e))
    return tl.where(v < 0.0, -t, t)


@triton.jit
def _clamp_max(v, limit):
    """``torch.clamp(v, max=limit)``: a NaN stays NaN (the GPU's plain minimum would return the limit, and hide it)."""
    return tl.minimum(v, limit, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _clamp(v, limit):
    """``torch.clamp(v, -limit, limit)``, NaN kept as in :func:`_clamp_max`."""
    return _clamp_max(tl.maximum(v, -limit, propagate_nan=tl.PropagateNan.ALL), limit)


@triton.jit
def act_forward(a, b, alpha, limit, ACT: tl.constexpr):
    """H from the fp32 pre-activations: gate ``a`` and (gated activations) up ``b``."""
    if ACT == _SWIGLU:
        hid = a * tl.sigmoid(a) * b
    elif ACT == _GEGLU:
        hid = _gelu(a) * b
    elif ACT == _GEGLU_TANH:
        hid = _gelu_tanh(a) * b
    elif ACT == _SWIGLU_OAI:
        g = _clamp_max(a, limit)
        u = _clamp(b, limit)
        hid = (u + 1.0) * (g * tl.sigmoid(alpha * g))
    elif ACT == _SWIGLU_CLAMP:
        g = _clamp_max(a, limit)
        hid = g * tl.sigmoid(g) * _clamp(b, limit)
    elif ACT == _SWIGLU_SOFTCAP:  # alpha: the gate's cap, limit: the up's
        hid = (_tanh(a / alpha) * alpha) * tl.sigmoid(a) * (_tanh(b / limit) * limit)
    elif ACT == _SILU:
        hid = a * tl.sigmoid(a)
    elif ACT == _GELU:
        hid = _gelu(a)
    elif ACT == _GELU_TANH:
        hid = _gelu_tanh(a)
    elif ACT == _RELU2:
        r = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)
        hid = r * r
    else:
        tl.static_assert(ACT == _RELU)
        hid = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)  # F.relu keeps NaN
    return hid


@triton.jit
def act_backward(a, b, d_hid, alpha, limit, ACT: tl.constexpr):
    """(H, dL/da, dL/db) from the fp32 pre-activations and dL/dH, recomputing what the forward computed.
    Clamps pass the gradient inside the closed interval (as ``torch.clamp``). dL/db is ``d_a`` again for
    plain activations (never used)."""
    if ACT == _SWIGLU:
        sig = tl.sigmoid(a)
        silu = a * sig
        hid = silu * b
        d_a = d_hid * b * (sig * (1.0 + a * (1.0 - sig)))
        d_b = d_hid * silu
    elif ACT == _GEGLU:
        gelu = _gelu(a)
        hid = gelu * b
        d_a = d_hid * b * _gelu_grad(a)
        d_b = d_hid * gelu
    elif ACT == _GEGLU_TANH:
        gelu = _gelu_tanh(a)
        hid = gelu * b
        d_a = d_hid * b * _gelu_tanh_grad(a)
        d_b = d_hid * gelu
    elif ACT == _SWIGLU_OAI:
        g = _clamp_max(a, limit)
        sig = tl.sigmoid(alpha * g)
        glu = g * sig
        u1 = _clamp(b, limit) + 1.0
        hid = u1 * glu
        d_a = tl.where(a <= limit, d_hid, 0.0) * u1 * (sig + alpha * glu * (1.0 - sig))
        d_b = tl.where(tl.abs(b) <= limit, d_hid, 0.0) * glu
    elif ACT == _SWIGLU_CLAMP:
        g = _clamp_max(a, limit)
        sig = tl.sigmoid(g)
        silu = g * sig
        u = _clamp(b, limit)
        hid = silu * u
        d_a = tl.where(a <= limit, d_hid, 0.0) * u * (sig * (1.0 + g * (1.0 - sig)))
        d_b = tl.where(tl.abs(b) <= limit, d_hid, 0.0) * silu
    elif ACT == _SWIGLU_SOFTCAP:
        tg = _tanh(a / alpha)
        tu = _tanh(b / limit)
        sig = tl.sigmoid(a)
        gate = (tg * alpha) * sig
        up = tu * limit
        hid = gate * up
        d_a = d_hid * up * ((1.0 - tg * tg) * sig + (tg * alpha) * sig * (1.0 - sig))
        d_b = d_hid * gate * (1.0 - tu * tu)
    elif ACT == _SILU:
        sig = tl.sigmoid(a)
        hid = a * sig
        d_a = d_hid * (sig * (1.0 + a * (1.0 - sig)))
        d_b = d_a
    elif ACT == _GELU:
        hid = _gelu(a)
        d_a = d_hid * _gelu_grad(a)
        d_b = d_a
    elif ACT == _GELU_TANH:
        hid = _gelu_tanh(a)
        d_a = d_hid * _gelu_tanh_grad(a)
        d_b = d_a
    elif ACT == _RELU2:
        r = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)
        hid = r * r
        d_a = d_hid * 2.0 * r
        d_b = d_a
    else:
        tl.static_assert(ACT == _RELU)
        hid = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)  # F.relu keeps NaN
        d_a = tl.where(a > 0.0, d_hid, 0.0)
        d_b = d_a
    return hid, d_a, d_b
