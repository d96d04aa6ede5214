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
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
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
        vals = (rng.standard_normal((rows, shape[-1]), dtype=np.float32) * np.float32(std))
        if qtype == Q.F32:
            return vals.view(np.uint8).reshape(*shape[:-1], row_bytes)
        if qtype == Q.F16:
            return vals.astype(np.float16).view(np.uint8).reshape(*shape[:-1], row_bytes)
        return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(*shape[:-1], row_bytes)
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
    seed: int = 0

    @property
    def is_moe(self) -> bool:
        return self.arch in ("qwen2moe", "qwen3moe", "olmoe") or (self.arch == "llama" and self.n_experts > 0)


def _byte_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """A working byte-level BPE vocabulary: the 256 byte symbols, chat specials, merges of common
    letter pairs, and unused filler up to vocab_size (so shapes match real models)."""
    from strata_jax.model.tokenizer import _bytes_to_unicode

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
    rng = np.random.default_rng(spec.seed)
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

    w = GGUFWriter(path, spec.arch, split_max_tensors=split_max_tensors)
    a = spec.arch
    w.add_name(f"synthetic-{a}")
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(D)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(Dh)
    w.add_value_length(Dh)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_feed_forward_length(spec.ffn_dim if not spec.is_moe else spec.expert_ffn_dim)
    if spec.is_moe:
        w.add_expert_count(spec.n_experts)
        w.add_expert_used_count(spec.n_experts_used)
        w.add_expert_feed_forward_length(spec.expert_ffn_dim)
        if spec.shared_expert_ffn_dim:
            w.add_expert_shared_feed_forward_length(spec.shared_expert_ffn_dim)
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
        if std < 0:  # norm weights: around 1
            data = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).view(np.uint8)
        else:
            data = random_tensor_bytes(rng, qtype, shape, std)
            if written(name, qtype) != qtype:
                data = gguf_quants.dequantize(data, qtype).astype(np.float32).view(np.uint8)
        w.write_tensor_data(data.reshape(-1))
    w.close()
    return first


def _byte_shape(shape: tuple[int, ...], qtype: Q) -> tuple[int, ...]:
    block, type_size = GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // block * type_size)
