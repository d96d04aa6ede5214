"""Random-weight GGUF models written directly in quantized form, at disk speed, with no quantizer.

Block bytes are random except the fp16 scale fields, which are set so the dequantized weights have
roughly a chosen standard deviation (finite, no NaN/inf). Used by tests (small, fast models of every
architecture with a real byte-level tokenizer) and by benchmarks (B30/BSEED-shaped MoE files that
llama.cpp reads too). Tensors are streamed to disk one at a time, so file size is bounded by disk,
not RAM.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants

Q = GGMLQuantizationType

# type -> ((byte offset of each fp16 scale field), multiplier from target std to d, dmin/min as a
# multiple of d that roughly centres the distribution)
_SCALES = {
    Q.Q4_0: ((0,), 1 / 4.6, None),
    Q.Q5_0: ((0,), 1 / 9.2, None),
    Q.Q8_0: ((0,), 1 / 74.0, None),
    Q.Q4_1: ((0, 2), 1 / 4.6, -7.5),
    Q.Q5_1: ((0, 2), 1 / 9.2, -15.5),
    Q.Q2_K: ((80, 82), 1 / 8.4, 1.5),
    Q.Q3_K: ((108,), 1 / 41.0, None),
    Q.Q4_K: ((0, 2), 1 / 147.0, 7.5),
    Q.Q5_K: ((0, 2), 1 / 294.0, 15.5),
    Q.Q6_K: ((208,), 1 / 1369.0, None),
    Q.TQ1_0: ((52,), 1 / 0.82, None),
    Q.TQ2_0: ((64,), 1 / 1.12, None),
    Q.IQ1_S: ((0,), 1 / 7.2, None),
    Q.IQ1_M: ((), 1 / 7.2, None),  # d is spread over the scale words: set_iq1m_d
    Q.IQ2_XXS: ((0,), 1 / 53.0, None),
    Q.IQ2_XS: ((0,), 1 / 56.0, None),
    Q.IQ2_S: ((0,), 1 / 56.0, None),
    Q.IQ3_XXS: ((0,), 1 / 142.0, None),
    Q.IQ3_S: ((0,), 1 / 140.0, None),
    Q.IQ4_NL: ((0,), 1 / 67.0, None),
    Q.IQ4_XS: ((0,), 1 / 1246.0, None),
}


def set_iq1m_d(blocks_YZ: np.ndarray, d_Y: np.ndarray) -> None:
    """Write fp16 scales d into IQ1_M blocks (uint8[..., Y, 56], in place): IQ1_M has no fp16 field; d's
    four nibbles are the top nibbles of its four uint16 scale words (bytes 48-55)."""
    words = blocks_YZ[..., 48:56].copy().view(np.uint16)
    nib = (d_Y.astype(np.float16).view(np.uint16)[..., None] >> np.array([0, 4, 8, 12], np.uint16)) & 0xF
    words = (words & 0x0FFF) | (nib << 12).astype(np.uint16)
    blocks_YZ[..., 48:56] = words.view(np.uint8)


def random_tensor_bytes(rng: np.random.Generator, qtype: Q, shape: tuple[int, ...], std: float) -> np.ndarray:
    """uint8[..., row_bytes] holding a random tensor of logical `shape` in GGML type `qtype`."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    row_bytes = shape[-1] // block * type_size
    if qtype in (Q.F32, Q.F16, Q.BF16):
        out = np.empty((rows, row_bytes), np.uint8)
        step = max(1, (1 << 24) // shape[-1])  # rows per chunk: a multi-GB table never sits in RAM as f32
        for r0 in range(0, rows, step):
            vals = rng.standard_normal((min(step, rows - r0), shape[-1]), dtype=np.float32) * np.float32(std)
            if qtype == Q.F16:
                vals = vals.astype(np.float16)
            elif qtype == Q.BF16:
                vals = (vals.view(np.uint32) >> 16).astype(np.uint16)
            out[r0 : r0 + len(vals)] = vals.view(np.uint8)
        return out.reshape(*shape[:-1], row_bytes)
    if qtype == Q.MXFP4:  # an e8m0 exponent byte per block: 2^(e - 128) * (up to 12) near std
        data = np.frombuffer(rng.bytes(rows * row_bytes), np.uint8).copy().reshape(-1, type_size)
        e = 128 + int(np.floor(np.log2(std))) - 2 + rng.integers(-1, 2, data.shape[0])
        data[:, 0] = np.clip(e, 0, 255).astype(np.uint8)
        return data.reshape(*shape[:-1], row_bytes)
    offsets, d_mult, m_mult = _SCALES[qtype]
    data = np.frombuffer(rng.bytes(rows * row_bytes), np.uint8).copy().reshape(-1, type_size)
    n_blocks = data.shape[0]
    d = (std * d_mult * rng.uniform(0.5, 1.5, n_blocks)).astype(np.float16)
    if qtype == Q.IQ1_M:
        set_iq1m_d(data, d)
    else:
        data[:, offsets[0] : offsets[0] + 2] = d.view(np.uint8).reshape(-1, 2)
    if len(offsets) > 1:
        m = (d.astype(np.float32) * m_mult).astype(np.float16)
        data[:, offsets[1] : offsets[1] + 2] = m.view(np.uint8).reshape(-1, 2)
    return data.reshape(*shape[:-1], row_bytes)


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    arch: str = "qwen3moe"  # qwen2 | qwen3 | llama | qwen2moe | qwen3moe | olmoe
    n_layers: int = 2
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 64
    ffn_dim: int = 512  # dense layers
    n_experts: int = 8
    n_experts_used: int = 2
    expert_ffn_dim: int = 256
    shared_expert_ffn_dim: int = 0  # qwen2moe
    vocab_size: int = 1024
    context_length: int = 4096
    rope_theta: float = 1e6
    qtype: str = "Q8_0"  # matrices
    expert_qtype: str | None = None  # routed experts (default: qtype)
    odd_down_qtype: str | None = None  # down projections of odd layers' experts (Q4_K_M mixes types by layer)
    # routed experts written as F32: the same random blocks, dequantized by gguf-py (the reference
    # model a quant type's model-level test compares against)
    dequantize_experts: bool = False
    # routed experts drawn as this type (the same random stream as a file of that type, so every other
    # tensor is that file's too) and requantized to expert_qtype by gguf-py: a lower-bit copy of the same
    # model (--cold-experts). gguf-py quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
    experts_from: str | None = None
    seed: int = 0
    # qwen4exp (llama.cpp's conversion/qwen4exp.py layout; ignored by the other archs). Every layer is
    # MoE with a sigmoid-gated shared expert (shared_expert_ffn_dim > 0); attention heads are gated
    # (attn_q holds [q | gate] per head) with a QSA indexer; the rest are gated DeltaNet layers.
    full_attention_interval: int = 4  # every interval-th layer is full attention
    rope_dim: int = 0  # rotary dims (partial rotary); 0: head_dim
    rope_sections: tuple[int, ...] = ()  # mrope sections, summing to rope_dim // 2
    linear_k_heads: int = 2  # Hk  (llama.cpp: value head dim == key head dim == linear_head_dim)
    linear_v_heads: int = 4  # Hv
    linear_head_dim: int = 32  # Dk = Dv
    linear_conv_kernel: int = 4  # Kc
    hc_count: int = 4  # Hc hyper-connection streams
    hc_rank: int = 32  # r
    indexer_heads: int = 2  # Hi
    indexer_head_dim: int = 32  # Di
    indexer_budget: int = 16  # tokens selected per query (whole blocks of compress_ratio)
    compress_ratio: int = 4  # tokens per QSA key block on every full-attention layer (llama.cpp needs > 0)
    ple_layer: int = -1  # the (linear-attention) layer with PLE; -1: no PLE
    ple_ngram_size: int = 3
    ple_heads_per_ngram: int = 2
    ple_head_vocab: int = 97  # each hash head's vocabulary: the next distinct primes from here
    ple_conv_kernel: int = 4
    ple_qtype: str = "F16"  # per_layer_token_embd (the converter writes F16)

    @property
    def is_moe(self) -> bool:
        return self.arch in ("qwen2moe", "qwen3moe", "olmoe", "qwen4exp") or (self.arch == "llama" and self.n_experts > 0)

    @property
    def layer_is_linear(self) -> tuple[bool, ...]:
        """qwen4exp's attention.recurrent_layers: True for a gated DeltaNet layer."""
        return tuple((i + 1) % self.full_attention_interval != 0 for i in range(self.n_layers))

    @property
    def ple_n_heads(self) -> int:  # Gp
        return (self.ple_ngram_size - 1) * self.ple_heads_per_ngram

    def ple_hash(self) -> tuple[list[int], list[int], list[int], int]:
        """(layer multipliers, head offsets, head vocab sizes, table rows) as transformers derives them:
        odd multipliers below 2**63 // vocab (no int64 overflow), distinct primes, the table padded to 128."""
        rng = np.random.default_rng(self.seed + 1)
        half = max(1, ((1 << 63) - 1) // self.vocab_size // 2)
        mult = [2 * int(rng.integers(0, half)) + 1 for _ in range(self.ple_ngram_size)]
        sizes, p = [], self.ple_head_vocab
        while len(sizes) < self.ple_n_heads:
            if _is_prime(p):
                sizes.append(p)
            p += 1
        offsets = [int(x) for x in np.cumsum([0] + sizes[:-1])]
        rows = -(-sum(sizes) // 128) * 128
        return mult, offsets, sizes, rows


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def _byte_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """A working byte-level BPE vocabulary: the 256 byte symbols, chat specials, merges of common
    letter pairs, and unused filler up to vocab_size (so shapes match real models)."""
    from strata_jax.gguf.tokenizer import _bytes_to_unicode

    spell = _bytes_to_unicode()
    tokens = [spell[b] for b in range(256)]
    types = [1] * 256
    merges: list[str] = []
    letters = "etaoinshrdlu "
    for a in letters:
        for b in letters:
            if len(tokens) >= vocab_size - 3:
                break
            sa, sb = spell[ord(a)], spell[ord(b)]
            merges.append(f"{sa} {sb}")
            tokens.append(sa + sb)
            types.append(1)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += specials
    types += [3, 3, 3]
    while len(tokens) < vocab_size:
        tokens.append(f"[unused{len(tokens)}]")
        types.append(5)
    if len(tokens) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the {len(tokens)} tokens of the synthetic vocabulary")
    return tokens, types, merges


_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_synthetic_gguf(path: str | os.PathLike[str], spec: SyntheticSpec, *, split_max_tensors: int = 0) -> Path:
    """Write a random model of `spec` to `path` (GGUF v3, readable by llama.cpp); returns the path written.
    split_max_tensors > 0: split it as llama.cpp does, at most that many tensors a shard, into
    `STEM-00001-of-0000N.gguf` ... beside `path` (the same tensors and bytes), and return the first shard."""
    path = Path(path)
    if spec.arch == "qwen4exp":
        return _write(path, spec, _qwen4exp_tensors(spec), _qwen4exp_kv, split_max_tensors)
    qt = Q[spec.qtype]
    eqt = Q[spec.expert_qtype or spec.qtype]
    for qtype, dims in ((qt, (spec.d_model, spec.n_heads * spec.head_dim, spec.ffn_dim, spec.shared_expert_ffn_dim)),
                        (eqt, (spec.d_model, spec.expert_ffn_dim))):
        block = GGML_QUANT_SIZES[qtype][0]
        if any(d % block for d in dims):
            raise ValueError(f"{qtype.name} needs row lengths that are multiples of {block}; got {dims}")
    D, Dh = spec.d_model, spec.head_dim
    qd, kvd = spec.n_heads * Dh, spec.n_kv_heads * Dh
    std_in = 1.0 / np.sqrt(D)

    tensors: list[tuple[str, Q, tuple[int, ...], float]] = [("token_embd.weight", qt, (spec.vocab_size, D), 1.0)]
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", Q.F32, (D,), -1.0),
            (p + "attn_q.weight", qt, (qd, D), std_in),
            (p + "attn_k.weight", qt, (kvd, D), std_in),
            (p + "attn_v.weight", qt, (kvd, D), std_in),
            (p + "attn_output.weight", qt, (D, qd), 1.0 / np.sqrt(qd)),
            (p + "ffn_norm.weight", Q.F32, (D,), -1.0),
        ]
        if spec.arch in ("qwen2", "qwen2moe"):
            tensors += [(p + f"attn_{x}.bias", Q.F32, (n,), 0.02) for x, n in (("q", qd), ("k", kvd), ("v", kvd))]
        if spec.arch in ("qwen3", "qwen3moe"):
            tensors += [(p + "attn_q_norm.weight", Q.F32, (Dh,), -1.0), (p + "attn_k_norm.weight", Q.F32, (Dh,), -1.0)]
        if spec.arch == "olmoe":
            tensors += [(p + "attn_q_norm.weight", Q.F32, (qd,), -1.0), (p + "attn_k_norm.weight", Q.F32, (kvd,), -1.0)]
        if spec.is_moe:
            E, F = spec.n_experts, spec.expert_ffn_dim
            tensors += [
                (p + "ffn_gate_inp.weight", Q.F32, (E, D), std_in),
                (p + "ffn_gate_exps.weight", eqt, (E, F, D), std_in),
                (p + "ffn_up_exps.weight", eqt, (E, F, D), std_in),
                (p + "ffn_down_exps.weight", Q[spec.odd_down_qtype] if spec.odd_down_qtype and i % 2 else eqt,
                 (E, D, F), 1.0 / np.sqrt(F)),
            ]
            if spec.shared_expert_ffn_dim:
                Fs = spec.shared_expert_ffn_dim
                tensors += [
                    (p + "ffn_gate_inp_shexp.weight", Q.F32, (1, D), std_in),
                    (p + "ffn_gate_shexp.weight", qt, (Fs, D), std_in),
                    (p + "ffn_up_shexp.weight", qt, (Fs, D), std_in),
                    (p + "ffn_down_shexp.weight", qt, (D, Fs), 1.0 / np.sqrt(Fs)),
                ]
        else:
            F = spec.ffn_dim
            tensors += [
                (p + "ffn_gate.weight", qt, (F, D), std_in),
                (p + "ffn_up.weight", qt, (F, D), std_in),
                (p + "ffn_down.weight", qt, (D, F), 1.0 / np.sqrt(F)),
            ]
    tensors += [("output_norm.weight", Q.F32, (D,), -1.0), ("output.weight", qt, (spec.vocab_size, D), std_in)]
    return _write(path, spec, tensors, _common_kv, split_max_tensors)


# a tensor to write: (name, GGML type, numpy shape (GGUF ne reversed), init); init is the std of a
# random tensor, -1.0 for a norm weight (around 1), or a function rng, shape -> float32 values
Init = float | Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]


def _common_kv(w: GGUFWriter, spec: SyntheticSpec) -> None:
    D, Dh = spec.d_model, spec.head_dim
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(D)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(Dh)
    w.add_value_length(Dh)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    if spec.arch != "qwen4exp":  # the qwen4exp converter writes no feed_forward_length
        w.add_feed_forward_length(spec.ffn_dim if not spec.is_moe else spec.expert_ffn_dim)
    if spec.is_moe:
        w.add_expert_count(spec.n_experts)
        w.add_expert_used_count(spec.n_experts_used)
        w.add_expert_feed_forward_length(spec.expert_ffn_dim)
        if spec.shared_expert_ffn_dim:
            w.add_expert_shared_feed_forward_length(spec.shared_expert_ffn_dim)


def _write(path: Path, spec: SyntheticSpec, tensors: list[tuple[str, Q, tuple[int, ...], Init]],
           arch_kv: Callable[[GGUFWriter, SyntheticSpec], None], split_max_tensors: int) -> Path:
    rng = np.random.default_rng(spec.seed)
    w = GGUFWriter(path, spec.arch, split_max_tensors=split_max_tensors)
    w.add_name(f"synthetic-{spec.arch}")
    arch_kv(w, spec)
    tokens, types, merges = _byte_vocab(spec.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(_CHAT_TEMPLATE)

    def written(name: str, qtype: Q) -> Q:
        return Q.F32 if spec.dequantize_experts and name.endswith("_exps.weight") else qtype

    for name, qtype, shape, _ in tensors:
        qtype = written(name, qtype)
        block, type_size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block * type_size)
        w.add_tensor_info(name, _byte_shape(shape, qtype), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    first = w.format_shard_names(path)[0]  # path itself unless the tensors were split
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, qtype, shape, std in tensors:
        if callable(std):
            data = _as_type(std(rng, shape).astype(np.float32), qtype)
        elif std < 0:  # norm weights: around 1
            data = _as_type(1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32), qtype)
        elif spec.experts_from and name.endswith("_exps.weight"):
            src = Q[spec.experts_from]
            vals = gguf_quants.dequantize(random_tensor_bytes(rng, src, shape, std), src).astype(np.float32)
            data = gguf_quants.quantize(vals, qtype)
        else:
            data = random_tensor_bytes(rng, qtype, shape, std)
            if written(name, qtype) != qtype:
                data = gguf_quants.dequantize(data, qtype).astype(np.float32).view(np.uint8)
        w.write_tensor_data(data.reshape(-1))
    w.close()
    return first


def _as_type(vals: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return vals.view(np.uint8)
    if qtype == Q.F16:
        return vals.astype(np.float16).view(np.uint8)
    raise ValueError(f"a computed tensor is written as F32 or F16, not {qtype.name}")


def _row_type(qtype: Q, n_cols: int) -> Q:
    """qtype where its blocks tile the row, else F16 (what the converter falls back to)."""
    return qtype if n_cols % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


def _qwen4exp_tensors(spec: SyntheticSpec) -> list[tuple[str, Q, tuple[int, ...], Init]]:
    """Every tensor llama.cpp's qwen4exp loader asks for (src/models/qwen4exp.cpp load_arch_tensors), in
    the converter's names, shapes and float types. Scales: projections 1/sqrt(fan-in) (activations stay
    O(1)), the router 3/sqrt(D) (logit std ~3: decisive top-k), DeltaNet decay and step as trained ones."""
    qt, eqt = Q[spec.qtype], Q[spec.expert_qtype or spec.qtype]
    D, H, K, Dh, V = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.vocab_size
    E, F, Fs = spec.n_experts, spec.expert_ffn_dim, spec.shared_expert_ffn_dim
    Hc, r = spec.hc_count, spec.hc_rank
    Hk, Hv, Dl, Kc = spec.linear_k_heads, spec.linear_v_heads, spec.linear_head_dim, spec.linear_conv_kernel
    Cc = 2 * Hk * Dl + Hv * Dl
    if not Fs:
        raise ValueError("qwen4exp has a shared expert: set shared_expert_ffn_dim")
    if spec.compress_ratio <= 0 or spec.indexer_budget % spec.compress_ratio:
        raise ValueError(f"qwen4exp needs compress_ratio > 0 dividing indexer_budget; got {spec.compress_ratio}, "
                         f"{spec.indexer_budget}")
    if spec.ple_layer >= 0 and not spec.layer_is_linear[spec.ple_layer]:
        raise ValueError(f"PLE layer {spec.ple_layer} is a full-attention layer (llama.cpp needs a linear one)")
    for dims in ((D, F), (F,)):
        if any(d % GGML_QUANT_SIZES[eqt][0] for d in dims):
            raise ValueError(f"{eqt.name} needs expert rows that are multiples of {GGML_QUANT_SIZES[eqt][0]}; "
                             f"got D={D}, F={F}")

    def mat(name, rows, cols, std=None, qtype=qt):
        return (name, _row_type(qtype, cols), (rows, cols), 1 / np.sqrt(cols) if std is None else std)

    def vec(name, n, init=-1.0):
        return (name, Q.F32, (n,), init)

    def hc(p):  # one hyper-connection mixer (the head's has no inject)
        return [vec(p + "_norm.weight", Hc * D), mat(p + "_down.weight", r, Hc * D), mat(p + "_up.weight", Hc * D, r)]

    # decay A in [1, 16] (A_log's init range), stored as -A; dt_bias = softplus^-1 of a step in [1e-3, 0.1]
    def ssm_a(rng, shape):
        return -rng.uniform(1, 16, shape)

    def dt_bias(rng, shape):
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), shape))
        return dt + np.log(-np.expm1(-dt))

    t = [mat("token_embd.weight", V, D, 1.0), mat("output.weight", V, D, 4 / np.sqrt(D))]  # logit std ~2
    t += hc("output_hc")
    for i, lin in enumerate(spec.layer_is_linear):
        p = f"blk.{i}."
        for part in ("attn", "ffn"):
            t += hc(p + f"hc_{part}") + [mat(p + f"hc_{part}_inject.weight", Hc, Hc * D)]
        if lin:
            t += [
                vec(p + "ssm_a", Hv, ssm_a),
                (p + "ssm_conv1d.weight", Q.F32, (Cc, Kc), 1 / np.sqrt(Kc)),
                vec(p + "ssm_dt.bias", Hv, dt_bias),
                mat(p + "ssm_alpha.weight", Hv, D), mat(p + "ssm_beta.weight", Hv, D),
                mat(p + "attn_qkv.weight", Cc, D), mat(p + "attn_gate.weight", Hv * Dl, D),
                vec(p + "ssm_norm.weight", Dl), mat(p + "ssm_out.weight", D, Hv * Dl),
            ]
        else:
            Hi, Di = spec.indexer_heads, spec.indexer_head_dim
            t += [
                mat(p + "attn_q.weight", 2 * H * Dh, D), mat(p + "attn_k.weight", K * Dh, D),
                mat(p + "attn_v.weight", K * Dh, D), mat(p + "attn_output.weight", D, H * Dh),
                vec(p + "attn_q_norm.weight", Dh), vec(p + "attn_k_norm.weight", Dh),
                mat(p + "indexer.q_proj.weight", Hi * Di, D), mat(p + "indexer.k_proj.weight", Di, D),
                vec(p + "indexer.q_norm.weight", Di), vec(p + "indexer.k_norm.weight", Di),
            ]
        if i == spec.ple_layer:
            _, _, _, rows = spec.ple_hash()
            Kp = spec.ple_conv_kernel
            t += [
                (p + "ple_conv1d.weight", Q.F16, (Hc * D, Kp), 1 / np.sqrt(Kp)),
                mat(p + "ple_key.weight", Hc * D, D), mat(p + "ple_value.weight", D, D),
                vec(p + "ple_norm_conv.weight", Hc * D), vec(p + "ple_norm_key.weight", Hc * D),
                vec(p + "ple_norm_query.weight", Hc * D),
                ("per_layer_token_embd.weight", _row_type(Q[spec.ple_qtype], D // spec.ple_n_heads),
                 (rows, D // spec.ple_n_heads), 1.0),
            ]
        t += [
            (p + "ffn_gate_inp.weight", Q.F32, (E, D), 3 / np.sqrt(D)),
            (p + "ffn_gate_exps.weight", eqt, (E, F, D), 1 / np.sqrt(D)),
            (p + "ffn_up_exps.weight", eqt, (E, F, D), 1 / np.sqrt(D)),
            (p + "ffn_down_exps.weight", Q[spec.odd_down_qtype] if spec.odd_down_qtype and i % 2 else eqt,
             (E, D, F), 1 / np.sqrt(F)),
            (p + "ffn_gate_inp_shexp.weight", Q.F32, (1, D), 1 / np.sqrt(D)),
            mat(p + "ffn_gate_shexp.weight", Fs, D), mat(p + "ffn_up_shexp.weight", Fs, D),
            mat(p + "ffn_down_shexp.weight", D, Fs),
        ]
    return t


def _qwen4exp_kv(w: GGUFWriter, spec: SyntheticSpec) -> None:
    """The keys conversion/qwen4exp.py writes (and llama.cpp's load_arch_hparams reads)."""
    V = GGUFValueType
    a = spec.arch
    _common_kv(w, spec)

    def u32(key, v):
        w.add_key_value(f"{a}.{key}", int(v), V.UINT32)

    def arr(key, vals, sub):
        w.add_key_value(f"{a}.{key}", list(vals), V.ARRAY, sub_type=sub)

    rope_dim = spec.rope_dim or spec.head_dim
    sections = list(spec.rope_sections) or [rope_dim // 2]
    if sum(sections) * 2 != rope_dim:
        raise ValueError(f"rope_sections {sections} do not sum to rope_dim / 2 = {rope_dim // 2}")
    w.add_rope_dimension_count(rope_dim)
    arr("rope.dimension_sections", (sections + [0, 0, 0, 0])[:4], V.INT32)
    u32("ssm.conv_kernel", spec.linear_conv_kernel)
    u32("ssm.state_size", spec.linear_head_dim)
    u32("ssm.group_count", spec.linear_k_heads)
    u32("ssm.time_step_rank", spec.linear_v_heads)
    u32("ssm.inner_size", spec.linear_v_heads * spec.linear_head_dim)
    arr("attention.recurrent_layers", spec.layer_is_linear, V.BOOL)
    u32("full_attention_interval", spec.full_attention_interval)
    u32("hyper_connection.count", spec.hc_count)
    u32("hyper_connection.low_rank", spec.hc_rank)
    u32("attention.indexer.head_count", spec.indexer_heads)
    u32("attention.indexer.key_length", spec.indexer_head_dim)
    u32("attention.indexer.top_k", spec.indexer_budget)
    arr("attention.compress_ratios", [0 if lin else spec.compress_ratio for lin in spec.layer_is_linear], V.INT32)
    if spec.ple_layer >= 0:
        mult, offsets, sizes, _ = spec.ple_hash()
        arr("ple.layers", [spec.ple_layer], V.INT32)
        u32("ple.ngram_size", spec.ple_ngram_size)
        u32("ple.heads_per_ngram", spec.ple_heads_per_ngram)
        u32("ple.conv_kernel", spec.ple_conv_kernel)
        u32("ple.eos_token_id", _byte_vocab(spec.vocab_size)[0].index("<|im_end|>"))  # the file's EOS
        u32("embedding_length_per_layer_input", spec.d_model // spec.ple_n_heads)
        arr("ple.layer_multipliers", mult, V.UINT64)
        arr("ple.head_offsets", offsets, V.UINT64)
        arr("ple.head_vocab_sizes", sizes, V.UINT64)


def _byte_shape(shape: tuple[int, ...], qtype: Q) -> tuple[int, ...]:
    block, type_size = GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // block * type_size)
