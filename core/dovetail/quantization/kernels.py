"""Kernels that quantization methods call, in plain torch; platforms override them.

A quantization method defines a checkpoint format and its math; the fast
kernels belong to the hardware. :meth:`dovetail.platform.Platform.quant_kernels`
returns a subclass of :class:`QuantKernels` whose overrides must match these
definitions (the conformance kit checks a method's round trip on them).
"""

from __future__ import annotations


class QuantKernels:
    """Reference (plain torch) kernels used by the quantization methods."""

    name = "torch"
