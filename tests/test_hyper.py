"""qwen4exp hyper-connections (strata_jax/model/layers/hyper.py) against transformers' Qwen4ExpTextGatedResidual
and Qwen4ExpTextDecoderLayer (torch fp32, random weights), with the tensors mapped to the GGUF layout the
way llama.cpp's converter does."""

from __future__ import annotations

import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn
from transformers.models.qwen4_exp.modular_qwen4_exp import (Qwen4ExpTextConfig, Qwen4ExpTextDecoderLayer,
                                                             Qwen4ExpTextGatedResidual)

from strata_jax.core.errors import TensorShapeError
from strata_jax.core.qtensor import QTensor
from strata_jax.gguf.reader import metadata_view
from strata_jax.model.layers import hyper
from strata_jax.model.layers.hyper import HyperDims, HyperParams, LayerHyper
from strata_jax.model.kernels import Kernels

D, HC, RANK = 64, 3, 32
B, T = 2, 7
KERNELS = Kernels()
RTOL = 1e-4


def _config() -> Qwen4ExpTextConfig:
    return Qwen4ExpTextConfig(
        hidden_size=D, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        hc_count=HC, hc_lowrank=RANK, rms_norm_eps=1e-6, layer_types=["linear_attention"])


def _randomize(module: nn.Module, seed: int) -> None:
    """Realistic scales: unit-ish activations through every matrix, and zero-centred norm gammas far
    enough from 0 that a missing (1 + w) shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, prm in module.named_parameters():
            if name.endswith("norm.weight"):
                prm.copy_(0.3 * torch.randn(prm.shape, generator=g))
            else:
                prm.copy_(torch.randn(prm.shape, generator=g) / np.sqrt(prm.shape[-1]))


def gguf_tensors(hc: Qwen4ExpTextGatedResidual, base: str) -> dict[str, np.ndarray]:
    """HF -> GGUF the way the converter does it: names from gguf-py's tensor_mapping.py (the QWEN4EXP
    block mappings: attn_hyper_connection.* -> blk.{i}.hc_attn_*, mlp_hyper_connection.* -> hc_ffn_*,
    hyper_connection_mixer.* -> output_hc_*); conversion/qwen.py Qwen3NextModel.modify_tensors adds 1 to
    every `*norm.weight` (hc_norm included); matrices keep the torch [out, in] layout."""
    out = {f"{base}_norm.weight": hc.hc_norm.weight.detach().numpy() + 1,
           f"{base}_down.weight": hc.input_mix_weight_down.weight.detach().numpy(),
           f"{base}_up.weight": hc.input_mix_weight_up.weight.detach().numpy()}
    if hc.block_inject_weight is not None:
        out[f"{base}_inject.weight"] = hc.block_inject_weight.weight.detach().numpy()
    return out


def getter(tensors: dict[str, np.ndarray], qtype=None):
    """get(name) as the loader gives it: matrices as QTensor (float, or quantized to qtype), vectors float32."""
    def get(name):
        a = tensors[name].astype(np.float32)
        if a.ndim == 1:
            return jnp.asarray(a)
        if qtype is None:
            return QTensor(jnp.asarray(a), None, a.shape[-1])
        return QTensor(jnp.asarray(quantize(a, qtype)), qtype, a.shape[-1])
    return get


def dequantized(tensors: dict[str, np.ndarray], qtype) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    return {k: (dequantize(quantize(v, qtype), qtype) if v.ndim == 2 else v) for k, v in tensors.items()}


DIMS = HyperDims(hc_count=HC, low_rank=RANK, d_model=D, rms_eps=1e-6)


def _close(ours, ref, rtol=RTOL):
    ref = np.asarray(ref, np.float64)
    np.testing.assert_allclose(np.asarray(ours, np.float64), ref, rtol=0, atol=rtol * np.abs(ref).max())


@pytest.fixture(scope="module")
def residual():
    hc = Qwen4ExpTextGatedResidual(_config())
    _randomize(hc, 1)
    return hc


def _hidden(seed: int) -> torch.Tensor:
    # the streams differ (as they do after a few blocks) and are not unit-scale, so the norm matters
    g = torch.Generator().manual_seed(seed)
    return 2.0 * torch.randn(B, T, HC * D, generator=g) + 0.5


def test_mix_matches_transformers(residual):
    x = _hidden(2)
    with torch.no_grad():
        mixed, hyper_input, inject = residual(x)
    assert torch.equal(hyper_input, x)
    p = HyperParams.from_gguf(getter(gguf_tensors(residual, "blk.0.hc_attn")), "blk.0.hc_attn", DIMS)
    h, w = hyper.mix(p, jnp.asarray(x.numpy()).reshape(B, T, HC, D), DIMS, KERNELS)
    assert h.shape == (B, T, D) and w.shape == (B, T, HC)
    _close(h, mixed.numpy())
    _close(w, inject.numpy())
    assert float(jnp.std(w)) > 0.05  # the inject weights really differ per stream and token


def test_head_mixer_matches_transformers():
    head = Qwen4ExpTextGatedResidual(_config(), use_combine=False)
    _randomize(head, 3)
    x = _hidden(4)
    with torch.no_grad():
        ref = head(x)
    p = hyper.head_mixer_from_gguf(getter(gguf_tensors(head, "output_hc")), DIMS)
    assert p.inject is None
    h, w = hyper.mix(p, jnp.asarray(x.numpy()).reshape(B, T, HC, D), DIMS, KERNELS)
    assert w is None
    _close(h, ref.numpy())


class _ToyBlock(nn.Module):
    """Stands in for the attention / MoE block: any per-token map of the mixed input will do."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(D, D, generator=g) / np.sqrt(D))

    def forward(self, x, **kwargs):
        return torch.tanh(x @ self.w.T)


