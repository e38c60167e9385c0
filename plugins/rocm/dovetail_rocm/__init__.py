"""Dovetail's ROCm plugin: the ``rocm`` platform and the ``ROCM_AITER`` attention backend.

Importing this package imports neither torch's device runtime nor ``aiter``.
"""
