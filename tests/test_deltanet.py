"""model/layers/deltanet.py against transformers' Qwen4ExpTextGatedDeltaNet (torch fp32, seeded random weights),
its weights put in the GGUF layout the way llama.cpp's converter does (`gguf_tensors`; the slow test
checks that mapping against the converter's own modify_tensors). Covers: one prefill, a sequence fed
in chunks, decode steps, bucket padding, rows of different lengths in one batch, a GGUF file (f32 and
q8_0) read back through WeightLoader, and one trace per shape under jit."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gq

from conftest import count_compiles
from strata_jax.core.qtensor import QTensor
from strata_jax.gguf.reader import GGUFFile, metadata_view
from strata_jax.model.layers import deltanet
from strata_jax.model.layers.deltanet import DeltaNetParams, DeltaNetState
from strata_jax.model.dims import DeltaNetDims
from strata_jax.model.kernels import Kernels
from strata_jax.model.weights import WeightLoader

KERNELS = Kernels(qmatvec="off", platform="cpu")
# Hv = 3 Hk: the grouped -> tiled reorder is not its own inverse; Dk != Dv so a transposed state can't fit
D, HK, HV, DK, DV, KC, EPS = 64, 2, 6, 16, 32, 4, 1e-6
R = HV // HK
DIMS = DeltaNetDims(d_model=D, n_k_heads=HK, n_v_heads=HV, k_head_dim=DK, v_head_dim=DV, conv_kernel=KC,
                    rms_eps=EPS)
TOL = 1e-4  # max |ours - reference| <= TOL * max |reference|


def close(got, want, tol=TOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    assert scale > 0 and err <= tol * scale, f"max error {err:.3g} vs scale {scale:.3g}"


# -- the reference ------------------------------------------------------------------------------------


def hf_config(gate: str = "sigmoid"):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        hidden_size=D, num_hidden_layers=1, layer_types=["linear_attention"], linear_num_key_heads=HK,
        linear_num_value_heads=HV, linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=KC,
        rms_norm_eps=EPS, output_gate_type=gate, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        hc_count=2, hc_lowrank=4, num_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


@functools.lru_cache(maxsize=None)
def hf_layer(gate: str = "sigmoid", seed: int = 0):
    """The transformers layer with weights at a realistic scale: projections O(1), per-head decay rates A
    from 0.02 (the state carries across the whole test sequence) to 4 (it forgets within a few tokens),
    norm gains around 1."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedDeltaNet

    m = Qwen4ExpTextGatedDeltaNet(hf_config(gate), 0).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            getattr(m, name).weight.normal_(0.0, D ** -0.5, generator=g)
        m.out_proj.weight.normal_(0.0, (HV * DV) ** -0.5, generator=g)
        m.conv1d.weight.normal_(0.0, 0.5, generator=g)
        m.A_log.copy_(torch.tensor([0.02, 0.1, 0.3, 1.0, 2.0, 4.0])[torch.randperm(HV, generator=g)].log())
        m.dt_bias.copy_(1.0 + 0.5 * torch.randn(HV, generator=g))
        m.norm.weight.copy_(1.0 + 0.1 * torch.randn(DV, generator=g))
    return m


def hf_cache():
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=hf_config())


def hf_run(m, x_BTD, cache=None) -> np.ndarray:
    with torch.no_grad():
        return m(torch.from_numpy(np.asarray(x_BTD, np.float32)), cache=cache).numpy()


def hf_state(cache) -> DeltaNetState:
    """HF's cached state in this module's layout: its conv state keeps the last Kc inputs [B, Cc, Kc] (only
    the last Kc-1 reach the next token) and both are in HF's grouped value-head order."""
    conv = cache.layers[0].conv_states[0].numpy()[:, :, 1:]  # [B, Cc, Kc-1]
    conv = np.concatenate([conv[:, :2 * HK * DK], reorder_v_heads(conv[:, 2 * HK * DK:], 1, DV)], axis=1)
    ssm = reorder_v_heads(cache.layers[0].recurrent_states[0].numpy(), 1, 1)
    return DeltaNetState(jnp.asarray(conv.transpose(0, 2, 1)), jnp.asarray(ssm))


# -- the converter's layout ---------------------------------------------------------------------------


