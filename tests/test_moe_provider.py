"""The MoE block and the forward pass against a minimal ExpertProvider defined here: every expert of
every MoE layer in one device pool (slot = moe_idx * E + expert id), each lookup recorded. The block's
output must equal a plain jnp MoE computed from gguf-py's dequantization of the file's tensors, and
the lookups must be exactly the routed ids: model/ needs nothing from offload/."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from gguf.quants import dequantize as gguf_dequantize

from strata_jax.core.experts import ExpertCounters, ExpertRows, fused_rows
from strata_jax.gguf.reader import GGUFFile
from strata_jax.model.config import ModelConfig
from strata_jax.model.forward import KVCache, forward
from strata_jax.model.kernels import Kernels
from strata_jax.model.layers.moe import moe_block
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.model.weights import WeightLoader, expert_infos, expert_spec, load_params

SPEC = SyntheticSpec(arch="qwen2moe", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8,
                     n_experts_used=2, expert_ffn_dim=32, shared_expert_ffn_dim=32, vocab_size=320, qtype="Q8_0",
                     expert_qtype="Q4_0", seed=3)
KERNELS = Kernels(qmatvec="off", platform="cpu")


@struct.dataclass
class OnePool:
    """All experts in one pool; `looked_up` grows by each lookup's (moe_idx, ids)."""

    rows: ExpertRows
    counters: ExpertCounters
    looked_up: tuple = ()
    n_experts: int = struct.field(pytree_node=False, default=0)
    few_limit: int = struct.field(pytree_node=False, default=0)  # few path up to this many lookups
    prefetch_depth: int = struct.field(pytree_node=False, default=0)

    def few_path(self, moe_idx, n_lookups):
        return n_lookups <= self.few_limit

    def lookup(self, moe_idx, ids_Nk, valid_N=None):
        wanted = ids_Nk if valid_N is None else jnp.where(valid_N[:, None], ids_Nk, -1)
        me = self.replace(looked_up=self.looked_up + ((moe_idx, wanted),),
                          counters=self.counters.add(moe_idx, hits=jnp.sum(wanted >= 0).astype(jnp.int32)))
        return me, self.rows, moe_idx * self.n_experts + ids_Nk, None

    def prefetch(self, moe_idx, predicted, after):
        return self, after

    def stream(self, moe_idx, cached=False):
        return self.count(moe_idx, streamed=self.n_experts)

    def group(self, moe_idx, first_expert, n, cached=False):
        start = moe_idx * self.n_experts + first_expert
        return ExpertRows(jax.lax.dynamic_slice_in_dim(self.rows.data, start, n, axis=0), self.rows.parts)

    def card_streamer(self, moe_idx, cached=False):
        return None

    def layer(self, moe_idx):
        return ExpertRows(self.rows.data[moe_idx * self.n_experts:(moe_idx + 1) * self.n_experts], self.rows.parts)

    def count(self, moe_idx, **values):
        return self.replace(counters=self.counters.add(moe_idx, **values))

    def finish(self, routed_MNk):
        return self

    def split(self):
        return self, None

    def join(self, fixed):
        return self


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("provider") / "moe.gguf", SPEC)
    gguf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gguf)
    loader = WeightLoader(gguf, cfg, jax.devices("cpu")[0], dequantize_dense=True)
    params = load_params(loader)
    spec = expert_spec(loader)
    assert len({parts for parts in spec.layer_parts}) == 1  # one row layout: one pool can hold every layer
    infos = [expert_infos(loader, i) for i in range(len(cfg.moe_layers))]
    rows = ExpertRows(jnp.asarray(np.concatenate([fused_rows(i) for i in infos])), spec.layer_parts[0])
    return gguf, cfg, params, rows, infos


def _provider(cfg, rows, few_limit):
    return OnePool(rows, ExpertCounters.zeros(len(cfg.moe_layers)), n_experts=cfg.n_experts, few_limit=few_limit)


def _reference_moe(x_ND, layer_params, infos, cfg, gguf, block):
    """Softmax top-k routing and SwiGLU experts in float64 numpy from gguf-py's dequantization."""
    x = np.asarray(x_ND, np.float64)
    g, u, d = (gguf_dequantize(np.asarray(t.data), t.ggml_type).astype(np.float64) for t in infos)  # [E, F, D] ...
    logits = x @ np.asarray(layer_params.router_ED, np.float64).T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, : cfg.n_experts_used]
    w = np.take_along_axis(probs, ids, -1)
    if cfg.norm_topk:
        w = w / w.sum(-1, keepdims=True)
    w = w * cfg.expert_weights_scale
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j, e in enumerate(ids[n]):
            out[n] += w[n, j] * (d[e] @ (silu(g[e] @ x[n]) * (u[e] @ x[n])))
    p = f"blk.{block}."
    deq = lambda name: gguf_dequantize(np.asarray(gguf.tensor(name).data), gguf.tensor(name).ggml_type).astype(np.float64)  # noqa: E731
    gs, us, ds = deq(p + "ffn_gate_shexp.weight"), deq(p + "ffn_up_shexp.weight"), deq(p + "ffn_down_shexp.weight")
    shared = (silu(x @ gs.T) * (x @ us.T)) @ ds.T
    gate = 1 / (1 + np.exp(-(x @ np.asarray(layer_params.shared_gate_D, np.float64))))
    return out + shared * gate[:, None], ids


