"""polyspec.decode: the n-level lossless chain decoder, its Llama-family engine and int4 kernels."""
