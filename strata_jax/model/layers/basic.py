"""What every layer kind shares: stacked projections of one input (Projections) and the product that
dequantizes GGML blocks inside the program (linear, project), RMSNorm, the dense SwiGLU MLP and the LM head.

Shape legend: strata_jax/core/shapes.py
Norms run in float32 whatever the compute dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.core.qtensor import QTensor
from strata_jax.gguf.layout import layout
from strata_jax.gguf.quant import dequant
from strata_jax.model import qmatvec
from strata_jax.model.kernels import Kernels


@struct.dataclass
class Projections:
    """Several projections of one input. Matrices of one GGML type that follow each other are stacked
    row-wise into one QTensor (GGML rows are quantized independently, so the bytes just concatenate):
    decode then runs one product per type, not one per matrix (q, k, v of the B30 shape: one fused
    kernel instead of three products; Qwen2.5's Q4_K_M file: one, or two where v is Q8_0 and q, k Q5_0). Biases are stacked
    the same way (None for a group without any). sizes: per group, the output rows of its matrices."""

    mats: tuple[QTensor, ...]
    biases: tuple[jax.Array | None, ...]
    sizes: tuple[tuple[int, ...], ...] = struct.field(pytree_node=False)


@struct.dataclass
class MLPParams:
    """A dense SwiGLU MLP: also the shape of qwen2moe's shared expert."""

    gate_up: Projections  # gate [F, D], up [F, D]
    w_down: QTensor  # [D, F]


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w).astype(x.dtype)


def linear(x: jax.Array, w: QTensor, kernels: Kernels, bias: jax.Array | None = None) -> jax.Array:
    """x @ W.T with W dequantized inside the jitted program (W is [out, in] GGML blocks): for a few token
    rows (decode) by the fused kernel that reads the blocks once (qmatvec), else dequantize + matmul."""
    n_rows = math.prod(x.shape[:-1])
    if qmatvec.linear_ok(w, n_rows, kernels):
        y = qmatvec.linear(x.reshape(n_rows, x.shape[-1]), w, kernels).reshape(*x.shape[:-1], -1)
    elif reduce_rows(n_rows, kernels) and is_float(w):
        y = few_rows_product(x, dequant(w, x.dtype))
    else:
        y = jnp.einsum("...d,fd->...f", x, dequant(w, x.dtype), preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype)


def is_float(w: QTensor) -> bool:
    """Whether W's values are stored as floats (F32/F16/BF16, or already dequantized), not GGML blocks."""
    return w.qtype is None or layout(w.qtype).block_size == 1


def reduce_rows(n_rows: int, kernels: Kernels) -> bool:
    """Whether a float product of n_rows token rows is a multiply-and-reduce (few_rows_product): a few rows
    on a GPU. On a CPU a matrix-vector product is far faster (docs/benchmarks.md)."""
    return kernels.platform == "gpu" and n_rows <= qmatvec.MAX_T


def few_rows_product(x: jax.Array, w_FD: jax.Array) -> jax.Array:
    """float32 x @ w.T for a few token rows, as a multiply-and-reduce. A dot takes a scanned layer's slice
    of a weight stack as a dynamic-slice fusion whose offset the host computes, which keeps the layer loop
    out of the CUDA graphs; a reduce takes the slice as its input (docs/benchmarks.md, "Float products read
    in place"). Rows are flattened first: XLA:CPU (jax 0.10) miscomputes this reduction with a leading unit
    axis ([1, T, 1, D] * [F, D]); tests/test_layer_runs.py checks both shapes."""
    f32 = jnp.float32
    x_ND = x.reshape(-1, x.shape[-1]).astype(f32)
    return jnp.sum(x_ND[:, None, :] * w_FD.astype(f32), axis=-1).reshape(*x.shape[:-1], w_FD.shape[0])


def project(x: jax.Array, p: Projections, kernels: Kernels) -> list[jax.Array]:
    """Each projection of x (see Projections): one product per stacked group, then split."""
    outs = []
    for w, b, sizes in zip(p.mats, p.biases, p.sizes):
        y = linear(x, w, kernels, b)
        at = [sum(sizes[:i]) for i in range(1, len(sizes))]
        outs += jnp.split(y, at, axis=-1) if at else [y]
    return outs


def lm_head(x_BTD: jax.Array, w: QTensor, dtype, kernels: Kernels) -> jax.Array:
    """float32 logits [B, T, V] of the normed final states: for a few rows (decode) the fused kernel reads
    the head's blocks once, else dequantize + matmul."""
    n_rows = x_BTD.shape[0] * x_BTD.shape[1]
    if qmatvec.linear_ok(w, n_rows, kernels):
        return qmatvec.linear(x_BTD.reshape(n_rows, -1), w, kernels).reshape(*x_BTD.shape[:2], -1)
    return jnp.einsum("btd,vd->btv", x_BTD, dequant(w, dtype), preferred_element_type=jnp.float32)


def swiglu(x: jax.Array, p: MLPParams, kernels: Kernels) -> jax.Array:
    g, u = project(x, p.gate_up, kernels)
    h = jax.nn.silu(g) * u
    return linear(h, p.w_down, kernels)
