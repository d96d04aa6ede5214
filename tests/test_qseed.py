"""The synthetic qwen4exp files of `strata-jax bench` (shapes qseed / qtiny, strata_jax/dev/synthetic.py):
the engine loads and decodes qtiny, offloaded == resident with the PLE table's placement, and the file is
what llama.cpp reads (the pinned converter's gguf-py: its reader, its qwen4exp tensor list and keys)."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys

import numpy as np
import pytest

import strata_jax
from strata_jax.bench.shapes import SHAPES, synthetic_model_path
from strata_jax.dev.synthetic import write_synthetic_gguf
from strata_jax.gguf.reader import GGUFFile

QTINY = SHAPES["qtiny"]


def _expected_names(spec) -> set[str]:
    """The tensors the converter writes for this spec's layers, by layer kind."""
    hc = [f"hc_{p}_{x}.weight" for p in ("attn", "ffn") for x in ("norm", "down", "up", "inject")]
    moe = [f"ffn_{x}.weight" for x in ("gate_inp", "gate_exps", "up_exps", "down_exps", "gate_inp_shexp",
                                      "gate_shexp", "up_shexp", "down_shexp")]
    linear = ["ssm_a", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_alpha.weight", "ssm_beta.weight",
              "attn_qkv.weight", "attn_gate.weight", "ssm_norm.weight", "ssm_out.weight"]
    full = [f"attn_{x}.weight" for x in ("q", "k", "v", "output", "q_norm", "k_norm")] + \
        [f"indexer.{x}.weight" for x in ("q_proj", "k_proj", "q_norm", "k_norm")]
    ple = [f"ple_{x}.weight" for x in ("conv1d", "key", "value", "norm_conv", "norm_key", "norm_query")]
    names = {"token_embd.weight", "output.weight", "output_hc_norm.weight", "output_hc_down.weight",
             "output_hc_up.weight", "per_layer_token_embd.weight"}
    for i, lin in enumerate(spec.layer_is_linear):
        names |= {f"blk.{i}.{n}" for n in hc + moe + (linear if lin else full) + (ple if i == spec.ple_layer else [])}
    return names


_READ = r"""
import json, runpy, sys
root, path = sys.argv[1], sys.argv[2]
sys.path[:0] = [root + "/gguf-py"]  # the converter's own gguf-py, matched to it
from gguf import GGUFReader
c = runpy.run_path(root + "/gguf-py/gguf/constants.py")
r = GGUFReader(path)
arch = c["MODEL_ARCH"].QWEN4EXP
K = c["Keys"]
# the keys llama.cpp's qwen4exp loader reads without a default (load_arch_hparams + the common hparams)
required = [K.LLM.BLOCK_COUNT, K.LLM.CONTEXT_LENGTH, K.LLM.EMBEDDING_LENGTH, K.Attention.HEAD_COUNT,
            K.Attention.HEAD_COUNT_KV, K.Attention.KEY_LENGTH, K.Attention.VALUE_LENGTH, K.LLM.EXPERT_COUNT,
            K.LLM.EXPERT_USED_COUNT, K.Attention.LAYERNORM_RMS_EPS, K.Rope.DIMENSION_COUNT,
            K.Rope.DIMENSION_SECTIONS, K.Rope.FREQ_BASE, K.SSM.CONV_KERNEL, K.SSM.INNER_SIZE, K.SSM.STATE_SIZE,
            K.SSM.TIME_STEP_RANK, K.SSM.GROUP_COUNT, K.HyperConnection.COUNT, K.HyperConnection.LOW_RANK,
            K.Attention.Indexer.HEAD_COUNT, K.Attention.Indexer.KEY_LENGTH, K.Attention.Indexer.TOP_K,
            K.Attention.COMPRESS_RATIOS, K.Attention.RECURRENT_LAYERS, K.PerLayerEmbedding.LAYERS,
            K.PerLayerEmbedding.NGRAM_SIZE, K.PerLayerEmbedding.HEADS_PER_NGRAM, K.PerLayerEmbedding.CONV_KERNEL,
            K.PerLayerEmbedding.EOS_TOKEN_ID, K.LLM.EMBD_LENGTH_PER_LAYER_INP, K.PerLayerEmbedding.LAYER_MULTIPLIERS,
            K.PerLayerEmbedding.HEAD_OFFSETS, K.PerLayerEmbedding.HEAD_VOCAB_SIZES, K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH]
patterns = [c["TENSOR_NAMES"][t] for t in c["MODEL_TENSORS"][arch]]
print(json.dumps({
    "arch": r.fields["general.architecture"].contents(),
    "tensors": {t.name: [t.tensor_type.name, [int(x) for x in t.shape]] for t in r.tensors},
    "keys": sorted(r.fields), "required": [k.format(arch=c["MODEL_ARCH_NAMES"][arch]) for k in required],
    "patterns": patterns,
    "n_blocks": int(r.fields["qwen4exp.block_count"].contents()),
}))
"""


