"""Weights kept in the quantized formats llama.cpp's GGUF files store them in."""
