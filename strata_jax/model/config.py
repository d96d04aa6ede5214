"""Frozen model configuration, read from GGUF metadata.

One `ModelConfig` describes every supported family; per-architecture differences (RoPE layout, QKV
bias, QK-norm, expert-weight renormalisation, shared expert) are plain fields, chosen here the way
llama.cpp chooses them, so the forward pass has no architecture switch in it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from strata_jax.core.errors import ConfigError, UnsupportedArchitectureError
from strata_jax.gguf.reader import GGUFFile, metadata_view
from strata_jax.model.dims import DeltaNetDims, PLEDims, QSADims

# arch -> (rope layout, renormalise top-k expert weights). llama.cpp hard-codes both per architecture
# (llama_model_rope_type, the `norm_w` argument of build_moe_ffn); "llama" covers Mixtral-style MoE.
_ARCH_TRAITS: dict[str, tuple[str, bool]] = {
    "llama": ("normal", True),
    "qwen2": ("neox", False),
    "qwen3": ("neox", False),
    "qwen2moe": ("neox", False),
    "qwen3moe": ("neox", True),
    "olmoe": ("neox", False),
    # text positions make its interleaved mrope one neox rope (see _qwen4exp); top-k renormalised
    "qwen4exp": ("neox", True),
    # the seed model's relatives (the same hybrid, plain residual + norms): qwen3next's rope is neox,
    # qwen35's interleaved mrope is one neox rope for text, as qwen4exp's; both renormalise top-k
    "qwen3next": ("neox", True),
    "qwen35moe": ("neox", True),
    "qwen35": ("neox", True),
    # sigmoid scores with a selection bias, optional expert groups, leading dense layers, MTP block
    "glm4moe": ("neox", True),
    # sinks, alternating sliding-window layers, biases everywhere, softmax over the top-k logits
    "gpt-oss": ("neox", False),
    # DeepSeek-V2/V3: multi-head latent attention (MLADims), rope on interleaved pairs, optional YaRN;
    # expert_weights_norm comes from the file (llama.cpp's default: off)
    "deepseek2": ("normal", False),
}
# gated DeltaNet + gated full attention layers (model/hybrid.py: their params and state; model/dims.py: their dims)
HYBRID_ARCHITECTURES = ("qwen4exp", "qwen3next", "qwen35moe", "qwen35")
# the architectures whose MTP ("nextn") blocks are loaded (ModelConfig.n_nextn_layers); any other
# file with nextn_predict_layers is refused by name (qwen4exp: convert without the MTP block)
MTP_ARCHITECTURES = ("qwen3next", "qwen35moe", "qwen35", "glm4moe")
# llama.cpp's expert_gating_func values, and the default where a file has no such key
_GATING = {1: "softmax", 2: "sigmoid"}
_DEFAULT_GATING = {"glm4moe": "sigmoid"}  # llama.cpp's glm4moe loader: none means sigmoid
# architectures whose graph hard-codes its gating whatever the file says: gpt-oss takes the top-k of
# the router logits and softmaxes only those (llama.cpp's SOFTMAX_WEIGHT)
_FIXED_GATING = {"gpt-oss": "softmax_weight"}
# the routed experts' activation, hard-coded per architecture by llama.cpp (build_moe_ffn's type_op,
# with gpt-oss's alpha and limit constants: no GGUF key carries them)
_EXPERT_ACT = {"gpt-oss": dict(expert_act="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)}
# llama.cpp's default sliding-window pattern per architecture (load_swa_pattern's n_pattern): a layer
# il is a sliding-window layer when il % n < n - 1
_SWA_PATTERN = {"gpt-oss": 2}
# the norm before the FFN block: llama.cpp's glm4moe names it attn_post_norm (post_attention_norm)
_FFN_NORM_TENSOR = {"glm4moe": "post_attention_norm", "gpt-oss": "post_attention_norm"}
SUPPORTED_ARCHITECTURES = tuple(_ARCH_TRAITS)

LINEAR, ATTENTION = "linear", "attention"  # layer kinds (ModelConfig.layer_kinds)


@dataclasses.dataclass(frozen=True)
class MLADims:
    """Multi-head latent attention (deepseek2: model/layers/mla.py), from the GGUF's attention.* keys: the query
    through a rank-q_lora_rank latent (0: one projection, attn_q), keys and values of every head through
    one rank-kv_lora_rank latent; per head nope_dim + rope_dim key dims (key_length_mla; only the
    rope_dim part is rotated, its key shared by all heads) and v_dim value dims (value_length_mla).
    The cache holds the latent and the rotated key: kv_lora_rank + rope_dim values per position."""

    q_lora_rank: int  # Rq
    kv_lora_rank: int  # Rk
    nope_dim: int  # Dn
    rope_dim: int  # Dr
    v_dim: int  # Do

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """rope.scaling.*, ggml's rope_yarn with llama.cpp's meaning of its keys. kind "linear": every
    frequency divided by factor. kind "yarn": frequencies interpolated by 1 / factor below the original
    context's correction range, extrapolated above it (ramp over dims [beta_fast, beta_slow] rotations,
    ext_factor of the mix), and a magnitude (mscale) correction; log_mul: rope.scaling.yarn_log_multiplier
    without the converter's 0.1 factor (HF's mscale_all_dim; 0: none). model/layers/attention.py's
    rope_freqs and attn_mscale are the formulas."""

    kind: str
    factor: float
    orig_ctx: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    ext_factor: float = 1.0
    log_mul: float = 0.0


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
    # router scoring: "softmax" over the experts, or "sigmoid" per expert (glm4moe); a MoE layer's
    # exp_probs_b (MoEParams.score_bias_E) is added to the scores for the choice only
    expert_gating: str = "softmax"
    # group-limited routing (0 or 1: none): experts in expert_groups equal groups, top-k taken only
    # from the expert_groups_used groups whose best two biased scores sum highest
    expert_groups: int = 0
    expert_groups_used: int = 0
    ffn_norm_tensor: str = "ffn_norm"  # blk.N.{this}.weight normalises the FFN block's input
    # routed experts' activation: "silu" (silu(g) * u) or "swiglu_oai" (gpt-oss: g clamped above and u
    # on both sides at swiglu_limit, g * sigmoid(swiglu_alpha g) * (u + 1); model/layers/moe.py expert_glu)
    expert_act: str = "silu"
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # sliding-window attention (gpt-oss): the layers in swa_layers attend to the last sliding_window
    # positions only (the query's own included)
    sliding_window: int = 0
    swa_layers: tuple[int, ...] = ()
    # MTP ("nextn") blocks stored after the n_layers text blocks (blk.{n_layers + j}; MTP_ARCHITECTURES):
    # loaded into params.nextn where their tensors are in the file, never run by the forward pass
    n_nextn_layers: int = 0
    # the hybrid family (HYBRID_ARCHITECTURES; empty / 0 / None elsewhere: every layer is attention +
    # pre-norm residual); hc_count, qsa, ple: qwen4exp only. linear, qsa, ple: the layer modules' own
    # dims (model/dims.py), as the layers take them
    layer_kinds: tuple[str, ...] = ()  # per layer: ATTENTION or LINEAR (gated DeltaNet)
    attn_output_gate: bool = False  # attn_q holds [q | gate] per head; output *= sigmoid(gate)
    hc_count: int = 0  # hyper-connection residual streams (0: a plain residual with norms)
    hc_rank: int = 0
    rope_sections: tuple[int, ...] = ()  # mrope sections (text: one position, so one rope)
    linear: DeltaNetDims | None = None  # every linear layer's
    qsa: tuple[QSADims | None, ...] = ()  # per layer: its QSA indexer, None where it attends densely
    ple: PLEDims | None = None  # the PLE layers (ple.layers) and theirs
    # deepseek2: multi-head latent attention (None elsewhere); n_kv_heads = 1 and head_dim = its cached
    # values per position (kv_lora_rank + rope_dim), as the GGUF's MQA view of it says
    mla: MLADims | None = None
    rope_scaling: RopeScaling | None = None  # rope.scaling.* (None: unscaled)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def kv_cache_dims(self) -> tuple[tuple[int, int], tuple[int, int] | None]:
        """(heads, dims) per position of one KV layer's key cache and value cache: the one layout
        KVCache.zeros allocates and memory.kv_cache_bytes counts. MLA caches its latent and rotated key
        as one single-head key (the latent is also the value: no value cache, None)."""
        if self.mla is not None:
            return (1, self.mla.kv_lora_rank + self.mla.rope_dim), None
        return (self.n_kv_heads, self.head_dim), (self.n_kv_heads, self.head_dim)

    @property
    def kv_values_per_position(self) -> int:
        """Cached values per position and KV layer (keys and values together)."""
        (kh, kd), v = self.kv_cache_dims
        return kh * kd + (v[0] * v[1] if v is not None else 0)

    def kind(self, layer: int) -> str:
        return self.layer_kinds[layer] if self.layer_kinds else ATTENTION

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache, in order (KV layer j is block attention_layers[j])."""
        return tuple(i for i in range(self.n_layers) if self.kind(i) == ATTENTION)

    @property
    def n_kv_layers(self) -> int:
        return len(self.attention_layers)

    @property
    def is_hybrid(self) -> bool:
        """Per-layer kinds (gated DeltaNet or gated attention) and the family's params (model/hybrid.py)."""
        return bool(self.layer_kinds)

    @property
    def has_recurrent_state(self) -> bool:
        """Per-row state beside the KV cache (model/hybrid.py HybridState): DeltaNet layers, the PLE
        n-gram context or QSA's compressed block keys."""
        return self.is_hybrid and (LINEAR in self.layer_kinds or self.ple is not None or self.has_qsa)

    @property
    def has_qsa(self) -> bool:
        """Some attention layer masks by QSA's selection (qwen4exp's compress ratios)."""
        return any(d is not None for d in self.qsa)

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
        block_count = int(m("block_count"))
        n_nextn = int(m("nextn_predict_layers", 0) or 0)
        # refused by name: blocks a forward pass would silently skip
        if n_nextn and arch not in MTP_ARCHITECTURES:
            _refuse(gguf, f"{arch}.nextn_predict_layers = {n_nextn} (MTP draft layers)", "convert without the MTP block")
        if not 0 <= n_nextn < block_count:
            _refuse(gguf, f"{arch}.nextn_predict_layers = {n_nextn} of {block_count} blocks")
        n_layers = block_count - n_nextn  # the MTP blocks come after the text layers
        if arch in HYBRID_ARCHITECTURES:
            return _hybrid(cls, gguf, m, arch, n_layers, n_nextn)
        d_model = int(m("embedding_length"))
        n_heads = int(m("attention.head_count"))
        n_kv = m("attention.head_count_kv", n_heads)
        head_dim = int(m("attention.key_length", d_model // n_heads))
        emb = gguf.tensor("token_embd.weight")
        vocab = emb.shape[0]

        n_experts = int(m("expert_count", 0))
        moe_layers: tuple[int, ...] = ()
        if n_experts:
            moe_layers = tuple(i for i in range(n_layers) if gguf.has(f"blk.{i}.ffn_gate_inp.weight"))
        n_dense_lead = m("leading_dense_block_count", None)
        if n_dense_lead is not None and n_experts and moe_layers != tuple(range(int(n_dense_lead), n_layers)):
            _refuse(gguf, f"MoE layers {list(moe_layers)} with leading_dense_block_count = {n_dense_lead}")
        gating_id = m("expert_gating_func", None)
        gating = _DEFAULT_GATING.get(arch, "softmax") if gating_id in (None, 0) else _GATING.get(int(gating_id))
        gating = _FIXED_GATING.get(arch, gating)
        if gating is None:
            _refuse(gguf, f"expert_gating_func = {gating_id}", f"supported: {_GATING}")
        groups, groups_used = int(m("expert_group_count", 0) or 0), int(m("expert_group_used_count", 0) or 0)
        if groups > 1 and (n_experts % groups or not 0 < groups_used <= groups
                           or groups_used * (n_experts // groups) < int(m("expert_used_count", 0))):
            _refuse(gguf, f"{groups_used} of {groups} expert groups over {n_experts} experts "
                          f"top-{m('expert_used_count', 0)}")
        expert_ffn = 0
        if moe_layers:
            expert_ffn = int(gguf.tensor(f"blk.{moe_layers[0]}.ffn_gate_exps.weight").shape[1])
        shared_ffn = 0
        if moe_layers and gguf.has(f"blk.{moe_layers[0]}.ffn_gate_shexp.weight"):
            shared_ffn = int(gguf.tensor(f"blk.{moe_layers[0]}.ffn_gate_shexp.weight").shape[0])
        ffn_dim = _scalar_or_first(m("feed_forward_length", 0))

        mla = _mla(gguf, m, arch, n_kv, head_dim) if arch == "deepseek2" else None
        rope_scaling = _rope_scaling(gguf, m, arch)
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
            expert_gating=gating,
            expert_groups=groups if groups > 1 else 0,
            expert_groups_used=groups_used if groups > 1 else 0,
            ffn_norm_tensor=_FFN_NORM_TENSOR.get(arch, "ffn_norm"),
            n_nextn_layers=n_nextn,
            **_EXPERT_ACT.get(arch, {}),
            **_sliding_window(gguf, m, arch, n_layers),
            mla=mla,
            rope_scaling=rope_scaling,
        )


def _sliding_window(gguf: GGUFFile, m, arch: str, n_layers: int) -> dict:
    """attention.sliding_window and which layers use it, for the architectures with sliding-window
    layers (_SWA_PATTERN): attention.sliding_window_pattern as per-layer flags, or as n (layer il
    slides when il % n < n - 1), else the architecture's default (llama.cpp's load_swa_pattern)."""
    window = int(m("attention.sliding_window", 0) or 0)
    if not window or arch not in _SWA_PATTERN:  # the other architectures' graphs here have no window
        return {}
    pattern = m("attention.sliding_window_pattern", _SWA_PATTERN[arch])
    if isinstance(pattern, (list, tuple)) or hasattr(pattern, "__len__"):
        flags = [bool(f) for f in pattern]
        if len(flags) != n_layers:
            _refuse(gguf, f"attention.sliding_window_pattern of {len(flags)} flags for {n_layers} layers")
    else:
        n = int(pattern)
        flags = [n == 0 or il % n < n - 1 for il in range(n_layers)]
    return dict(sliding_window=window, swa_layers=tuple(i for i, f in enumerate(flags) if f))


def _mla(gguf: GGUFFile, m, arch: str, n_kv: Any, head_dim: int) -> MLADims:
    """deepseek2's latent attention dims. The converter writes the MQA view llama.cpp runs (one kv head
    of key_length = kv_lora_rank + rope dims, value_length = kv_lora_rank) and the per-head dims as
    key_length_mla / value_length_mla, with kv_b split into attn_k_b / attn_v_b."""
    if not gguf.has("blk.0.attn_k_b.weight"):
        unsplit = gguf.has("blk.0.attn_kv_b.weight")
        what = "an MLA file with the unsplit attn_kv_b" if unsplit else "a file without attn_k_b"
        _refuse(gguf, f"{arch}: {what} (an older converter's layout)",
                "reconvert it with a current convert_hf_to_gguf.py, which writes attn_k_b and attn_v_b")
    # what llama.cpp reads but this forward pass would ignore: query temperature tuning (mistral-large,
    # on where non-zero) and an extra rope magnitude factor (neutral at 1)
    for key, neutral in (("attention.temperature_scale", 0.0), ("rope.scaling.attn_factor", 1.0)):
        if m(key, neutral) != neutral:
            _refuse(gguf, f"{arch}.{key} = {m(key)}")
    rank = int(m("attention.kv_lora_rank"))
    rope_dim = int(m("rope.dimension_count"))
    q_rank = int(m("attention.q_lora_rank", 0) or 0) if gguf.has("blk.0.attn_q_a.weight") else 0
    dims = MLADims(q_lora_rank=q_rank, kv_lora_rank=rank, nope_dim=int(m("attention.key_length_mla")) - rope_dim,
                   rope_dim=rope_dim, v_dim=int(m("attention.value_length_mla")))
    if int(_scalar_or_first(n_kv)) != 1 or head_dim != rank + rope_dim or int(m("attention.value_length", rank)) != rank:
        _refuse(gguf, f"{arch} attention of {n_kv} kv heads, key_length {head_dim}, value_length "
                      f"{m('attention.value_length', None)} (MLA's MQA view is 1 head of kv_lora_rank + rope dims "
                      f"= {rank + rope_dim}, value kv_lora_rank = {rank})")
    if dims.nope_dim < 1 or (q_rank == 0 and not gguf.has("blk.0.attn_q.weight")):
        _refuse(gguf, f"{arch} attention dims {dims} (no query projection, or no dims without rope)")
    return dims


ROPE_SCALINGS = ("none", "linear", "yarn")  # what rope.scaling.type and --rope-scaling take


def with_rope_scaling(cfg: "ModelConfig", kind: str | None, factor: float | None = None,
                      orig_ctx: int | None = None) -> "ModelConfig":
    """cfg with llama.cpp's --rope-scaling / --rope-scale / --yarn-orig-ctx applied over the file's
    rope.scaling.* (None: keep the file's). The context the model is fit for becomes orig_ctx x factor
    (orig_ctx: the file's original context, else its context_length), which is what ctx defaults to."""
    if kind is None and factor is None and orig_ctx is None:
        return cfg
    old = cfg.rope_scaling
    kind = kind or (old.kind if old is not None else "none")
    if kind == "none":
        return dataclasses.replace(cfg, rope_scaling=None)
    factor = factor if factor is not None else old.factor if old is not None else None
    if factor is None:
        raise ConfigError(f"rope scaling {kind!r} needs a factor (--rope-scale): the file gives none.")
    base = orig_ctx or (old.orig_ctx if old is not None and old.orig_ctx else cfg.context_length)
    if old is not None and old.kind == kind == "yarn":  # the file's YaRN constants stay
        new = dataclasses.replace(old, factor=factor, orig_ctx=base)
    else:
        new = RopeScaling(kind=kind, factor=factor, orig_ctx=base if kind == "yarn" else 0)
    if factor == 1.0:
        return dataclasses.replace(cfg, rope_scaling=None)
    return dataclasses.replace(cfg, rope_scaling=new, context_length=int(base * factor))


def _rope_scaling(gguf: GGUFFile, m, arch: str) -> RopeScaling | None:
    """rope.scaling.* for every architecture, with llama.cpp's defaults for the keys a file leaves out
    (beta fast 32, slow 1, ext factor 1; the original context: context_length). A factor of 1 or none
    scales nothing. The YaRN log multiplier is read where the graph applies it (deepseek2's kq scale)."""
    kind = m("rope.scaling.type", "none")
    factor = float(m("rope.scaling.factor", 0.0) or 0.0)
    if kind == "none" or (kind in ("linear", "yarn") and factor == 1.0):
        return None
    if kind not in ROPE_SCALINGS:
        _refuse(gguf, f"rope.scaling.type {kind!r}", "supported: " + ", ".join(ROPE_SCALINGS))
    if factor < 1.0:
        _refuse(gguf, f"rope.scaling.factor {factor} for {kind} rope scaling", "it must be at least 1")
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    # the converter writes 0.1 * mscale_all_dim ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX] in llama.cpp)
    log_mul = float(m("rope.scaling.yarn_log_multiplier", 0.0) or 0.0) / 0.1
    if log_mul and arch != "deepseek2":
        _refuse(gguf, f"{arch}: rope.scaling.yarn_log_multiplier (DeepSeek-style YaRN attention scaling)",
                "only deepseek2's graph applies it")
    y = RopeScaling(kind="yarn", factor=factor,
                    orig_ctx=int(m("rope.scaling.original_context_length", m("context_length", 4096))),
                    beta_fast=float(m("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(m("rope.scaling.yarn_beta_slow", 1.0)),
                    ext_factor=float(m("rope.scaling.yarn_ext_factor", 1.0)), log_mul=log_mul)
    if y.ext_factor <= 0.0:
        _refuse(gguf, f"YaRN with ext_factor {y.ext_factor}", "it must be positive")
    return y


def _scalar_or_first(v: Any) -> Any:
    """Some files store per-layer arrays (e.g. head_count_kv); we need one value."""
    try:
        return v[0] if len(v) else 0
    except TypeError:
        return v


def _refuse(gguf: GGUFFile, what: str, fix: str = "") -> None:
    raise UnsupportedArchitectureError(f"{gguf.path}: {what} is not supported{'; ' + fix if fix else ''}.")


def _hybrid(cls, gguf: GGUFFile, m, arch: str, n_layers: int, nextn: int) -> ModelConfig:
    """The hybrid family: gated DeltaNet ("linear") and gated full attention layers, a MoE block
    (softmax top-k, renormalised, sigmoid-gated shared expert) on every layer, or (qwen35) a dense
    SwiGLU MLP. qwen4exp adds hyper-connections in place of every norm, a QSA indexer and optional PLE
    (_qwen4exp_parts); the others have a plain residual with (1 + w)-folded RMSNorms and may carry MTP
    ("nextn") blocks after the text layers. Key names as llama.cpp's converters write them
    (conversion/qwen.py, conversion/qwen4exp.py). n_layers: the text layers, without the `nextn` MTP
    blocks after them (from_gguf reads both)."""
    block_count = n_layers + nextn
    # refused by name: parts a text-only forward pass would silently skip
    vision = sorted(n for n in gguf.tensors if n.startswith(("v.", "mm.")))
    if vision:
        _refuse(gguf, f"the vision tower ({len(vision)} tensors, e.g. {vision[0]!r})", "use a text-only GGUF")
    n_experts = int(m("expert_count", 0) or 0)
    if arch != "qwen35" and not (n_experts and gguf.has("blk.0.ffn_gate_inp.weight")):
        _refuse(gguf, f"a {arch} file without MoE layers")
    recurrent = list(m("attention.recurrent_layers", []))
    if not recurrent:
        interval = int(m("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    elif nextn and len(recurrent) == block_count:  # the converter lists the MTP blocks too (full attention)
        if any(recurrent[n_layers:]):
            _refuse(gguf, "a recurrent MTP block")
        recurrent = recurrent[:n_layers]
    if len(recurrent) != n_layers:
        _refuse(gguf, f"attention.recurrent_layers of {len(recurrent)} entries for {n_layers} blocks",
                "MTP/nextn blocks past the text layers")
    kinds = tuple(LINEAR if r else ATTENTION for r in recurrent)

    d_model = int(m("embedding_length"))
    n_heads = int(m("attention.head_count"))
    head_dim = int(m("attention.key_length"))
    if int(m("attention.value_length", head_dim)) != head_dim:
        _refuse(gguf, "attention.value_length != attention.key_length")
    rope_dim = int(m("rope.dimension_count", head_dim))
    sections = tuple(int(x) for x in m("rope.dimension_sections", ()))
    if sections and sum(sections) * 2 != rope_dim:
        _refuse(gguf, f"rope.dimension_sections {list(sections)} for {rope_dim} rotary dims")

    first_linear = kinds.index(LINEAR) if LINEAR in kinds else None
    if first_linear is not None and not gguf.has(f"blk.{first_linear}.attn_qkv.weight"):
        _refuse(gguf, f"a {arch} DeltaNet without attn_qkv (a legacy fused ssm_in file)", "reconvert it")
    # what no key says, taken as llama.cpp's graph of the arch hard-codes it
    linear = _layer_dims(gguf, DeltaNetDims.from_metadata, m, output_gate="sigmoid" if arch == "qwen4exp" else "silu",
                         v_head_order="grouped" if arch == "qwen3next" else "tiled")

    expert_ffn = shared_ffn = ffn_dim = 0
    if n_experts:
        gate_name = "blk.0.ffn_gate_exps.weight"
        fused = not gguf.has(gate_name) and gguf.has("blk.0.ffn_gate_up_exps.weight")
        if fused:
            expert_ffn = int(gguf.tensor("blk.0.ffn_gate_up_exps.weight").shape[1]) // 2
        else:
            expert_ffn = int(gguf.tensor(gate_name).shape[1])
        shared_ffn = int(m("expert_shared_feed_forward_length", 0))
    else:
        ffn_dim = int(_scalar_or_first(m("feed_forward_length")))
    extra = _qwen4exp_parts(gguf, m, n_layers, kinds) if arch == "qwen4exp" else {}
    return cls(
        arch=arch,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(_scalar_or_first(m("attention.head_count_kv", n_heads))),
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        vocab_size=int(gguf.tensor("token_embd.weight").shape[0]),
        context_length=int(m("context_length", 4096)),
        rope_theta=float(m("rope.freq_base", 10000.0)),
        rope_style="neox",
        rope_dim=rope_dim,
        rms_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)),
        qkv_bias=False,
        qk_norm="head",
        tied_embeddings=not gguf.has("output.weight"),
        n_experts=n_experts,
        n_experts_used=int(m("expert_used_count", 0)),
        expert_ffn_dim=expert_ffn,
        norm_topk=bool(m("expert_weights_norm", True)),
        expert_weights_scale=float(m("expert_weights_scale", 1.0) or 1.0),
        shared_expert_ffn_dim=shared_ffn,
        moe_layers=tuple(range(n_layers)) if n_experts else (),
        layer_kinds=kinds,
        attn_output_gate=True,
        rope_sections=sections,
        linear=linear,
        n_nextn_layers=nextn,
        **extra,
    )


def _qwen4exp_parts(gguf: GGUFFile, m, n_layers: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    """qwen4exp's own parts: the QSA indexer, PLE and the hyper-connections."""
    qsa = tuple(_layer_dims(gguf, QSADims.from_metadata, m, i) for i in range(n_layers))
    if any(d is not None and kinds[i] != ATTENTION for i, d in enumerate(qsa)):
        _refuse(gguf, "a compress ratio on a linear-attention layer")

    ple = _layer_dims(gguf, PLEDims.from_metadata, m)
    if ple is not None:
        if any(kinds[i] != LINEAR for i in ple.layers):
            _refuse(gguf, f"PLE on a full-attention layer ({list(ple.layers)})")
        if len(ple.layers) != 1:  # one set of hash constants (and one per_layer_token_embd) in the file
            _refuse(gguf, f"PLE on {len(ple.layers)} layers", "the format carries one PLE table")

    hc = int(m("hyper_connection.count"))
    if hc < 2:
        _refuse(gguf, f"hyper_connection.count = {hc} (qwen4exp mixes at least 2 streams)")
    return dict(hc_count=hc, hc_rank=int(m("hyper_connection.low_rank")), qsa=qsa, ple=ple)


def _layer_dims(gguf: GGUFFile, read, *args, **kwargs):
    """A layer kind's dims through its own reader (model/dims.py), which checks them: dims the layer
    cannot take are refused, naming the file."""
    try:
        return read(*args, **kwargs)
    except ValueError as e:
        raise UnsupportedArchitectureError(f"{gguf.path}: {e}; this file is not supported.") from e
