"""Quantized weights: block formats, the quantized linear (kernel choice by row count),
GGUF tensor mapping, quantization at load, and fp8 on CUDA."""