def reorder_v_heads(a: np.ndarray, axis: int, head_dim: int, inverse: bool = False) -> np.ndarray:
    """Value heads from HF's grouped order [Hk, R] to the tiled [R, Hk] (or back): as llama.cpp's
    conversion/qwen.py _LinearAttentionVReorderBase._reorder_v_heads."""
    axis %= a.ndim
    groups = (R, HK) if inverse else (HK, R)
    b = a.reshape(a.shape[:axis] + (*groups, head_dim) + a.shape[axis + 1:])
    return np.swapaxes(b, axis, axis + 1).reshape(a.shape)


def gguf_tensors(m) -> dict[str, np.ndarray]:
    """The layer's GGUF tensors, as conversion/qwen.py writes them: _LinearAttentionVReorderBase.
    modify_tensors (the V-head reorder, Hv > Hk), then Qwen3NextModel.modify_tensors (A_log -> -exp(A_log),
    dt_bias renamed ssm_dt.bias, conv1d squeezed, linear_attn.norm without the +1), names by
    gguf-py's tensor_mapping for MODEL_ARCH.QWEN4EXP."""
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in m.state_dict().items()}
    qk = 2 * HK * DK
    qkv = sd["in_proj_qkv.weight"]
    conv = sd["conv1d.weight"][:, 0, :]
    return {
        "blk.0.attn_qkv.weight": np.concatenate([qkv[:qk], reorder_v_heads(qkv[qk:], 0, DV)]),
        "blk.0.attn_gate.weight": reorder_v_heads(sd["in_proj_z.weight"], 0, DV),
        "blk.0.ssm_beta.weight": reorder_v_heads(sd["in_proj_b.weight"], 0, 1),
        "blk.0.ssm_alpha.weight": reorder_v_heads(sd["in_proj_a.weight"], 0, 1),
        "blk.0.ssm_conv1d.weight": np.concatenate([conv[:qk], reorder_v_heads(conv[qk:], 0, DV)]),
        "blk.0.ssm_dt.bias": reorder_v_heads(sd["dt_bias"], 0, 1),
        # torch's exp, as the converter: numpy's differs in the last bit
        "blk.0.ssm_a": -torch.exp(torch.from_numpy(reorder_v_heads(sd["A_log"], 0, 1))).numpy(),
        "blk.0.ssm_norm.weight": sd["norm.weight"],
        "blk.0.ssm_out.weight": reorder_v_heads(sd["out_proj.weight"], 1, DV),
    }


def dense_getters(tensors: dict[str, np.ndarray]):
    def get(name, shape):
        assert tensors[name].shape == shape, (name, tensors[name].shape, shape)
        return jnp.asarray(tensors[name])

    return (lambda name, shape: QTensor(get(name, shape), None, shape[-1])), get


@functools.lru_cache(maxsize=None)
def params(gate: str = "sigmoid") -> DeltaNetParams:
    return deltanet.load_params(*dense_getters(gguf_tensors(hf_layer(gate))), 0, DIMS)


TRACES: list[tuple] = []  # (B, T) of every trace of `run`


def _counted_apply(p, x_BTD, state, **kw):
    TRACES.append(x_BTD.shape[:2])
    return deltanet.apply(p, x_BTD, state, **kw)


# The tests share a few shapes, (2, T) for T in 1, 32, 64, 96, so they share a few compiled programs.
run = jax.jit(_counted_apply, static_argnames=("dims", "kernels"))


def ours(x_BTD, state=None, n_valid=None, gate: str = "sigmoid", p=None):
    B, T, _ = x_BTD.shape
    state = DeltaNetState.zeros(B, DIMS) if state is None else state
    n_valid = np.full(B, T) if n_valid is None else np.asarray(n_valid)
    dims = dataclasses.replace(DIMS, output_gate=gate)
    y, st = run(params(gate) if p is None else p, jnp.asarray(x_BTD), state,
                n_valid_B=jnp.asarray(n_valid, jnp.int32), dims=dims, kernels=KERNELS)
    return np.asarray(y), st


def tokens(B, T, seed=1):
    return np.random.default_rng(seed).standard_normal((B, T, D)).astype(np.float32)