@pytest.mark.parametrize("n_tokens,few", [(3, True), (24, False)])
def test_moe_block_matches_reference_and_looks_up_the_routed_ids(model, n_tokens, few):
    gguf, cfg, params, rows, infos = model
    rng = np.random.default_rng(n_tokens)
    for mi, block in enumerate(cfg.moe_layers):
        x_BTD = jnp.asarray(rng.normal(size=(1, n_tokens, cfg.d_model)), jnp.float32)
        experts = _provider(cfg, rows, few_limit=cfg.n_experts if few else 0)
        out, ids_Nk, experts = moe_block(params.layers[block].moe, experts, mi, x_BTD, cfg, KERNELS)
        ref, ref_ids = _reference_moe(x_BTD[0], params.layers[block].moe, infos[mi], cfg, gguf, block)
        np.testing.assert_allclose(np.asarray(out[0]), ref, rtol=2e-4, atol=2e-5)
        np.testing.assert_array_equal(np.sort(np.asarray(ids_Nk), -1), np.sort(ref_ids, -1))
        counters = experts.counters.as_array()
        if few:
            assert len(experts.looked_up) == 1
            looked_mi, looked_ids = experts.looked_up[0]
            assert looked_mi == mi
            np.testing.assert_array_equal(np.asarray(looked_ids), np.asarray(ids_Nk))
            assert counters[mi, 0] == ids_Nk.size and counters[mi, 2] == 0
        else:  # the many-token path asks for groups, never looks up
            assert experts.looked_up == ()
            assert counters[mi, 2] == cfg.n_experts and counters[mi, 0] == 0


def test_forward_through_the_provider(model):
    """A jitted decode step over the fake provider: the lookups it records are the routed ids it returns,
    layer by layer, and its logits are those of the engine over the same file (resident slot table)."""
    import strata_jax

    gguf, cfg, params, rows, _ = model
    experts = _provider(cfg, rows, few_limit=cfg.n_experts)
    kv = KVCache.zeros(cfg, 1, 64, jnp.float32)
    prompt = list(range(5, 12))
    step = jax.jit(forward, static_argnames=("cfg", "dtype", "kernels", "all_logits", "attn_len"))
    m = strata_jax.load(gguf.path, ctx=64)
    for pos, tok in enumerate(prompt):  # one token per step: the few-token path in every layer
        logits, kv, experts, routed_MNk = step(params, experts, kv, jnp.array([[tok]], jnp.int32),
                                               jnp.array([pos], jnp.int32), jnp.array([1], jnp.int32),
                                               cfg=cfg, dtype=jnp.float32, kernels=KERNELS)
        looked = experts.looked_up[-len(cfg.moe_layers):]
        assert [mi for mi, _ in looked] == list(range(len(cfg.moe_layers)))
        for (mi, ids), routed in zip(looked, routed_MNk):
            np.testing.assert_array_equal(np.asarray(ids), np.asarray(routed))
    np.testing.assert_allclose(np.asarray(logits[0]), m.logits(prompt)[-1], rtol=1e-4, atol=1e-4)
    assert experts.counters.as_array()[:, 0].sum() == len(prompt) * len(cfg.moe_layers) * cfg.n_experts_used


def test_padding_and_idle_rows_look_nothing_up(model):
    """Bucket padding (tokens past n_valid) and an idle row (start at the cache length) compute, but the
    provider is not asked for their experts and `routed` marks them -1; the real tokens' lookups and
    logits are those of the same tokens without the padding."""
    gguf, cfg, params, rows, _ = model
    step = jax.jit(forward, static_argnames=("cfg", "dtype", "kernels", "all_logits", "attn_len"))
    ctx, toks = 64, [[7, 9, 0, 0], [11, 12, 13, 14]]

    def run(tokens, start, n_valid):
        experts = _provider(cfg, rows, few_limit=cfg.n_experts * 8)
        kv = KVCache.zeros(cfg, len(tokens), ctx, jnp.float32)
        return step(params, experts, kv, jnp.array(tokens, jnp.int32), jnp.array(start, jnp.int32),
                    jnp.array(n_valid, jnp.int32), cfg=cfg, dtype=jnp.float32, kernels=KERNELS)

    logits, _, experts, routed_MNk = run(toks, [0, ctx], [2, 4])  # row 1 idle
    routed = np.asarray(routed_MNk).reshape(len(cfg.moe_layers), 2, 4, -1)
    assert (routed[:, 0, 2:] == -1).all() and (routed[:, 1] == -1).all()
    assert (routed[:, 0, :2] >= 0).all()
    for mi, looked in experts.looked_up:
        np.testing.assert_array_equal(np.asarray(looked).reshape(2, 4, -1), routed[mi])
    alone_logits, _, alone, alone_routed = run([toks[0][:2]], [0], [2])
    np.testing.assert_array_equal(routed[:, 0, :2], np.asarray(alone_routed).reshape(len(cfg.moe_layers), 2, -1))
    np.testing.assert_array_equal(experts.counters.as_array(), alone.counters.as_array())
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(alone_logits[0]), rtol=1e-5, atol=1e-5)
