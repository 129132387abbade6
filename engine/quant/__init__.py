"""Quantized weights: GGML block formats (GGUF files) and Qwen's block-scaled FP8.

`ggml` dequantizes GGML blocks in torch (bit for bit what the `gguf` package computes), `fp8`
quantizes and dequantizes e4m3 weights with per-[128, 128]-block scales. The presets' K-quant
GGUF files come from llama.cpp's `llama-quantize` (`peer/gguf_export.py`); the CPU tests encode
K-quant blocks themselves (`tests/engine/kquants.py`). On the CPU weights are dequantized once at
load; the GPU keeps them packed (`engine/ops/gpu/quant.py`).
"""
