"""Triton-language GPU kernels for the paged, quantized KV cache."""
