"""Quantized weights: GGML block formats (GGUF files) and Qwen's block-scaled FP8.

`ggml` dequantizes GGML blocks in torch (bit for bit what the `gguf` package computes),
`kquants` quantizes to the K-quant formats (the presets' GGUF files), `fp8` quantizes and
dequantizes e4m3 weights with per-[128, 128]-block scales. On the CPU weights are dequantized
once at load; the GPU keeps them packed (`engine/ops/gpu/quant.py`).
"""
