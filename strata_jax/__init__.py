"""strata-jax: run Mixture-of-Experts models larger than GPU memory, from GGUF, in JAX.

    import strata_jax
    model = strata_jax.load("model.gguf")          # or load() for the embedded default model
    print(model.generate("def fib(n):", max_tokens=64, temperature=0).text)
"""

__version__ = "0.1.0"

from strata_jax.runtime import configure_xla  # noqa: E402

configure_xla()  # before anything imports jax's backend

from strata_jax.core.errors import StrataError  # noqa: E402
from strata_jax.engine.model import Generation, GenerationChunk, Model, load  # noqa: E402
from strata_jax.engine.session import Session  # noqa: E402

__all__ = ["load", "Model", "Session", "Generation", "GenerationChunk", "StrataError", "__version__"]
