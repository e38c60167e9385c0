"""The core's Triton kernels, shared by the GPU plugins (CUDA, ROCm, XPU).

- :mod:`dovetail.triton.kv_cache_write` -- store new keys and values at their slots
  (:mod:`dovetail.triton.kv_quant`: into an FP8 cache, scaled).
- :mod:`dovetail.triton.paged_attention` -- one paged-attention kernel for prefill,
  chunked prefill and decode (with a split-KV variant for small decode batches).
- :mod:`dovetail.triton.norm`, :mod:`dovetail.triton.rotary`,
  :mod:`dovetail.triton.activation` -- fused ops, gathered in
  :class:`dovetail.triton.fused_ops.TritonFusedOps`.

Importing this package does not import triton; the kernel modules do, and
importing them never initialises a device.

Triton runs kernels in its CPU interpreter when ``TRITON_INTERPRET=1`` is set
before ``triton`` itself is first imported in the process: its own library
functions (``tl.cdiv``, ``tl.max`` ...) are built in one mode at that moment, so
setting the variable later has no effect (:func:`interpreter_active` tells).
"""

from __future__ import annotations

_triton_error: str | None = None
_checked = False


def triton_missing_reason() -> str | None:
    """Why triton cannot be used in this process, or None when it imports."""
    global _triton_error, _checked
    if not _checked:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
        except Exception as exc:  # an absent package, or a broken install
            _triton_error = (f"triton cannot be imported ({type(exc).__name__}: {exc}); "
                             "install it with: pip install 'dovetail[triton]'")
        _checked = True
    return _triton_error


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (and >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def interpreter_active() -> bool:
    """Whether triton, as imported in this process, runs kernels in its CPU interpreter."""
    import triton.language as tl

    return type(tl.cdiv).__name__ == "InterpretedFunction"


def unaligned(*pointer_names: str) -> dict:
    """``triton.jit`` options that keep these pointer arguments from being specialised on their alignment.

    For per-step index arrays that callers slice (``positions[n:]``, ``slot_mapping[n:]``): an odd offset
    would otherwise compile a new kernel in the middle of serving. Empty where triton lacks the option.
    """
    import inspect

    import triton

    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        return {"do_not_specialize_on_alignment": list(pointer_names)}
    return {}
