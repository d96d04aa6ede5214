"""Device-memory estimates of a model, in one place: what load sizes the expert cache with, what
`strata-jax inspect` reports and what the bench compares against.

Pure arithmetic over a ModelConfig and a GGUF's tensor table; nothing is allocated. Weight sizes are
the file's own (quantized) bytes, which is what the engine keeps on an accelerator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strata_jax.model import kvquant
from strata_jax.model.config import ModelConfig

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


def dense_weight_bytes(gguf: GGUFFile, off_device: tuple[str, ...] = ()) -> int:
    """Every tensor but the routed experts (and those named in off_device, e.g. a PLE table kept in host
    memory): what sits on the device whatever the expert cache holds."""
    return sum(t.nbytes for t in gguf.tensors.values() if not is_routed_expert(t.name) and t.name not in off_device)


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


def activation_bytes(cfg: ModelConfig, prefill_chunk: int = 512) -> int:
    """A bound on the live activations of one prefill chunk: 64 float32 buffers of the chunk's tokens
    by the widest per-token dimension (the model, or the routed experts' hidden units over 8)."""
    return 64 * prefill_chunk * max(cfg.d_model, cfg.n_experts * cfg.expert_ffn_dim // 8) * 4


def fixed_device_bytes(gguf: GGUFFile, cfg: ModelConfig, *, ctx: int, itemsize: int, rows: int = 1,
                       prefill_chunk: int = 512, off_device: tuple[str, ...] = (), kv: str = "f16") -> int:
    """What the device holds before any expert slot: dense weights (but off_device) + KV cache rows +
    activations (the expert-cache planner's fixed_bytes; its reserve comes on top)."""
    return (dense_weight_bytes(gguf, off_device) + kv_cache_bytes(cfg, ctx, rows, itemsize, kv)
            + activation_bytes(cfg, prefill_chunk))
