"""Dovetail's Intel XPU plugin: the ``xpu`` platform on upstream ``torch.xpu``.

Importing this package starts neither the SYCL nor the Level Zero runtime.
"""
