"""The hybrid layer kinds' dimensions, one class per kind, each with its one GGUF reader: gated DeltaNet
(model/layers/deltanet.py), the QSA indexer (model/layers/qsa.py) and PLE (model/layers/ple.py).
ModelConfig holds these very objects (cfg.linear, cfg.qsa, cfg.ple) and the layers take them as they are.

They live here, not in their layer modules, because config.py must import them and a layer module may
import config.py (qsa.py through model/layers/attention.py): a cycle. Frozen and hashable (ModelConfig is
a static jit argument); model-wide values a layer needs (d_model, rms_eps, rope) are copied in at read time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

OUTPUT_GATES = ("sigmoid", "silu")


@dataclasses.dataclass(frozen=True)
class DeltaNetDims:
    """The layer's sizes, from GGUF metadata as llama.cpp's converter writes it (Qwen3NextModel.
    set_gguf_parameters). The same for every linear layer of a model."""

    d_model: int  # D: {arch}.embedding_length
    n_k_heads: int  # Hk: {arch}.ssm.group_count (linear_num_key_heads)
    n_v_heads: int  # Hv: {arch}.ssm.time_step_rank (linear_num_value_heads)
    k_head_dim: int  # Dk: {arch}.ssm.state_size (linear_key_head_dim)
    v_head_dim: int  # Dv: {arch}.ssm.inner_size / Hv (llama.cpp assumes Dv == Dk; this does not)
    conv_kernel: int  # Kc: {arch}.ssm.conv_kernel (linear_conv_kernel_dim)
    rms_eps: float  # {arch}.attention.layer_norm_rms_epsilon: the gated output norm
    # No GGUF key carries HF's output_gate_type: llama.cpp's qwen4exp graph hard-codes sigmoid (its
    # qwen3next / qwen35 graphs silu, as their transformers models).
    output_gate: str = "sigmoid"
    # Value heads' order in the file: "tiled" (head h reads key head h % Hk: the qwen35 / qwen4exp
    # converters reorder them so) or "grouped" (HF's order, head h reads key head h // (Hv / Hk): the
    # qwen3next converter keeps it). Every per-value-head tensor and the state follow the same order.
    v_head_order: str = "tiled"
    chunk_size: int = 64  # tokens per chunk of the parallel form, as the reference
    l2_eps: float = 1e-6  # the q/k l2norm's eps, fixed in transformers (llama.cpp uses rms_eps: equal in practice)

    def __post_init__(self):
        if self.n_v_heads % self.n_k_heads:
            raise ValueError(f"value heads ({self.n_v_heads}) must be a multiple of key heads ({self.n_k_heads})")
        if self.output_gate not in OUTPUT_GATES:
            raise ValueError(f"output_gate={self.output_gate!r}: choose one of {OUTPUT_GATES}")
        if self.v_head_order not in ("tiled", "grouped"):
            raise ValueError(f"v_head_order={self.v_head_order!r}: choose 'tiled' or 'grouped'")
        if self.conv_kernel < 1 or self.chunk_size < 1:
            raise ValueError(f"conv_kernel ({self.conv_kernel}) and chunk_size ({self.chunk_size}) must be >= 1")

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.v_head_dim

    @property
    def conv_channels(self) -> int:  # Cc: q, k and v channels of attn_qkv, convolved together
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_metadata(cls, m: Callable[..., Any], **unkeyed) -> "DeltaNetDims":
        """m: gguf.reader.metadata_view(metadata, arch); unkeyed: what no key says (output_gate,
        v_head_order), which config.py takes per arch."""
        n_v = int(m("ssm.time_step_rank"))
        inner = int(m("ssm.inner_size"))
        if inner % n_v:
            raise ValueError(f"ssm.inner_size ({inner}) is not a multiple of ssm.time_step_rank ({n_v})")
        return cls(d_model=int(m("embedding_length")), n_k_heads=int(m("ssm.group_count")), n_v_heads=n_v,
                   k_head_dim=int(m("ssm.state_size")), v_head_dim=inner // n_v, conv_kernel=int(m("ssm.conv_kernel")),
                   rms_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)), **unkeyed)


@dataclasses.dataclass(frozen=True)
class QSADims:
    """One full-attention layer's QSA indexer; per layer, as the compress ratio is (ModelConfig.qsa holds
    one per layer, None where the layer attends densely)."""

    n_heads: int  # Hi: {arch}.attention.indexer.head_count
    head_dim: int  # Di: {arch}.attention.indexer.key_length
    budget: int  # positions from complete blocks per query: {arch}.attention.indexer.top_k (HF indexer_budget)
    compress_ratio: int  # r: {arch}.attention.compress_ratios[layer]
    # the index heads rotate like the attention heads: the first rope_dim dims, neox halves. qwen4exp's
    # rope is interleaved mrope, which for text (the same position in every section) is this rope.
    rope_dim: int  # {arch}.rope.dimension_count
    rope_theta: float  # {arch}.rope.freq_base
    rms_eps: float  # {arch}.attention.layer_norm_rms_epsilon
    rope_style: str = "neox"  # fields named as ModelConfig's, so layers.rope takes these dims

    def __post_init__(self):
        if self.compress_ratio <= 0 or self.budget % self.compress_ratio:
            raise ValueError(f"QSA budget {self.budget} must be a multiple of compress_ratio {self.compress_ratio} > 0")
        if self.rope_dim > self.head_dim:
            raise ValueError(f"rope_dim {self.rope_dim} exceeds the indexer head dim {self.head_dim}")

    @property
    def block_topk(self) -> int:
        return self.budget // self.compress_ratio

    @classmethod
    def from_metadata(cls, m: Callable[..., Any], layer: int) -> "QSADims | None":
        """m: gguf.reader.metadata_view(metadata, arch). None where the layer has no compress ratio (0, or
        no attention.compress_ratios at all): it attends densely."""
        ratios = m("attention.compress_ratios", 0)
        ratio = int(ratios[layer]) if hasattr(ratios, "__len__") else int(ratios)
        if not ratio:
            return None
        # config.py's defaults for the rope keys, so these dims agree with ModelConfig's rope
        rope_dim = m("rope.dimension_count", None)
        if rope_dim is None:
            rope_dim = m("attention.key_length")
        return cls(n_heads=int(m("attention.indexer.head_count")), head_dim=int(m("attention.indexer.key_length")),
                   budget=int(m("attention.indexer.top_k")), compress_ratio=ratio,
                   rope_dim=int(rope_dim), rope_theta=float(m("rope.freq_base", 10000.0)),
                   rms_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)))


@dataclasses.dataclass(frozen=True)
class PLEDims:
    """What the PLE math needs; the hash constants are static (they are compiled into the program).
    GGUF keys (llama.cpp's conversion/qwen4exp.py set_gguf_parameters; {arch} = qwen4exp):"""

    d_model: int  # D: {arch}.embedding_length
    hc_count: int  # Hc: {arch}.hyper_connection.count
    row_dim: int  # one head's row: per_layer_token_embd's columns ({arch}.embedding_length_per_layer_input)
    ngram_size: int  # {arch}.ple.ngram_size; also the conv's dilation
    heads_per_ngram: int  # {arch}.ple.heads_per_ngram
    conv_kernel: int  # Kc taps: {arch}.ple.conv_kernel
    eos_token_id: int  # {arch}.ple.eos_token_id: the token that cuts n-grams
    layer_multipliers: tuple[int, ...]  # [ngram_size]: {arch}.ple.layer_multipliers (u64)
    head_offsets: tuple[int, ...]  # [Gp]: {arch}.ple.head_offsets (u64), each head's first table row
    head_vocab_sizes: tuple[int, ...]  # [Gp]: {arch}.ple.head_vocab_sizes (u64), primes
    rms_eps: float = 1e-6  # {arch}.attention.layer_norm_rms_epsilon
    layers: tuple[int, ...] = ()  # 0-based layer ids: {arch}.ple.layers

    def __post_init__(self):
        n = self.ngram_size
        if n < 2 or self.heads_per_ngram < 1 or self.conv_kernel < 1:
            raise ValueError(f"PLE needs ngram_size >= 2, heads_per_ngram >= 1 and conv_kernel >= 1: {self}")
        if len(self.layer_multipliers) != n:
            raise ValueError(f"{len(self.layer_multipliers)} PLE layer multipliers for ngram_size {n}")
        if len(self.head_offsets) != self.n_heads or len(self.head_vocab_sizes) != self.n_heads:
            raise ValueError(f"PLE head offsets / vocab sizes must have {self.n_heads} entries "
                             f"((ngram_size - 1) * heads_per_ngram)")
        if any(not 0 < m < 1 << 64 for m in self.layer_multipliers):
            raise ValueError("PLE layer multipliers must be in (0, 2**64)")
        # the remainder runs in uint32 (needs p < 2**31) and the row index is an int32 (as in llama.cpp)
        if any(not 1 < p < 1 << 31 for p in self.head_vocab_sizes):
            raise ValueError("PLE head vocab sizes must be in (1, 2**31)")
        if self.n_rows >= 1 << 31:
            raise ValueError(f"PLE head ranges end at row {self.n_rows}, past the int32 row index")

    @property
    def n_heads(self) -> int:  # Gp
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def embed_dim(self) -> int:  # the concatenated rows of one token: Gp * row_dim
        return self.n_heads * self.row_dim

    @property
    def channels(self) -> int:  # Cc = Hc * D
        return self.hc_count * self.d_model

    @property
    def conv_state_len(self) -> int:  # past conv inputs a step needs: (Kc - 1) * dilation
        return (self.conv_kernel - 1) * self.ngram_size

    @property
    def n_rows(self) -> int:  # rows the head ranges need (the table may have padding rows past them)
        return max(o + p for o, p in zip(self.head_offsets, self.head_vocab_sizes))

    @classmethod
    def from_metadata(cls, m: Callable[..., Any]) -> "PLEDims | None":
        """m: gguf.reader.metadata_view(metadata, arch). None when the file has no PLE (no ple.layers).
        row_dim is the key; PLEParams.from_gguf checks the table's columns against it."""
        layers = tuple(int(i) for i in m("ple.layers", ()))
        if not layers:
            return None

        def ints(key):
            return tuple(int(v) for v in m(key))

        return cls(d_model=int(m("embedding_length")), hc_count=int(m("hyper_connection.count")),
                   row_dim=int(m("embedding_length_per_layer_input")), ngram_size=int(m("ple.ngram_size")),
                   heads_per_ngram=int(m("ple.heads_per_ngram")), conv_kernel=int(m("ple.conv_kernel")),
                   eos_token_id=int(m("ple.eos_token_id")), layer_multipliers=ints("ple.layer_multipliers"),
                   head_offsets=ints("ple.head_offsets"), head_vocab_sizes=ints("ple.head_vocab_sizes"),
                   rms_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)), layers=layers)
