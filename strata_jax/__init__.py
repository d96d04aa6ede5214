"""strata-jax: run Mixture-of-Experts models larger than GPU memory, from GGUF, in JAX."""

__version__ = "0.1.0"
