"""Layers models are built from: each one a seam for quantization, attention backends or fused ops."""
