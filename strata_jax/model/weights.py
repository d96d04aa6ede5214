"""Loading the parameter pytrees from a GGUF file (each layer kind's Params live in its own module).

Matrices stay in their GGML block bytes (`QTensor`) on the device and are dequantized inside jit;
small vectors (norms, biases) and routers are made float32 at load. Routed experts are not in the
layer params: the MoE block reaches them through an ExpertProvider (core/experts.py), whose byte
layout `expert_spec` describes from the file.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gguf import GGMLQuantizationType

from strata_jax.core.errors import TensorShapeError
from strata_jax.core.experts import EXPERT_TENSORS, FUSED_EXPERT_TENSORS, ExpertSpec, expert_parts, expert_shapes
from strata_jax.core.qtensor import QTensor
from strata_jax.gguf import quant
from strata_jax.gguf.reader import GGUFFile, TensorInfo
from strata_jax.model.config import ATTENTION, ModelConfig
from strata_jax.model.forward import LayerParams, Params
from strata_jax.model import hybrid
from strata_jax.model.layers import deltanet, hyper, ple, qsa
from strata_jax.model.hybrid import HybridLayerParams, HybridParams
from strata_jax.model.layers.attention import AttnParams, GatedAttnParams
from strata_jax.model.layers.basic import MLPParams, Projections
from strata_jax.model.layers.mla import MLAParams
from strata_jax.model.layers.moe import MoEParams

log = logging.getLogger("strata_jax")


@struct.dataclass
class NextNParams:
    """An MTP ("nextn") block, loaded for speculative drafting, never run by the forward pass (llama.cpp's
    graph_mtp: h' = block(eh_proj @ [enorm(embed(t)) | hnorm(h)]), its logits head(shared_head_norm(h'))).
    `block` is its family's layer: a LayerParams (glm4moe) or a full-attention HybridLayerParams
    (qwen3next, qwen35*), with the MoE block's router, bias and shared expert; its routed experts stay in
    the file (shape-checked at load, named by `expert_names`) until drafting puts them in an expert store."""

    eh_proj: QTensor  # [D, 2D]
    enorm_D: jax.Array
    hnorm_D: jax.Array
    block: LayerParams | HybridLayerParams
    shared_head_norm_D: jax.Array | None  # None: the model's output norm
    shared_head: QTensor | None  # [V, D]; None: the model's lm_head
    embed: QTensor | None  # [V, D]; None: the model's embedding
    expert_names: tuple[str, ...] = struct.field(pytree_node=False, default=())
    experts: Any = None  # drafting (--spec mtp): the block's routed experts, resident (an ExpertProvider)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _dequant_once(data, qtype, n_cols, dtype):
    return quant.dequantize(data, qtype, n_cols, dtype)


class WeightLoader:
    """Moves tensors of one GGUF file to a device, checking shapes and types as it goes.

    dequantize_dense: dequantize dense matrices once at load, to `dense_dtype`, instead of in every
    step. On a CPU, dequantizing ~0.5 B weights per token costs seconds while reading float32 weights
    costs ~0.2 s, so that is the CPU default; on a GPU the quantized bytes are the point (fewer bytes
    read per token). Routed experts always stay quantized."""

    def __init__(self, gguf: GGUFFile, cfg: ModelConfig, device: Any = None, *,
                 dequantize_dense: bool = False, dense_dtype: Any = jnp.float32):
        self.gguf, self.cfg, self.device = gguf, cfg, device
        self.dequantize_dense, self.dense_dtype = dequantize_dense, dense_dtype
        self.bytes_loaded = 0
        self.consumed: set[str] = set()  # tensor names read so far (a test checks none is left over)

    def get(self, name: str) -> QTensor | jax.Array:
        """The layer modules' accessor: a matrix as a QTensor, a vector or a short convolution's taps
        (`*conv1d*`, [Kc, Cc]) as a float32 array, in the file's (numpy) shape."""
        shape = tuple(self.gguf.tensor(name).shape)
        if len(shape) == 1 or "conv1d" in name:
            return self.f32(name, shape)
        return self.qtensor(name, shape)

    def info(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        t = self.gguf.tensor(name)
        self.consumed.add(name)
        if tuple(t.shape) != tuple(shape):
            raise TensorShapeError(
                f"{self.gguf.path}: tensor {name!r} has shape {t.shape}, expected {tuple(shape)} from the "
                f"metadata of this {self.cfg.arch} model. The file is inconsistent or from an unsupported variant."
            )
        quant.check_supported(t.ggml_type, name)
        return t

    def _put(self, a: np.ndarray) -> jax.Array:
        self.bytes_loaded += a.nbytes
        return jax.device_put(a, self.device)

    def qtensor(self, name: str, shape: tuple[int, ...]) -> QTensor:
        t = self.info(name, shape)
        return self._qtensor(np.ascontiguousarray(t.data), t.ggml_type, t.shape[-1])

    def _qtensor(self, data: np.ndarray, qtype, n_cols: int) -> QTensor:
        dev = self._put(data)
        if self.dequantize_dense:
            return QTensor(_dequant_once(dev, qtype, n_cols, self.dense_dtype), None, n_cols)
        return QTensor(dev, qtype, n_cols)

    def projections(self, mats: list[tuple[str, int]], n_cols: int) -> Projections:
        """Projections of one input from (tensor prefix, output rows) pairs: `prefix.weight` [rows, n_cols]
        and an optional `prefix.bias`; consecutive matrices of one GGML type become one stacked QTensor."""
        infos = [self.info(f"{name}.weight", (rows, n_cols)) for name, rows in mats]
        groups: list[list[int]] = []
        for i, t in enumerate(infos):
            if groups and t.ggml_type == infos[groups[-1][0]].ggml_type:
                groups[-1].append(i)
            else:
                groups.append([i])
        out, biases, sizes = [], [], []
        for g in groups:
            data = np.concatenate([np.ascontiguousarray(infos[i].data) for i in g], axis=0)
            out.append(self._qtensor(data, infos[g[0]].ggml_type, n_cols))
            rows = [mats[i][1] for i in g]
            b = [self.optional_f32(f"{mats[i][0]}.bias", (mats[i][1],)) for i in g]
            biases.append(None if all(x is None for x in b) else
                          jnp.concatenate([jnp.zeros((r,), jnp.float32) if x is None else x for x, r in zip(b, rows)]))
            sizes.append(tuple(rows))
        return Projections(tuple(out), tuple(biases), tuple(sizes))

    def f32(self, name: str, shape: tuple[int, ...]) -> jax.Array:
        """Small tensors (norms, biases, routers): dequantize once, on the host, to float32."""
        t = self.info(name, shape)
        if t.ggml_type == GGMLQuantizationType.F32:
            arr = np.ascontiguousarray(t.data).view(np.float32).reshape(shape)
        else:
            from gguf.quants import dequantize  # the reference dequantizer; these tensors are tiny

            arr = dequantize(np.ascontiguousarray(t.data), t.ggml_type).astype(np.float32).reshape(shape)
        return self._put(arr)

    def optional_f32(self, name: str, shape: tuple[int, ...]) -> jax.Array | None:
        return self.f32(name, shape) if self.gguf.has(name) else None

    def qtensor_rows(self, name: str, shape: tuple[int, int], rows: np.ndarray) -> QTensor:
        """Some rows of matrix `name` (GGML rows are quantized independently: a row subset is a valid
        matrix), e.g. one of two projections a file stores fused."""
        t = self.info(name, shape)
        return self._qtensor(np.ascontiguousarray(np.asarray(t.data)[rows]), t.ggml_type, t.shape[-1])


def expert_tensor_names(gguf: GGUFFile, layer: int) -> tuple[str, ...]:
    """The routed-expert tensors of block `layer`: gate, up, down, or (a fused file) gate_up, down."""
    fused = f"blk.{layer}.{FUSED_EXPERT_TENSORS[0]}.weight"
    names = FUSED_EXPERT_TENSORS if gguf.has(fused) and not gguf.has(f"blk.{layer}.{EXPERT_TENSORS[0]}.weight") \
        else EXPERT_TENSORS
    return tuple(f"blk.{layer}.{n}.weight" for n in names)


def expert_infos(loader: WeightLoader, moe_idx: int) -> list[TensorInfo]:
    """The expert tensors of MoE layer moe_idx (gate, up, down; or gate_up, down), shape- and type-checked."""
    return block_expert_infos(loader, loader.cfg.moe_layers[moe_idx])


def block_expert_infos(loader: WeightLoader, layer: int) -> list[TensorInfo]:
    """The routed-expert tensors of block `layer` (a trunk MoE layer or an MTP block), shape- and type-checked."""
    cfg = loader.cfg
    E, F, D = cfg.n_experts, cfg.expert_ffn_dim, cfg.d_model
    names = expert_tensor_names(loader.gguf, layer)
    shapes = expert_shapes(E, F, D) if len(names) == 3 else ((E, 2 * F, D), (E, D, F))
    return [loader.info(n, shape) for n, shape in zip(names, shapes)]


def expert_spec(loader: WeightLoader, layers: tuple[int, ...] | None = None) -> ExpertSpec:
    """The routed experts' layout (checked against the config) as plain values, for offloading: of the
    blocks `layers` (default the MoE layers; an MTP block's, for its own provider)."""
    cfg = loader.cfg
    layers = tuple(cfg.moe_layers) if layers is None else layers
    names = tuple(expert_tensor_names(loader.gguf, layer) for layer in layers)
    return ExpertSpec(layers, cfg.n_experts, cfg.n_experts_used,
                      tuple(expert_parts(block_expert_infos(loader, layer)) for layer in layers),
                      names if any(len(n) == 2 for n in names) else ())


def _moe_params(loader: WeightLoader, p: str) -> MoEParams:
    cfg = loader.cfg
    D = cfg.d_model
    shared = shared_gate = None
    if cfg.shared_expert_ffn_dim:
        Fs = cfg.shared_expert_ffn_dim
        shared = MLPParams(
            gate_up=loader.projections([(p + "ffn_gate_shexp", Fs), (p + "ffn_up_shexp", Fs)], D),
            w_down=loader.qtensor(p + "ffn_down_shexp.weight", (D, Fs)),
        )
        # llama.cpp's converter writes this gate as a [1, D] matrix; older files as a [D] vector
        gate_name = p + "ffn_gate_inp_shexp.weight"
        if loader.gguf.has(gate_name):
            gate_shape = (1, D) if len(loader.gguf.tensor(gate_name).shape) == 2 else (D,)
            shared_gate = loader.f32(gate_name, gate_shape).reshape(D)
    E, F = cfg.n_experts, cfg.expert_ffn_dim
    expert_bias = None
    if loader.gguf.has(p + "ffn_gate_exps.bias"):
        expert_bias = (loader.f32(p + "ffn_gate_exps.bias", (E, F)), loader.f32(p + "ffn_up_exps.bias", (E, F)),
                       loader.f32(p + "ffn_down_exps.bias", (E, D)))
    return MoEParams(router_ED=loader.f32(p + "ffn_gate_inp.weight", (E, D)), shared=shared,
                     shared_gate_D=shared_gate, score_bias_E=loader.optional_f32(p + "exp_probs_b.bias", (E,)),
                     router_bias_E=loader.optional_f32(p + "ffn_gate_inp.bias", (E,)), expert_bias=expert_bias)


def _beta_alpha_split(loader: WeightLoader, layer: int, dims):
    """qwen3next stores ssm_beta and ssm_alpha as one ssm_ba matrix, per key head j its R = Hv / Hk beta
    rows then its R alpha rows (HF's in_proj_ba): a qtensor getter that serves each as its own rows,
    value heads in the grouped order (h = j * R + r) the rest of the layer uses."""
    name = f"blk.{layer}.ssm_ba.weight"
    if not loader.gguf.has(name):
        return loader.qtensor
    Hk, Hv = dims.n_k_heads, dims.n_v_heads
    R = Hv // Hk
    rows = np.arange(2 * Hv).reshape(Hk, 2, R)
    split = {f"blk.{layer}.ssm_beta.weight": rows[:, 0].reshape(-1), f"blk.{layer}.ssm_alpha.weight": rows[:, 1].reshape(-1)}

    def get(n: str, shape):
        if n in split:
            return loader.qtensor_rows(name, (2 * Hv, dims.d_model), split[n])
        return loader.qtensor(n, shape)

    return get


def _gated_attn_params(loader: WeightLoader, p: str, indexer=None) -> GatedAttnParams:
    cfg = loader.cfg
    D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return GatedAttnParams(
        qkv=loader.projections([(p + "attn_q", 2 * H * Dh), (p + "attn_k", K * Dh), (p + "attn_v", K * Dh)], D),
        wo=loader.qtensor(p + "attn_output.weight", (D, H * Dh)),
        q_norm=loader.f32(p + "attn_q_norm.weight", (Dh,)),
        k_norm=loader.f32(p + "attn_k_norm.weight", (Dh,)),
        indexer=indexer,
    )


def _ffn_params(loader: WeightLoader, p: str) -> tuple[MoEParams | None, MLPParams | None]:
    cfg = loader.cfg
    if cfg.is_moe:
        return _moe_params(loader, p), None
    F, D = cfg.ffn_dim, cfg.d_model
    return None, MLPParams(gate_up=loader.projections([(p + "ffn_gate", F), (p + "ffn_up", F)], D),
                           w_down=loader.qtensor(p + "ffn_down.weight", (D, F)))


def _hybrid_nextn_block(loader: WeightLoader, p: str) -> HybridLayerParams:
    """A qwen3next / qwen35* MTP block's layer: full gated attention with the plain residual's two norms."""
    D = loader.cfg.d_model
    moe, mlp = _ffn_params(loader, p)
    return HybridLayerParams(attn=_gated_attn_params(loader, p), linear=None, hc=None, moe=moe, mlp=mlp,
                             attn_norm_D=loader.f32(p + "attn_norm.weight", (D,)),
                             ffn_norm_D=loader.f32(p + "post_attention_norm.weight", (D,)))


def load_hybrid_params(loader: WeightLoader, ple_table_memory: str = "device") -> HybridParams:
    """The hybrid family's params (model/hybrid.py); the layer modules build their own (model/layers/deltanet.py,
    qsa.py, ple.py, hyper.py). ple_table_memory: where qwen4exp's per_layer_token_embd lives ("device",
    or "pinned_host": gathered on the host)."""

    cfg = loader.cfg
    hc = cfg.hc_count > 0
    if hc:
        hd = hybrid.hyper_dims(cfg)
    D, V = cfg.d_model, cfg.vocab_size
    dn = cfg.linear
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        attn = linear = hc_p = attn_norm = ffn_norm = None
        if cfg.kind(i) == ATTENTION:
            indexer = None
            if cfg.qsa and cfg.qsa[i] is not None:
                indexer = qsa.QSAParams.from_gguf(loader.get, i, cfg.qsa[i], D)
            attn = _gated_attn_params(loader, p, indexer)
        else:
            linear = deltanet.load_params(_beta_alpha_split(loader, i, dn), loader.f32, i, dn)
        if hc:
            hc_p = hyper.LayerHyper.from_gguf(loader.get, i, hd)
        else:
            attn_norm = loader.f32(p + "attn_norm.weight", (D,))
            ffn_norm = loader.f32(p + "post_attention_norm.weight", (D,))
        moe, mlp = _ffn_params(loader, p)
        layers.append(HybridLayerParams(attn=attn, linear=linear, hc=hc_p, moe=moe, mlp=mlp,
                                        attn_norm_D=attn_norm, ffn_norm_D=ffn_norm))
    ple_p = tuple(ple.PLEParams.from_gguf(ple.loader_get(loader), i, cfg.ple,
                                          table_memory_kind=ple_table_memory, device=loader.device)
                  for i in (cfg.ple.layers if cfg.ple is not None else ()))
    embed = loader.qtensor("token_embd.weight", (V, D))
    if hc:
        if not loader.gguf.has("output.weight"):
            raise TensorShapeError(f"{loader.gguf.path}: qwen4exp without output.weight (tied head) is not supported")
        return HybridParams(embed=embed, layers=tuple(layers), hc_head=hyper.head_mixer_from_gguf(loader.get, hd),
                            lm_head=loader.qtensor("output.weight", (V, D)), ple=ple_p)
    lm_head = embed if cfg.tied_embeddings else loader.qtensor("output.weight", (V, D))
    return HybridParams(embed=embed, layers=tuple(layers), hc_head=None, lm_head=lm_head,
                        out_norm_D=loader.f32("output_norm.weight", (D,)), nextn=_nextn_params(loader), ple=ple_p)


def load_params(loader: WeightLoader, ple_table_memory: str = "device") -> Params | HybridParams:
    """ple_table_memory: qwen4exp's PLE table placement (load_hybrid_params); the other families have none."""
    cfg = loader.cfg
    if cfg.is_hybrid:
        return load_hybrid_params(loader, ple_table_memory)
    D, V = cfg.d_model, cfg.vocab_size
    layers = tuple(_layer_params(loader, i, moe=i in cfg.moe_layers) for i in range(cfg.n_layers))
    embed = loader.qtensor("token_embd.weight", (V, D))
    lm_head = embed if cfg.tied_embeddings else loader.qtensor("output.weight", (V, D))
    return Params(embed=embed, layers=layers, out_norm_D=loader.f32("output_norm.weight", (D,)), lm_head=lm_head,
                  nextn=_nextn_params(loader))


def _mla_params(loader: WeightLoader, p: str) -> MLAParams:
    cfg = loader.cfg
    d, D, H = cfg.mla, cfg.d_model, cfg.n_heads
    Rq, Rk = d.q_lora_rank, d.kv_lora_rank
    q_first = (p + "attn_q_a", Rq) if Rq else (p + "attn_q", H * d.qk_dim)
    return MLAParams(
        norm_D=loader.f32(p + "attn_norm.weight", (D,)),
        qkv_a=loader.projections([q_first, (p + "attn_kv_a_mqa", Rk + d.rope_dim)], D),
        q_a_norm_Rq=loader.f32(p + "attn_q_a_norm.weight", (Rq,)) if Rq else None,
        q_b=loader.qtensor(p + "attn_q_b.weight", (H * d.qk_dim, Rq)) if Rq else None,
        kv_a_norm_Rk=loader.f32(p + "attn_kv_a_norm.weight", (Rk,)),
        k_b=loader.qtensor(p + "attn_k_b.weight", (H, Rk, d.nope_dim)),
        v_b=loader.qtensor(p + "attn_v_b.weight", (H, d.v_dim, Rk)),
        wo=loader.qtensor(p + "attn_output.weight", (D, H * d.v_dim)),
    )


def _layer_params(loader: WeightLoader, i: int, moe: bool) -> LayerParams:
    """Block i: attention, the FFN norm, and a MoE block (its routed experts excepted) or a dense MLP."""
    cfg = loader.cfg
    D = cfg.d_model
    p = f"blk.{i}."
    qn_shape = (cfg.head_dim,) if cfg.qk_norm == "head" else (cfg.q_dim,)
    kn_shape = (cfg.head_dim,) if cfg.qk_norm == "head" else (cfg.kv_dim,)
    if cfg.mla is not None:
        attn = _mla_params(loader, p)
    else:
        attn = AttnParams(
            norm_D=loader.f32(p + "attn_norm.weight", (D,)),
            qkv=loader.projections([(p + "attn_q", cfg.q_dim), (p + "attn_k", cfg.kv_dim), (p + "attn_v", cfg.kv_dim)], D),
            wo=loader.qtensor(p + "attn_output.weight", (D, cfg.q_dim)),
            q_norm=loader.optional_f32(p + "attn_q_norm.weight", qn_shape),
            k_norm=loader.optional_f32(p + "attn_k_norm.weight", kn_shape),
            sinks_H=loader.optional_f32(p + "attn_sinks.weight", (cfg.n_heads,)),
            wo_bias_D=loader.optional_f32(p + "attn_output.bias", (D,)),
        )
    mlp = moe_p = None
    if moe:
        moe_p = _moe_params(loader, p)
    else:
        F = cfg.ffn_dim
        mlp = MLPParams(
            gate_up=loader.projections([(p + "ffn_gate", F), (p + "ffn_up", F)], D),
            w_down=loader.qtensor(p + "ffn_down.weight", (D, F)),
        )
    return LayerParams(attn=attn, ffn_norm_D=loader.f32(f"{p}{cfg.ffn_norm_tensor}.weight", (D,)), mlp=mlp, moe=moe_p)


def _nextn_params(loader: WeightLoader) -> tuple[NextNParams, ...]:
    """The MTP blocks after the text layers (blk.{n_layers + j}), of either family (see NextNParams),
    where the file has them: a converter's --no-mtp leaves them out, and a file may also keep the count
    and drop the tensors, which llama.cpp reads as trunk only. Their routed experts are shape- and
    type-checked here, read when drafting puts them in an expert store."""
    cfg, g = loader.cfg, loader.gguf
    D, V = cfg.d_model, cfg.vocab_size
    out = []
    for i in range(cfg.n_layers, cfg.n_layers + cfg.n_nextn_layers):
        p = f"blk.{i}."
        if not g.has(p + "nextn.eh_proj.weight"):
            continue
        if cfg.is_hybrid:
            block = _hybrid_nextn_block(loader, p)
        else:
            block = _layer_params(loader, i, moe=g.has(p + "ffn_gate_inp.weight"))
        experts = tuple(t.name for t in block_expert_infos(loader, i)) if block.moe is not None else ()
        optional_q = lambda n: loader.qtensor(n, (V, D)) if g.has(n) else None  # noqa: E731
        out.append(NextNParams(
            eh_proj=loader.qtensor(p + "nextn.eh_proj.weight", (D, 2 * D)),
            enorm_D=loader.f32(p + "nextn.enorm.weight", (D,)),
            hnorm_D=loader.f32(p + "nextn.hnorm.weight", (D,)),
            block=block,
            shared_head_norm_D=loader.optional_f32(p + "nextn.shared_head_norm.weight", (D,)),
            shared_head=optional_q(p + "nextn.shared_head_head.weight"),
            embed=optional_q(p + "nextn.embed_tokens.weight"),
            expert_names=experts,
        ))
    return tuple(out)
