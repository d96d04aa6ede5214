"""Device-memory estimates of a model, in one place: what load sizes the expert cache with, what
`strata-jax inspect` reports and what the bench compares against.

Pure arithmetic over a ModelConfig and a GGUF's tensor table; nothing is allocated. Weight sizes are
the file's own (quantized) bytes, which is what the engine keeps on an accelerator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strata_jax.model import kvquant
from strata_jax.model.config import ModelConfig
from strata_jax.model.layers.moe import prefill_group_bytes

if TYPE_CHECKING:
    from strata_jax.gguf.reader import GGUFFile

# Tensors whose names contain this are routed experts (the expert cache's); everything else is dense,
# the experts' biases included (gpt-oss: kept on the device beside the router, MoEParams.expert_bias).
ROUTED_EXPERT_MARK = "_exps."


def is_routed_expert(name: str) -> bool:
    return ROUTED_EXPERT_MARK in name and not name.endswith(".bias")


def kv_cache_bytes(cfg: ModelConfig, ctx: int, rows: int = 1, itemsize: int = 2, kv: str = "f16") -> int:
    """K and V of every attention layer for `rows` sequences of `ctx` positions (model/forward.py's
    KVCache, cfg.kv_cache_dims per layer and position) stored as `kv` (EngineConfig.kv; itemsize: the
    compute dtype's, what f16 stores; q8_0 and q4_0 count their scales); a recurrent layer's state, a few
    KiB per row, is not counted."""
    (kh, kd), v_dims = cfg.kv_cache_dims
    k_kind, v_kind = kvquant.kinds(kv)
    per_position = kvquant.nbytes(k_kind, kh * kd, itemsize)
    if v_dims is not None:
        per_position += kvquant.nbytes(v_kind, v_dims[0] * v_dims[1], itemsize)
    return cfg.n_kv_layers * rows * ctx * per_position


def kv_label(kv: str, dtype: str) -> str:
    """How the KV cache stores its values, named the same in every report: --kv f16 keeps the compute
    dtype (float32 on a CPU), so that is what it is called; q8_0 / q4_0 by their own names."""
    return f"{dtype}, the compute dtype" if kv == "f16" else kv


def _float32_at_load(name: str, shape: tuple[int, ...]) -> bool:
    # model/weights.py's WeightLoader.f32: vectors, a short convolution's taps and the routers
    return len(shape) == 1 or "conv1d" in name or "ffn_gate_inp" in name


def dense_tensor_bytes(name: str, shape: tuple[int, ...], nbytes: int, dense_itemsize: int | None = None) -> int:
    """One dense tensor's device bytes as the loader places it: float32 for the small ones it converts;
    a matrix in its GGML blocks (nbytes), or dequantized at load to dense_itemsize bytes a value."""
    if _float32_at_load(name, shape):
        return 4 * int(np.prod(shape))
    return nbytes if dense_itemsize is None else dense_itemsize * int(np.prod(shape))


def dense_weight_bytes(gguf: GGUFFile, off_device: tuple[str, ...] = (), dense_itemsize: int | None = None) -> int:
    """Every tensor but the routed experts (and those named in off_device, e.g. a PLE table kept in host
    memory): what sits on the device whatever the expert cache holds. dense_itemsize: the matrices are
    dequantized at load to values of this many bytes (EngineConfig.dequantize_dense, the CPU default:
    float32 takes ~4x the file's bytes); None keeps the file's blocks."""
    return sum(dense_tensor_bytes(t.name, tuple(t.shape), t.nbytes, dense_itemsize) for t in gguf.tensors.values()
               if not is_routed_expert(t.name) and t.name not in off_device)


def _block(name: str) -> int | None:
    """The block index of a `blk.N.` tensor (None for the others)."""
    head, _, rest = name.partition(".")
    n = rest.partition(".")[0]
    return int(n) if head == "blk" and n.isdigit() else None


def routed_expert_bytes(gguf: GGUFFile, cfg: ModelConfig | None = None) -> int:
    """The routed experts the expert cache serves: every MoE layer's gate, up and down (with cfg: the
    text layers' only; an MTP block's experts, past cfg.n_layers, stay in the file)."""
    return sum(t.nbytes for t in gguf.tensors.values() if is_routed_expert(t.name)
               and (cfg is None or (_block(t.name) is not None and _block(t.name) < cfg.n_layers)))


def mtp_bytes(gguf: GGUFFile, cfg: ModelConfig, ctx: int, rows: int = 1, itemsize: int = 2, kv: str = "f16") -> int:
    """What drafting with the MTP block (--spec mtp, model/mtp.py) adds on the device: its routed experts,
    resident, and its KV cache (one attention layer of the trunk's dims)."""
    experts = sum(t.nbytes for t in gguf.tensors.values() if is_routed_expert(t.name)
                  and _block(t.name) is not None and _block(t.name) >= cfg.n_layers)
    return experts + kv_cache_bytes(cfg, ctx, rows, itemsize, kv) // max(cfg.n_kv_layers, 1)


def activation_bytes(cfg: ModelConfig, prefill_chunk: int = 512, subchunk: int = 0, layer_bytes: int = 0) -> int:
    """A bound on the live activations of one prefill chunk: 32 float32 buffers of the chunk's tokens by
    the widest per-token dimension (the residual with its hyper-connection streams, the attention's
    projection, a dense or shared MLP), plus, for a MoE model, two steps of the prefill's scan over
    groups of experts (a group's bfloat16 weights and its tokens' hidden units, moe.prefill_group_bytes).
    Checked against XLA's prefill temporaries (tests/test_memory.py) and a GPU peak (docs/benchmarks.md).
    subchunk (Kernels.prefill_subchunk, where it divides the chunk): a layer-major prefill holds a
    sub-chunk's activations, the chunk's residual three times (in, the sub-chunks' outputs, out) and
    one MoE layer's experts (layer_bytes)."""
    width = max(cfg.d_model * max(cfg.hc_count, 1), cfg.q_dim * (1 + cfg.attn_output_gate), cfg.ffn_dim,
                cfg.shared_expert_ffn_dim)
    if 0 < subchunk < prefill_chunk and prefill_chunk % subchunk == 0:
        return (activation_bytes(cfg, subchunk) + 3 * prefill_chunk * width * 4
                + (layer_bytes if cfg.is_moe else 0))
    groups = 0
    if cfg.is_moe:
        groups = 2 * prefill_group_bytes(prefill_chunk, cfg.n_experts, cfg.expert_ffn_dim, cfg.d_model)
    return groups + 32 * prefill_chunk * width * 4


def fixed_device_bytes(gguf: GGUFFile, cfg: ModelConfig, *, ctx: int, itemsize: int, rows: int = 1,
                       prefill_chunk: int = 512, off_device: tuple[str, ...] = (), kv: str = "f16",
                       dense_itemsize: int | None = None, subchunk: int = 0) -> int:
    """What the device holds before any expert slot: dense weights (but off_device; dense_itemsize as
    for dense_weight_bytes) + KV cache rows + activations (the expert-cache planner's fixed_bytes; its
    reserve comes on top; subchunk: see activation_bytes)."""
    layer = routed_expert_bytes(gguf, cfg) // max(len(cfg.moe_layers), 1) if subchunk else 0
    return (dense_weight_bytes(gguf, off_device, dense_itemsize) + kv_cache_bytes(cfg, ctx, rows, itemsize, kv)
            + activation_bytes(cfg, prefill_chunk, subchunk, layer))