def states_close(a: DeltaNetState, b: DeltaNetState, tol=TOL):
    close(a.conv_BKcCc, b.conv_BKcCc, tol)
    close(a.ssm_BHvDkDv, b.ssm_BHvDkDv, tol)


def row(state: DeltaNetState, b: int) -> DeltaNetState:
    return jax.tree.map(lambda a: a[b:b + 1], state)


def hf_row(x_prefill_TD, x_TD):
    """transformers on one row: a prefill, then x_TD continuing from its cache: (outputs, state)."""
    m, cache = hf_layer(), hf_cache()
    hf_run(m, x_prefill_TD[None], cache)
    return hf_run(m, x_TD[None], cache), hf_state(cache)


# -- tests --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_layout_mapping_is_the_converters(llama_cpp_converter, tmp_path):
    """gguf_tensors == what the pinned converter's modify_tensors chain makes of the same HF tensors."""
    m = hf_layer()
    np.savez(tmp_path / "hf.npz", **{k: v.detach().numpy() for k, v in m.state_dict().items()})
    script = r"""
import sys
import numpy as np, torch
root, src, dst, hk, hv, dk, dv = sys.argv[1:]
sys.path[:0] = [root, root + "/gguf-py"]  # the converter's own gguf-py, matched to it
import gguf
from conversion.qwen4exp import Qwen4ExpTextModel
# modify_tensors alone, on an instance without __init__ (which reads a checkpoint): the attributes its
# chain (qwen4exp -> _LinearAttentionVReorderBase -> Qwen3NextModel -> Qwen2MoeModel -> ModelBase) reads
c = Qwen4ExpTextModel.__new__(Qwen4ExpTextModel)
c.hparams = dict(linear_num_key_heads=int(hk), linear_num_value_heads=int(hv), linear_key_head_dim=int(dk),
                 linear_value_head_dim=int(dv), num_hidden_layers=1)
c.tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN4EXP, 1)
c.model_arch = gguf.MODEL_ARCH.QWEN4EXP
c.fuse_qkv = c.fuse_gate_up_exps = False
out = {}
for name, a in np.load(src).items():
    for new, t in c.modify_tensors(torch.from_numpy(a), "model.layers.0.linear_attn." + name, 0):
        out[new] = t.numpy()
np.savez(dst, **out)
"""
    proc = subprocess.run([sys.executable, "-c", script, str(llama_cpp_converter.parent), str(tmp_path / "hf.npz"),
                           str(tmp_path / "gguf.npz"), str(HK), str(HV), str(DK), str(DV)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = dict(np.load(tmp_path / "gguf.npz"))
    got = gguf_tensors(m)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("gate", ["sigmoid", "silu"])
def test_prefill_matches_transformers(gate):
    """96 tokens (a whole chunk and a padded one) for 2 rows from zero state: outputs and final state."""
    x = tokens(2, 96)
    cache = hf_cache()
    want = hf_run(hf_layer(gate), x, cache)
    y, st = ours(x, gate=gate)
    close(y, want)
    states_close(st, hf_state(cache))
    assert not np.allclose(y, ours(x, gate="silu" if gate == "sigmoid" else "sigmoid")[0], atol=1e-3)


def test_chunks_carry_state():
    """96 tokens fed as 32 + 64 (the state carried across a boundary inside the reference's first chunk)
    == one call == transformers."""
    x = tokens(2, 96, seed=2)
    cache = hf_cache()
    want = hf_run(hf_layer(), x, cache)
    whole, st_whole = ours(x)
    y1, st = ours(x[:, :32])
    y2, st = ours(x[:, 32:], st)
    close(np.concatenate([y1, y2], axis=1), want)
    close(np.concatenate([y1, y2], axis=1), whole, 1e-5)
    states_close(st, st_whole, 1e-5)
    states_close(st, hf_state(cache))


def test_decode_steps_match_parallel():
    """A 32-token prefill then 32 one-token (recurrent) steps == one 64-token call, and transformers'
    cached decode (its recurrent rule) step for step."""
    x = tokens(2, 64, seed=3)
    m, cache = hf_layer(), hf_cache()
    hf_steps = [hf_run(m, x[:, :32], cache)] + [hf_run(m, x[:, t:t + 1], cache) for t in range(32, 64)]
    y, st = ours(x[:, :32])
    steps = [y]
    for t in range(32, 64):
        y, st = ours(x[:, t:t + 1], st)
        steps.append(y)
    whole, st_whole = ours(x)
    close(np.concatenate(steps, axis=1), whole, 1e-5)
    close(np.concatenate(steps, axis=1), np.concatenate(hf_steps, axis=1))
    states_close(st, st_whole, 1e-5)
    states_close(st, hf_state(cache))


@pytest.mark.parametrize("n_valid", [(45, 2), (0, 64)])
def test_padded_bucket_is_a_no_op_past_n_valid(n_valid):
    """After a 32-token prefill, a 64-token bucket with n_valid[b] real tokens per row gives row b the
    outputs and state of the unpadded n_valid[b]-token continuation (transformers on that row alone);
    n_valid < Kc-1 keeps part of the old conv state; 0 leaves the row untouched. The padding is real
    tokens, not zeros, so only the masking can make it inert."""
    x = tokens(2, 32 + 64, seed=4)
    _, st0 = ours(x[:, :32])
    y, st = ours(x[:, 32:], st0, n_valid=n_valid)
    for b, n in enumerate(n_valid):
        if n:
            y_ref, st_ref = hf_row(x[b, :32], x[b, 32:32 + n])
            close(y[b:b + 1, :n], y_ref)
            states_close(row(st, b), st_ref)
        else:
            states_close(row(st, b), row(st0, b), 0.0)
    # a decode step that is padding (a row with no token this step) leaves that row exactly as it was
    _, st1 = ours(x[:, 32:33], st0, n_valid=[0, 1])
    states_close(row(st1, 0), row(st0, 0), 0.0)
    assert not np.allclose(st1.ssm_BHvDkDv[1], st0.ssm_BHvDkDv[1])


def test_batch_rows_with_different_n_valid():
    """Two rows with different histories and n_valid (64, 19) in one call == each row alone, unpadded
    (transformers); reset_rows gives a row a fresh start and leaves the other alone."""
    pre = tokens(2, 32, seed=5)
    x = tokens(2, 64, seed=6)
    _, st0 = ours(pre)
    y, st = ours(x, st0, n_valid=[64, 19])
    for b, n in enumerate((64, 19)):
        y_ref, st_ref = hf_row(pre[b], x[b, :n])
        close(y[b:b + 1, :n], y_ref)
        states_close(row(st, b), st_ref)

    y, _ = ours(x, deltanet.reset_rows(st0, jnp.array([False, True])))
    close(y[0], ours(x, st0)[0][0], 1e-6)
    close(y[1], ours(x)[0][1], 1e-6)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_file_through_weight_loader(tmp_path, qtype):
    """The layer written as a GGUF (KV keys and tensor types as the converter writes them), its dims read
    from the metadata and its tensors through WeightLoader, against transformers holding the file's
    (dequantized) weights."""
    tensors = gguf_tensors(hf_layer())
    q = GGMLQuantizationType[qtype]
    w = GGUFWriter(tmp_path / "layer.gguf", "qwen4exp")
    w.add_embedding_length(D)
    w.add_layer_norm_rms_eps(EPS)
    w.add_ssm_conv_kernel(KC)
    w.add_ssm_state_size(DK)
    w.add_ssm_group_count(HK)
    w.add_ssm_time_step_rank(HV)
    w.add_ssm_inner_size(HV * DV)
    stored = {}
    for name, a in tensors.items():
        # conversion/base.py prepare_tensors: 1-D tensors, ssm_conv1d and names not ending in .weight stay F32
        t = q if a.ndim == 2 and name.endswith(".weight") and "ssm_conv1d" not in name else GGMLQuantizationType.F32
        raw = gq.quantize(a, t) if t != GGMLQuantizationType.F32 else a
        w.add_tensor(name, raw, raw_dtype=t)
        stored[name] = gq.dequantize(raw, t).reshape(a.shape) if t != GGMLQuantizationType.F32 else a
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    f = GGUFFile(tmp_path / "layer.gguf")
    dims = DeltaNetDims.from_metadata(metadata_view(f.metadata, f.architecture))
    assert dims.rms_eps == pytest.approx(EPS) and dataclasses.replace(dims, rms_eps=EPS) == DIMS  # a float32 key
    loader = WeightLoader(f, types.SimpleNamespace(arch=f.architecture))  # the loader reads cfg only for errors
    p = deltanet.load_params(loader.qtensor, loader.f32, 0, DIMS)
    assert p.attn_qkv.qtype == q and p.ssm_beta.qtype == q and p.ssm_out.qtype == q

    # transformers with the stored weights: the GGUF layout mapped back (tiled -> grouped V heads)
    ref = hf_layer.__wrapped__("sigmoid", 0)  # a fresh one: the cached layer keeps its unquantized weights
    qk = 2 * HK * DK
    back = lambda a, axis, hd: reorder_v_heads(a, axis, hd, inverse=True)  # noqa: E731
    qkv, conv = stored["blk.0.attn_qkv.weight"], stored["blk.0.ssm_conv1d.weight"]
    with torch.no_grad():
        for target, a in (
            (ref.in_proj_qkv.weight, np.concatenate([qkv[:qk], back(qkv[qk:], 0, DV)])),
            (ref.in_proj_z.weight, back(stored["blk.0.attn_gate.weight"], 0, DV)),
            (ref.in_proj_b.weight, back(stored["blk.0.ssm_beta.weight"], 0, 1)),
            (ref.in_proj_a.weight, back(stored["blk.0.ssm_alpha.weight"], 0, 1)),
            (ref.conv1d.weight, np.concatenate([conv[:qk], back(conv[qk:], 0, DV)])[:, None, :]),
            (ref.out_proj.weight, back(stored["blk.0.ssm_out.weight"], 1, DV)),
        ):
            target.copy_(torch.from_numpy(np.ascontiguousarray(a)))
    x = tokens(2, 32, seed=8)
    y, _ = ours(x, p=p)
    close(y, hf_run(ref, x))
    if qtype == "Q8_0":  # the quantization is visible: the comparison above is not of unquantized weights
        assert np.abs(y - hf_run(hf_layer(), x)).max() > 10 * TOL * np.abs(y).max()


def test_jit_traces_once_per_shape():
    """One trace (and one compile) per (B, T): new values, states and n_valid reuse the program; T == 1
    is its own program."""
    p = params()

    def call(x, st, n):
        return run(p, jnp.asarray(x), st, n_valid_B=jnp.asarray(n, jnp.int32), dims=DIMS, kernels=KERNELS)

    st0 = DeltaNetState.zeros(2, DIMS)
    _, st = call(tokens(2, 8, seed=9), st0, [8, 8])
    _, st = call(tokens(2, 1, seed=10), st, [1, 1])
    seen = len(TRACES)
    with count_compiles() as compiles:
        _, st = call(tokens(2, 8, seed=11), st, [3, 8])
        for seed in range(3):
            _, st = call(tokens(2, 1, seed=12 + seed), st, [1, seed % 2])
    assert len(TRACES) == seen and not compiles
    assert TRACES.count((2, 8)) == 1 and TRACES.count((2, 1)) == 1


@pytest.mark.parametrize("T", [1, 6])
def test_rewind_to_every_prefix_equals_running_only_it(T):
    """A speculative pass's tape stops the state after any prefix of its tokens (deltanet.rewind, the
    closed form: no weights, no re-run): equal to running only that prefix, per row, T = 1 (the
    recurrent step) and T > 1 (the chunked form)."""
    x = tokens(2, 37 + T, seed=5)
    _, before = ours(x[:, :37])
    p = params()
    _, after, tape = deltanet.apply(p, jnp.asarray(x[:, 37:]), before, n_valid_B=jnp.full(2, T, jnp.int32), dims=DIMS,
                                    kernels=KERNELS, tape=True)
    states_close(deltanet.rewind(before, tape, jnp.full(2, T)), after)
    for n in range(T + 1):
        n_B = np.array([n, T - n])  # two rows stopped at different tokens
        want = deltanet.apply(p, jnp.asarray(x[:, 37:]), before, n_valid_B=jnp.asarray(n_B, jnp.int32), dims=DIMS,
                              kernels=KERNELS)[1]
        states_close(deltanet.rewind(before, tape, jnp.asarray(n_B)), want)
