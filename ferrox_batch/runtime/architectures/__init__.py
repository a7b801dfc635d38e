"""The decoder and its pieces: layer weights, attention, RoPE, linear layers, the fused MLP, the C layer stack."""
