"""The CPU kernels' Python side: linears on exact quantized blocks, RMSNorm, the screened
LM-head argmax (the C++ sources are in eagle_serve/kernels)."""
