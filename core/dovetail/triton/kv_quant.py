"""Keys and values into and out of an FP8 (e4m3) KV cache, as vLLM stores them.

The cache holds ``value / scale`` saturated to e4m3's range (±448) and rounded to the nearest e4m3 number;
reading gives ``fp8 * scale`` back, in the dtype the attention computes in. ``scale`` is per tensor: one for
a layer's keys, one for its values (1.0 unless the checkpoint carries calibrated ``k_scale``/``v_scale``).
Other caches store and load values unchanged (a cast to the cache's dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: The largest finite e4m3 (``float8_e4m3fn``) value.
FP8_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def to_cache(x, scale, dtype: tl.constexpr, KV_FP8: tl.constexpr, ROUND_FP8: tl.constexpr):
    """``x`` as the cache stores it (``dtype``: the cache's element type)."""
    if KV_FP8:
        y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_E4M3_MAX), FP8_E4M3_MAX)
        if ROUND_FP8:
            # Triton's CPU interpreter rounds some values to the wrong power of two when it converts to e4m3;
            # rounding here first (to nearest even, on e4m3's grid: 3 mantissa bits, subnormal below 2**-6)
            # leaves it only exact values to convert. On GPUs the conversion instruction does the same.
            bits = y.to(tl.int32, bitcast=True)
            exponent = ((bits >> 23) & 0xFF) - 127
            step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
            y = ((y / step + 12582912.0) - 12582912.0) * step  # 1.5 * 2**23: round half to even
        y = y.to(dtype)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def from_cache(x, scale, dtype: tl.constexpr, KV_FP8: tl.constexpr):
    """A cache tile ``x`` in ``dtype``, the dtype the attention computes in (FP8 dequantised with ``scale``)."""
    # One return whose type is the same either way: Triton checks every return of a function, a static
    # branch's too.
    if KV_FP8:
        y = (x.to(tl.float32) * scale).to(dtype)
    else:
        y = x.to(dtype)
    return y
