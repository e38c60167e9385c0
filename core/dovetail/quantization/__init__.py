"""Quantization methods (checkpoint formats and their math) and the kernels they call.

- :mod:`~dovetail.quantization.base` -- the :class:`QuantMethod` contract.
- :mod:`~dovetail.quantization.kernels` -- :class:`QuantKernels`, plain-torch kernels platforms override;
  :mod:`~dovetail.quantization.fp8_scaled_mm` and :mod:`~dovetail.quantization.gpu_kernels` are overrides.
- methods: :mod:`~dovetail.quantization.unquantized` (``none``), :mod:`~dovetail.quantization.fp8`,
  :mod:`~dovetail.quantization.int8`, :mod:`~dovetail.quantization.gptq`, :mod:`~dovetail.quantization.awq`,
  :mod:`~dovetail.quantization.compressed_tensors`.
- shared pieces: :mod:`~dovetail.quantization.quant_ops` (quantize, pack), :mod:`~dovetail.quantization.params`
  (parameters and shard loaders), :mod:`~dovetail.quantization.matching` (module lists),
  :mod:`~dovetail.quantization.wna16` (the packed 4/8-bit layout GPTQ and AWQ load into).
"""
