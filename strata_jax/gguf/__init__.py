"""GGUF files: the reader (metadata, memory-mapped tensors), the GGML block layout, and the jnp
dequantizers. Imports only strata_jax.core and the `gguf` pip package."""
