"""qwen4exp hyper-connections: hc_count residual streams in place of the pre-norms and the output norm.

The residual is x_BTHcD: the embedding repeated into Hc streams (`streams`). Before each block (the
attention or linear attention, then the MoE block) a gated residual (`mix`) normalizes every stream
(one RMSNorm per stream, its own gamma), gates it through a low-rank mixer and averages the streams
into the block's input; `combine` adds the block's output back into every stream, each with its own
weight. The final mixer has no inject weights and replaces the output norm before the head.

Stateless: nothing here is carried between steps. Tensors are taken as the GGUF stores them (llama.cpp's
conversion/qwen.py Qwen3NextModel.modify_tensors folds HF's (1 + w) into the norm gamma); the graph
that consumes them is llama.cpp's src/models/qwen4exp.cpp build_hc_mix / build_hc_combine.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.core.errors import TensorShapeError
from strata_jax.core.qtensor import QTensor
from strata_jax.model.kernels import Kernels
from strata_jax.model.layers.basic import linear, rms_norm


@dataclasses.dataclass(frozen=True)
class HyperDims:
    hc_count: int  # Hc: {arch}.hyper_connection.count
    low_rank: int  # r: {arch}.hyper_connection.low_rank
    d_model: int  # D: {arch}.embedding_length
    rms_eps: float  # {arch}.attention.layer_norm_rms_epsilon

    @classmethod
    def from_metadata(cls, m: Callable[..., Any]) -> "HyperDims":
        """m: gguf.reader.metadata_view(metadata, arch)."""
        return cls(int(m("hyper_connection.count")), int(m("hyper_connection.low_rank")),
                   int(m("embedding_length")), float(m("attention.layer_norm_rms_epsilon", 1e-6)))


@struct.dataclass
class HyperParams:
    """One gated residual: `{base}_norm`, `{base}_down`, `{base}_up`, `{base}_inject` with base
    blk.{i}.hc_attn, blk.{i}.hc_ffn, or output_hc (the final mixer, which has no inject)."""

    norm_HcD: jax.Array  # float32 gamma, (1 + w) already folded; the GGUF holds it flat [Hc*D]
    down: QTensor  # [r, Hc*D]
    up: QTensor  # [Hc*D, r]
    inject: QTensor | None  # [Hc, Hc*D]; None for the final mixer

    @classmethod
    def from_gguf(cls, get: Callable[[str], Any], base: str, dims: HyperDims) -> "HyperParams":
        """get(name): a matrix as a QTensor, a vector as a float32 array, in the GGUF's (numpy) shape."""
        Hc, D, r = dims.hc_count, dims.d_model, dims.low_rank
        norm = jnp.asarray(get(f"{base}_norm.weight"), jnp.float32)
        if norm.size != Hc * D:
            raise TensorShapeError(f"{base}_norm.weight has {norm.size} values, expected hc_count*n_embd = {Hc * D}")
        down, up = get(f"{base}_down.weight"), get(f"{base}_up.weight")
        inject = None if base == "output_hc" else get(f"{base}_inject.weight")
        for name, w, shape in (("down", down, (r, Hc * D)), ("up", up, (Hc * D, r)),
                               ("inject", inject, (Hc, Hc * D))):
            if w is not None and tuple(w.shape) != shape:
                raise TensorShapeError(f"{base}_{name}.weight has shape {tuple(w.shape)}, expected {shape}")
        return cls(norm.reshape(Hc, D), down, up, inject)


@struct.dataclass
class LayerHyper:
    attn: HyperParams  # blk.{i}.hc_attn_*: around the (linear) attention
    ffn: HyperParams  # blk.{i}.hc_ffn_*: around the MoE block

    @classmethod
    def from_gguf(cls, get: Callable[[str], Any], layer: int, dims: HyperDims) -> "LayerHyper":
        return cls(HyperParams.from_gguf(get, f"blk.{layer}.hc_attn", dims),
                   HyperParams.from_gguf(get, f"blk.{layer}.hc_ffn", dims))


def head_mixer_from_gguf(get: Callable[[str], Any], dims: HyperDims) -> HyperParams:
    return HyperParams.from_gguf(get, "output_hc", dims)


def streams(x_BTD: jax.Array, dims: HyperDims) -> jax.Array:
    """The wide residual starts as Hc identical copies of the embedding."""
    B, T, D = x_BTD.shape
    return jnp.broadcast_to(x_BTD[:, :, None, :], (B, T, dims.hc_count, D))


def mix(p: HyperParams, x_BTHcD: jax.Array, dims: HyperDims, kernels: Kernels) -> tuple[jax.Array, jax.Array | None]:
    """The block input h_BTD and, with inject weights, the per-stream scale w_BTHc of its output
    (2 * sigmoid, centred on 1 so that a zero injection is a plain residual add)."""
    B, T, Hc, D = x_BTHcD.shape
    xn_BTHcD = rms_norm(x_BTHcD, p.norm_HcD, dims.rms_eps)  # each stream normalized over its own D
    flat = xn_BTHcD.reshape(B, T, Hc * D)
    lo_BTr = jax.nn.silu(linear(flat, p.down, kernels).astype(jnp.float32) / Hc)
    gate = jax.nn.sigmoid(linear(lo_BTr.astype(x_BTHcD.dtype), p.up, kernels).astype(jnp.float32))
    h_BTD = jnp.mean(gate.reshape(B, T, Hc, D) * xn_BTHcD.astype(jnp.float32), axis=2)
    w_BTHc = None
    if p.inject is not None:
        w_BTHc = 2.0 * jax.nn.sigmoid(linear(flat, p.inject, kernels).astype(jnp.float32) / Hc)
    return h_BTD.astype(x_BTHcD.dtype), w_BTHc


def combine(x_BTHcD: jax.Array, out_BTD: jax.Array, w_BTHc: jax.Array) -> jax.Array:
    """Every stream adds the block's output scaled by its own weight (the un-normalized residual)."""
    y = x_BTHcD.astype(jnp.float32) + out_BTD.astype(jnp.float32)[:, :, None, :] * w_BTHc[..., None]
    return y.astype(x_BTHcD.dtype)


def block(p: HyperParams, x_BTHcD: jax.Array, fn: Callable[[jax.Array], Any], dims: HyperDims,
          kernels: Kernels) -> tuple[jax.Array, Any]:
    """x -> combine(x, fn(mix(x))) for a block fn(h_BTD) -> out_BTD or (out_BTD, extra); returns
    (x, extra) with extra None when fn returns the output alone."""
    h_BTD, w_BTHc = mix(p, x_BTHcD, dims, kernels)
    res = fn(h_BTD)
    out, extra = res if isinstance(res, tuple) else (res, None)
    return combine(x_BTHcD, out, w_BTHc), extra
