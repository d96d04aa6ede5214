"""Token sampling on the device, in llama.cpp's default order: top-k, top-p and min-p filter the
temperature-1 distribution, then temperature scales what is left. Parameters are traced arrays, so
changing them per request compiles nothing; temperature <= 0 means greedy.

Shape legend: B batch, V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from strata_jax.errors import ConfigError
from strata_jax.model.weights import pytree_dataclass


@pytree_dataclass
class SamplingParams:
    temperature_B: jax.Array
    top_p_B: jax.Array
    top_k_B: jax.Array  # <= 0: off
    min_p_B: jax.Array

    @classmethod
    def make(cls, batch: int = 1, temperature=0.8, top_p=0.95, top_k=40, min_p=0.05) -> "SamplingParams":
        validate_sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        full = lambda v, dt: jnp.full((batch,), v, dt)  # noqa: E731
        return cls(full(temperature, jnp.float32), full(top_p, jnp.float32), full(top_k, jnp.int32), full(min_p, jnp.float32))


def validate_sampling(*, temperature=None, top_p=None, top_k=None, min_p=None) -> None:
    """Reject values that would make sampling meaningless, saying what range is valid."""
    checks = [
        ("temperature", temperature, lambda v: 0 <= v <= 100, "a number >= 0 (0 = greedy)"),
        ("top_p", top_p, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        ("top_k", top_k, lambda v: float(v).is_integer() and v >= 0, "an integer >= 0 (0 = off)"),
        ("min_p", min_p, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ]
    for name, value, ok, want in checks:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise ConfigError(f"{name}={value!r} is invalid: it must be {want}.")


def sample(logits_BV: jax.Array, key: jax.Array, sp: SamplingParams) -> jax.Array:
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    # sorting the vocabulary costs more than a small model's forward pass on CPU (~40 ms for 152k
    # entries): skip it when no row samples. Under vmap the branches become a select and both run.
    return jax.lax.cond(jnp.all(sp.temperature_B <= 0), lambda: greedy_B,
                        lambda: jnp.where(sp.temperature_B <= 0, greedy_B, _draw(logits_BV, key, sp)))


def _draw(logits_BV: jax.Array, key: jax.Array, sp: SamplingParams) -> jax.Array:
    V = logits_BV.shape[-1]
    order_BV = jnp.argsort(-logits_BV, axis=-1)
    sorted_BV = jnp.take_along_axis(logits_BV, order_BV, axis=-1)
    rank = jnp.arange(V)[None, :]
    top_k = jnp.where(sp.top_k_B <= 0, V, sp.top_k_B)[:, None]
    keep = rank < top_k
    probs = jax.nn.softmax(jnp.where(keep, sorted_BV, -jnp.inf), axis=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays)
    keep = keep & ((jnp.cumsum(probs, axis=-1) - probs) < sp.top_p_B[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_BV, -jnp.inf), axis=-1)
    keep = keep & (probs >= sp.min_p_B[:, None] * probs[:, :1])

    temp = jnp.maximum(sp.temperature_B, 1e-6)[:, None]
    scaled = jnp.where(keep, sorted_BV / temp, -jnp.inf)
    choice_B = jax.random.categorical(key, scaled, axis=-1)
    return jnp.take_along_axis(order_BV, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sample_rows(logits_BV: jax.Array, keys_B: jax.Array, sp: SamplingParams) -> jax.Array:
    """Each row sampled with its own key (uint32 [B, 2]) exactly as sample() draws a batch of one, so a
    seeded request gives the same tokens alone or batched with others."""

    def one(logits_V, key, sp_row):
        return sample(logits_V[None], key, jax.tree.map(lambda a: a[None], sp_row))[0]

    greedy_B = jnp.argmax(logits_BV.astype(jnp.float32), axis=-1).astype(jnp.int32)
    return jax.lax.cond(jnp.all(sp.temperature_B <= 0), lambda: greedy_B,
                        lambda: jax.vmap(one)(logits_BV, keys_B, sp))
