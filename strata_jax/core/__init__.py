"""Foundations every layer of strata-jax may use: they import nothing of strata_jax outside core."""