def test_qtiny_is_what_llama_cpp_reads(llama_cpp_converter):
    """gguf-py (the converter's newer copy) reads qtiny; every tensor is one the qwen4exp arch lists
    (MODEL_TENSORS[QWEN4EXP], i.e. what llama.cpp's loader asks for), the set is the converter's for these
    layer kinds, and every key the loader requires is there."""
    path = synthetic_model_path("qtiny")
    proc = subprocess.run([sys.executable, "-c", _READ, str(llama_cpp_converter.parent), str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["arch"] == "qwen4exp"
    allowed = {p.format(bid=b) for p in got["patterns"] for b in range(got["n_blocks"])}
    assert sorted(n for n in got["tensors"] if n.rsplit(".weight", 1)[0].removesuffix(".bias") not in allowed) == []
    assert set(got["tensors"]) == _expected_names(QTINY)
    assert sorted(set(got["required"]) - set(got["keys"])) == []
    # the experts are IQ3_S, gguf-py's ne order (columns first)
    D, F, E = QTINY.d_model, QTINY.expert_ffn_dim, QTINY.n_experts
    assert got["tensors"]["blk.0.ffn_gate_exps.weight"] == ["IQ3_S", [D, F, E]]
    assert got["tensors"]["blk.0.ffn_down_exps.weight"] == ["IQ3_S", [F, D, E]]


def test_qseed_spec_is_the_seed_scale():
    """qseed's layout without writing its 57 GB: 48 layers (every 4th full attention), 24,576 IQ3_S
    experts of the seed's logged 1.94 MiB, a PLE table of a few GB, llama.cpp's tensor set."""
    from gguf import GGML_QUANT_SIZES

    from strata_jax.dev.synthetic import _qwen4exp_tensors

    spec = SHAPES["qseed"]
    assert spec.layer_is_linear.count(False) == 12 and spec.layer_is_linear[3] is False
    t = _qwen4exp_tensors(spec)
    assert {n for n, *_ in t} == _expected_names(spec)

    def nbytes(q, shape):
        b, s = GGML_QUANT_SIZES[q]
        return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // b * s)

    exps = [(q, shape) for n, q, shape, _ in t if "_exps" in n]
    assert {q.name for q, _ in exps} == {"IQ3_S"} and sum(s[0] for _, s in exps) // 3 == 24_576
    per_expert = sum(nbytes(q, s) for q, s in exps) / 24_576
    assert abs(per_expert / 2**20 - 1.94) < 0.01
    table = next(nbytes(q, s) for n, q, s, _ in t if n == "per_layer_token_embd.weight")
    assert 2e9 < table < 5e9
    assert sum(nbytes(q, s) for _, q, s, _ in t) < 60e9  # fits the GPU machine's 64 GiB disk


def _load(**kw):
    return strata_jax.load(str(synthetic_model_path("qtiny")), ctx=128, dtype="float32", prefill_chunk=16, **kw)


@pytest.mark.slow  # two qwen4exp engines compiled on CPU (~1-2 min)
def test_qtiny_decodes_and_offloaded_equals_resident(caplog):
    """qtiny loads (every tensor consumed), its logits are finite and spread, the router is decisive, and
    offloaded experts (PLE table then in pinned host memory: auto) give the resident run's logits and
    greedy tokens bit for bit."""
    from strata_jax.model.config import ModelConfig
    from strata_jax.model.weights import WeightLoader, expert_spec, load_params

    g = GGUFFile(synthetic_model_path("qtiny"))
    loader = WeightLoader(g, ModelConfig.from_gguf(g))
    load_params(loader), expert_spec(loader)  # the experts are read by the offload store
    assert sorted(set(g.tensors) - loader.consumed) == []

    ids = np.random.default_rng(0).integers(0, 420, 24).tolist()
    with caplog.at_level(logging.INFO, logger="strata_jax"):
        res = _load(record_routing=True)
    assert res.ple_table == "device" and "PLE table: 0.00 GB in device memory (auto: it fits" in caplog.text
    ref = np.asarray(res.logits(ids))
    assert np.isfinite(ref).all() and ref.std() > 0.5
    ref_tokens = res.generate(ids, max_tokens=10, temperature=0).token_ids
    # routing is decisive per token: different tokens pick different experts in every layer
    trace = res.routing_trace()  # [tokens, MoE layers, k]
    assert trace.shape[1:] == (QTINY.n_layers, QTINY.n_experts_used)
    assert all(len(np.unique(trace[:, m])) > 2 * QTINY.n_experts_used for m in range(QTINY.n_layers))
    del res

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="strata_jax"):
        off = _load(expert_slots=QTINY.n_layers * 8)
    assert off.ple_table == "host" and "pinned host memory" in caplog.text and "experts are offloaded" in caplog.text
    table = off.params.ple[0].table
    assert table.memory_kind == "pinned_host" and table.rows.data.sharding.memory_kind == "pinned_host"
    assert not off.stats()["resident"]
    assert np.array_equal(np.asarray(off.logits(ids)), ref)
    assert off.generate(ids, max_tokens=10, temperature=0).token_ids == ref_tokens
    assert off.stats()["misses"] > 0


@pytest.mark.slow
def test_ple_table_device_with_offloaded_experts_equals_host():
    """ple_table="device" overrides auto: the table stays on the device next to offloaded experts, same tokens."""
    ids = np.random.default_rng(1).integers(0, 420, 20).tolist()
    host = _load(expert_slots=QTINY.n_layers * 8, ple_table="host")
    dev = _load(expert_slots=QTINY.n_layers * 8, ple_table="device")
    assert (host.ple_table, dev.ple_table) == ("host", "device")
    assert np.array_equal(np.asarray(host.logits(ids)), np.asarray(dev.logits(ids)))


def test_qwen4exp_with_attention_layers_only_decodes_as_its_full_forward(tmp_path):
    """A qwen4exp whose every layer is full attention (interval 1, no PLE): no DeltaNet state, but QSA's
    block keys are still per-row state beside the KV cache; greedy decode equals the full forward's argmax."""
    spec = dataclasses.replace(SHAPES["qtiny"], full_attention_interval=1, ple_layer=-1)
    m = strata_jax.load(write_synthetic_gguf(tmp_path / "attn.gguf", spec), ctx=256)
    assert set(m.config.layer_kinds) == {"attention"} and m.config.has_recurrent_state
    prompt = list(range(5, 25))
    g = m.generate(prompt, max_tokens=6, temperature=0)
    assert len(g.token_ids) == 6
    assert m.logits(prompt + g.token_ids)[len(prompt) - 1:-1].argmax(-1).tolist() == g.token_ids
