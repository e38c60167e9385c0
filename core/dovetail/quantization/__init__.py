"""Quantization methods: the contract and the unquantized method."""