def test_decoder_layer_residual_matches_transformers():
    """The whole hyper-connection wiring of a layer: the embedding repeated into the streams, mix ->
    block -> combine around both blocks (HF's own Qwen4ExpTextDecoderLayer.forward, its blocks replaced
    by toy ones), then the final mixer."""
    cfg = _config()
    layer = Qwen4ExpTextDecoderLayer(cfg, 0)
    layer.linear_attn, layer.mlp = _ToyBlock(5), _ToyBlock(6)
    head = Qwen4ExpTextGatedResidual(cfg, use_combine=False)
    _randomize(layer.attn_hyper_connection, 7)
    _randomize(layer.mlp_hyper_connection, 8)
    _randomize(head, 9)
    emb = torch.randn(B, T, D, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        x = emb.repeat(1, 1, HC)  # Qwen4ExpTextModel.forward
        x = layer(x, position_embeddings=None)
        ref_streams = x.numpy()
        ref = head(x).numpy()

    tensors = {**gguf_tensors(layer.attn_hyper_connection, "blk.0.hc_attn"),
               **gguf_tensors(layer.mlp_hyper_connection, "blk.0.hc_ffn"), **gguf_tensors(head, "output_hc")}
    get = getter(tensors)
    lp = LayerHyper.from_gguf(get, 0, DIMS)
    hp = hyper.head_mixer_from_gguf(get, DIMS)
    w_attn, w_mlp = (jnp.asarray(m.w.detach().numpy()) for m in (layer.linear_attn, layer.mlp))
    xs = hyper.streams(jnp.asarray(emb.numpy()), DIMS)
    xs, extra = hyper.block(lp.attn, xs, lambda h: (jnp.tanh(h @ w_attn.T), "state"), DIMS, KERNELS)
    assert extra == "state"
    xs, _ = hyper.block(lp.ffn, xs, lambda h: jnp.tanh(h @ w_mlp.T), DIMS, KERNELS)
    _close(xs.reshape(B, T, HC * D), ref_streams)
    h, _ = hyper.mix(hp, xs, DIMS, KERNELS)
    _close(h, ref)


def test_quantized_matrices(residual):
    """Q8_0 matrices (the dense path dequantizes them inside jit) give what their dequantized values give."""
    x = jnp.asarray(_hidden(11).numpy()).reshape(B, T, HC, D)
    tensors = gguf_tensors(residual, "blk.0.hc_ffn")
    q8 = HyperParams.from_gguf(getter(tensors, GGMLQuantizationType.Q8_0), "blk.0.hc_ffn", DIMS)
    assert q8.down.qtype == GGMLQuantizationType.Q8_0
    ref = HyperParams.from_gguf(getter(dequantized(tensors, GGMLQuantizationType.Q8_0)), "blk.0.hc_ffn", DIMS)
    for a, b in zip(jax.jit(hyper.mix, static_argnums=(2, 3))(q8, x, DIMS, KERNELS), hyper.mix(ref, x, DIMS, KERNELS)):
        _close(a, b, 1e-5)


def test_shape_mismatch_is_refused(residual):
    tensors = gguf_tensors(residual, "blk.0.hc_attn")
    tensors["blk.0.hc_attn_up.weight"] = tensors["blk.0.hc_attn_up.weight"].T.copy()
    with pytest.raises(TensorShapeError, match="hc_attn_up"):
        HyperParams.from_gguf(getter(tensors), "blk.0.hc_attn", DIMS)


@pytest.mark.slow
def test_names_and_keys_are_the_converters(llama_cpp_converter):
    """The tensor names and KV keys the builders read are the pinned converter's gguf-py qwen4exp ones."""
    c = runpy.run_path(str(llama_cpp_converter.parent / "gguf-py" / "gguf" / "constants.py"))
    arch = c["MODEL_ARCH"].QWEN4EXP
    names = {c["TENSOR_NAMES"][t].format(bid=0) for t in c["MODEL_TENSORS"][arch]}
    seen = []
    LayerHyper.from_gguf(lambda n: seen.append(n) or _fake(n), 0, DIMS)
    hyper.head_mixer_from_gguf(lambda n: seen.append(n) or _fake(n), DIMS)
    assert len(seen) == 11
    assert {n.removesuffix(".weight") for n in seen} <= names
    keys, a = c["Keys"], c["MODEL_ARCH_NAMES"][arch]
    md = {keys.HyperConnection.COUNT: HC, keys.HyperConnection.LOW_RANK: RANK, keys.LLM.EMBEDDING_LENGTH: D,
          keys.Attention.LAYERNORM_RMS_EPS: 1e-6}
    assert HyperDims.from_metadata(metadata_view({k.format(arch=a): v for k, v in md.items()}, a)) == DIMS


def _fake(name: str):
    shapes = {"norm": (HC * D,), "down": (RANK, HC * D), "up": (HC * D, RANK), "inject": (HC, HC * D)}
    shape = shapes[name.removesuffix(".weight").rsplit("_", 1)[1]]
    return jnp.zeros(shape) if len(shape) == 1 else QTensor(jnp.zeros(shape), None, shape[-1])
