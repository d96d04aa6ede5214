"""The leaf layer: containers and vocabulary every other package shares (errors, byte units, shape
legend, the quantized-tensor container, the expert byte layout, counters and provider protocol).

Imports nothing of strata_jax outside core (tests/test_layering.py holds that)."""
