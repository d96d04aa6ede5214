"""Frozen model configuration, read from GGUF metadata.

One `ModelConfig` describes every supported family; per-architecture differences (RoPE layout, QKV
bias, QK-norm, expert-weight renormalisation, shared expert) are plain fields, chosen here the way
llama.cpp chooses them, so the forward pass has no architecture switch in it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from strata_jax.core.errors import UnsupportedArchitectureError
from strata_jax.gguf.reader import GGUFFile, metadata_view

# arch -> (rope layout, renormalise top-k expert weights). llama.cpp hard-codes both per architecture
# (llama_model_rope_type, the `norm_w` argument of build_moe_ffn); "llama" covers Mixtral-style MoE.
_ARCH_TRAITS: dict[str, tuple[str, bool]] = {
    "llama": ("normal", True),
    "qwen2": ("neox", False),
    "qwen3": ("neox", False),
    "qwen2moe": ("neox", False),
    "qwen3moe": ("neox", True),
    "olmoe": ("neox", False),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCH_TRAITS)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int  # dense MLP width (0 when every layer is MoE)
    vocab_size: int
    context_length: int
    rope_theta: float
    rope_style: str  # "normal": rotate consecutive pairs; "neox": rotate halves
    rope_dim: int
    rms_eps: float
    qkv_bias: bool
    qk_norm: str  # "none" | "head" (per head, qwen3) | "full" (over all heads, olmoe)
    tied_embeddings: bool
    # MoE (n_experts == 0: dense model)
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    norm_topk: bool = False
    expert_weights_scale: float = 1.0
    shared_expert_ffn_dim: int = 0  # qwen2moe: always-on expert, gated by sigmoid(x @ w)
    moe_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> "ModelConfig":
        arch = gguf.architecture
        if arch not in _ARCH_TRAITS:
            raise UnsupportedArchitectureError(
                f"{gguf.path}: architecture {arch!r} is not supported. Supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        rope_style, norm_topk = _ARCH_TRAITS[arch]
        m = metadata_view(gguf.metadata, arch)
        d_model = int(m("embedding_length"))
        n_heads = int(m("attention.head_count"))
        n_kv = m("attention.head_count_kv", n_heads)
        head_dim = int(m("attention.key_length", d_model // n_heads))
        n_layers = int(m("block_count"))
        emb = gguf.tensor("token_embd.weight")
        vocab = emb.shape[0]

        n_experts = int(m("expert_count", 0))
        moe_layers: tuple[int, ...] = ()
        if n_experts:
            moe_layers = tuple(i for i in range(n_layers) if gguf.has(f"blk.{i}.ffn_gate_inp.weight"))
        expert_ffn = 0
        if moe_layers:
            expert_ffn = int(gguf.tensor(f"blk.{moe_layers[0]}.ffn_gate_exps.weight").shape[1])
        shared_ffn = 0
        if moe_layers and gguf.has(f"blk.{moe_layers[0]}.ffn_gate_shexp.weight"):
            shared_ffn = int(gguf.tensor(f"blk.{moe_layers[0]}.ffn_gate_shexp.weight").shape[0])
        ffn_dim = _scalar_or_first(m("feed_forward_length", 0))

        qk_norm = "none"
        if gguf.has("blk.0.attn_q_norm.weight"):
            qk_norm = "head" if gguf.tensor("blk.0.attn_q_norm.weight").shape[0] == head_dim else "full"
        return cls(
            arch=arch,
            n_layers=n_layers,
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(_scalar_or_first(n_kv)),
            head_dim=head_dim,
            ffn_dim=int(ffn_dim),
            vocab_size=int(vocab),
            context_length=int(m("context_length", 4096)),
            rope_theta=float(m("rope.freq_base", 10000.0)),
            rope_style=rope_style,
            rope_dim=int(m("rope.dimension_count", head_dim)),
            rms_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)),
            qkv_bias=gguf.has("blk.0.attn_q.bias"),
            qk_norm=qk_norm,
            tied_embeddings=not gguf.has("output.weight"),
            n_experts=n_experts,
            n_experts_used=int(m("expert_used_count", 0)),
            expert_ffn_dim=expert_ffn,
            norm_topk=bool(m("expert_weights_norm", norm_topk)),
            expert_weights_scale=float(m("expert_weights_scale", 1.0) or 1.0),
            shared_expert_ffn_dim=shared_ffn,
            moe_layers=moe_layers,
        )


def _scalar_or_first(v: Any) -> Any:
    """Some files store per-layer arrays (e.g. head_count_kv); we need one value."""
    try:
        return v[0] if len(v) else 0
    except TypeError:
        return v
