"""MTP drafting (EngineConfig.spec "mtp", model/mtp.py) on the tiny converted qwen35 / qwen35moe / qwen3next
models with one random MTP block (tests/reference_models.py, "-mtp") and the tiny glm4moe (its MTP block as
GLM-4.5's checkpoints carry it): the block's logits at every position
against a reference built from transformers (its own decoder layer, loaded with the checkpoint's
mtp.layers.0.* weights, behind llama.cpp's graph_mtp input: fc over the normed embedding of the token and
the normed trunk state before it); greedy output with MTP drafts equal to plain decode, resident and
offloaded; and a file without an MTP block refused by name."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from reference_models import _load_hf, glm4moe_model, hybrid_model

pytestmark = pytest.mark.slow  # converter-made models

CTX = 128
REL_TOL = 1e-3  # f32: max |ours - reference| over max |reference|, at every position


def _ids(tm, n=37, seed=0):
    return np.random.default_rng(seed).integers(0, tm.vocab_size - 3, n).tolist()


def _engine(tm, **kw):
    import strata_jax

    return strata_jax.load(str(tm.gguf_path), ctx=CTX, dtype="float32", prefill_chunk=16, **kw)


def reference_mtp_logits(tm, ids: list[int]) -> np.ndarray:
    """float32 [T, V]: at position p, head(norm(layer(fc([enorm(embed(x_p)) | hnorm(h_{p-1})])))) with h the
    trunk's final (normed) hidden state, h_{-1} = 0, the layer causal over positions 0..T-1: a one-layer
    transformers model of the same class whose layer and final norm are the checkpoint's MTP block."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    model = _load_hf(str(tm.hf_dir))
    sd = {k: torch.from_numpy(v) for k, v in load_file(str(next(tm.hf_dir.glob("*.safetensors")))).items()}
    D, eps = model.config.hidden_size, model.config.rms_norm_eps
    n = model.config.num_hidden_layers
    if f"model.layers.{n}.eh_proj.weight" in sd:  # GLM-4.5's names (model.layers.N.*) as Qwen3-Next's (mtp.*)
        pre, names = f"model.layers.{n}.", {"eh_proj": "mtp.fc", "enorm": "mtp.pre_fc_norm_embedding",
                                             "hnorm": "mtp.pre_fc_norm_hidden", "shared_head.norm": "mtp.norm"}
        sd.update({names.get(k[len(pre):].removesuffix(".weight"), "mtp.layers.0." + k[len(pre):].removesuffix(
            ".weight")) + ".weight" if k.endswith(".weight") else "mtp.layers.0." + k[len(pre):]: v
                   for k, v in list(sd.items()) if k.startswith(pre)})
    norm_cls = type(model.model.norm)

    def norm(name):
        n = norm_cls(D, eps)
        n.weight.data.copy_(sd[name])
        return n

    t = torch.tensor([ids])
    with torch.no_grad():
        h = model.model(input_ids=t).last_hidden_state[0]  # after the output norm
        e = model.model.embed_tokens(t)[0]
        before = torch.cat([torch.zeros(1, D), h[:-1]])
        x = torch.cat([norm("mtp.pre_fc_norm_embedding.weight")(e), norm("mtp.pre_fc_norm_hidden.weight")(before)], -1)
        x = x @ sd["mtp.fc.weight"].T
        cfg1 = copy.deepcopy(model.config)
        cfg1.num_hidden_layers, cfg1.layer_types = 1, ["full_attention"]
        if hasattr(cfg1, "first_k_dense_replace"):  # GLM: the MTP block is a MoE layer
            cfg1.first_k_dense_replace = 0
        moe = hasattr(cfg1, "num_experts") or hasattr(cfg1, "n_routed_experts")
        one = AutoModelForCausalLM.from_config(cfg1, dtype=torch.float32, attn_implementation="eager",
                                               **({"experts_implementation": "eager"} if moe else {})).eval()
        want = _fused_experts({f"model.layers.0.{k[len('mtp.layers.0.'):]}": v for k, v in sd.items()
                               if k.startswith("mtp.layers.0.")}, "model.layers.0.")
        # the same fusion of a trunk MoE layer's checkpoint tensors gives what transformers loaded for it
        like = next((i for i, lay in enumerate(model.model.layers) if hasattr(getattr(lay, "mlp", None), "experts")), None)
        if like is not None:
            fused = _fused_experts({k: v for k, v in sd.items() if k.startswith(f"model.layers.{like}.")},
                                   f"model.layers.{like}.")
            for k in ("gate_up_proj", "down_proj"):
                torch.testing.assert_close(fused[f"model.layers.{like}.mlp.experts.{k}"],
                                           getattr(model.model.layers[like].mlp.experts, k).data)
        want["model.norm.weight"] = sd["mtp.norm.weight"]
        want["model.embed_tokens.weight"] = model.model.embed_tokens.weight
        want["lm_head.weight"] = model.lm_head.weight
        missing, unexpected = one.load_state_dict(want, strict=False)
        assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
        return one(inputs_embeds=x[None]).logits[0].numpy()


def _fused_experts(sd: dict, prefix: str) -> dict:
    """Per-expert checkpoint tensors (mlp.experts.{e}.{gate,up,down}_proj.weight) as transformers' fused
    parameters (mlp.experts.gate_up_proj [E, 2F, D]: gate rows then up rows; down_proj [E, D, F])."""
    import torch

    pre = prefix + "mlp.experts."
    n = len({k[len(pre):].split(".")[0] for k in sd if k.startswith(pre) and k[len(pre)].isdigit()})
    if not n:
        return sd
    out = {k: v for k, v in sd.items() if not (k.startswith(pre) and k[len(pre)].isdigit())}
    out[pre + "gate_up_proj"] = torch.stack([torch.cat([sd[f"{pre}{e}.gate_proj.weight"], sd[f"{pre}{e}.up_proj.weight"]])
                                             for e in range(n)])
    out[pre + "down_proj"] = torch.stack([sd[f"{pre}{e}.down_proj.weight"] for e in range(n)])
    return out


def _model(arch):
    return glm4moe_model("f32") if arch == "glm4moe" else hybrid_model(arch)


@pytest.mark.parametrize("arch", ["qwen35-mtp", "qwen35moe-mtp", "qwen3next-mtp", "glm4moe"])
def test_mtp_logits_match_the_reference(arch):
    """Every position's MTP logits (a prompt prefilled in 16-token chunks: the block's cache and the
    trunk state carried across chunks) within REL_TOL of the reference."""
    tm = _model(arch)
    ids = _ids(tm)
    ours, ref = _engine(tm, spec="mtp").mtp_logits(ids), reference_mtp_logits(tm, ids)
    err = np.abs(ours - ref).max(axis=-1) / np.abs(ref).max(axis=-1)
    assert err.max() < REL_TOL, err
    # and it is a real guess of its own: not the trunk's next-token logits
    assert not np.allclose(ours, _engine(tm).logits(ids), atol=1e-2)


@pytest.mark.parametrize("arch,slots,kv", [("qwen35-mtp", None, "f16"), ("qwen3next-mtp", None, "f16"),
                                           ("qwen3next-mtp", 10, "f16"), ("glm4moe", 6, "f16"),
                                           ("qwen35-mtp", None, "q8_0")])
def test_greedy_mtp_spec_equals_plain_decode(arch, slots, kv):
    """MTP drafts verified in one pass: the greedy tokens are plain decode's (resident and offloaded, and with
    a quantized KV cache, which the block's cache then shares), the drafts are counted, and a second request
    on the same row continues as plain decode does."""
    tm = _model(arch)
    ids = _ids(tm, 29)
    kw = ({} if slots is None else {"expert_slots": slots}) | {"kv": kv}
    spec, plain = _engine(tm, spec="mtp", spec_max=3, **kw), _engine(tm, **kw)
    assert spec.cache_plan is None or spec.cache_plan.resident == (slots is None)
    a, b = spec.generate(ids, max_tokens=24, temperature=0), plain.generate(ids, max_tokens=24, temperature=0)
    assert a.token_ids == b.token_ids
    assert a.timings["draft_n"] > 0
    turn2 = ids + a.token_ids + [5, 6, 7]
    assert spec.generate(turn2, max_tokens=8, temperature=0).token_ids == \
        plain.generate(turn2, max_tokens=8, temperature=0).token_ids


def test_mtp_drafts_are_the_blocks_greedy_guesses():
    """A draft after a prompt starts from the prompt's next token (at the next position) and the trunk's
    state before it: its first token is the argmax of the block's logits there, as a prefill of the prompt
    and that token computes them."""
    tm = hybrid_model("qwen35-mtp")
    m = _engine(tm, spec="mtp", spec_max=2)
    ids = _ids(tm, 21)
    first = int(m.logits(ids)[-1].argmax())  # what the prompt's greedy request samples first
    want = int(m.mtp_logits(ids + [first])[-1].argmax())
    s = m.session()
    row, _ = s.admit(ids, max_tokens=4, temperature=0, cache_prompt=False)
    assert s._reqs[row].last == first
    assert s._mtp_draft(row, len(ids))[0] == want
    s.release(row)


def test_a_file_without_an_mtp_block_is_refused():
    from strata_jax.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"no MTP \(nextn\) block.*--spec lookup"):
        _engine(hybrid_model("qwen35"), spec="mtp")


def test_the_context_plan_counts_the_mtp_block():
    """--spec mtp adds a KV layer and the block's resident experts: under a budget that bounds the context,
    the plan with them holds fewer positions."""
    from strata_jax.engine.model import plan_model_context
    from strata_jax.gguf.reader import GGUFFile
    from strata_jax.model.config import ModelConfig
    from strata_jax.model.memory import activation_bytes, dense_weight_bytes, kv_cache_bytes, mtp_bytes

    gguf = GGUFFile(str(hybrid_model("qwen35moe-mtp").gguf_path))
    cfg = ModelConfig.from_gguf(gguf)
    assert mtp_bytes(gguf, cfg, 0) > 0  # its experts
    fixed = dense_weight_bytes(gguf) + activation_bytes(cfg, 16)
    budget = fixed + 2048 * kv_cache_bytes(cfg, 1, 1, 2, "f16")
    kw = dict(ctx=None, kv="f16", itemsize=2, rows=1, prefill_chunk=16, vram_budget=budget, vram_reserve=0)
    plain = plan_model_context(gguf, cfg, None, **kw)
    mtp = plan_model_context(gguf, cfg, None, **kw, mtp=True)
    assert mtp.ctx < plain.ctx <= 2048


def test_the_mtp_cache_travels_with_a_conversation():
    """A conversation spilled to the conversation cache (RAM, and disk after a restart) comes back with
    its MTP block's cache: the next turn drafts as it would have in the row (the same counts) and its
    greedy tokens stay plain decode's."""
    tm = hybrid_model("qwen35-mtp")
    ids, other = _ids(tm, 29), _ids(tm, 23, seed=1)

    def turns(m):
        a = m.generate(ids, max_tokens=12, temperature=0)
        turn2 = ids + a.token_ids + [5, 6, 7]
        in_row = m.generate(turn2, max_tokens=10, temperature=0)
        held = len(turn2) - 1  # what the same prompt reuses; the block's cache there, while in the row
        snap = [np.asarray(x)[:, 0, :held] for x in (m.session()._kv.mtp.kv.k_LBSKDh, m.session()._kv.mtp.kv.v_LBSKDh)]
        m.generate(other, max_tokens=4, temperature=0)  # takes the one row: the conversation spills
        back = m.generate(turn2, max_tokens=10, temperature=0)
        for want, x in zip(snap, (m.session()._kv.mtp.kv.k_LBSKDh, m.session()._kv.mtp.kv.v_LBSKDh)):
            np.testing.assert_array_equal(np.asarray(x)[:, 0, :held], want)
        return in_row, back

    plain = _engine(tm)
    want = plain.generate(ids + plain.generate(ids, max_tokens=12, temperature=0).token_ids + [5, 6, 7],
                          max_tokens=10, temperature=0).token_ids
    in_row, back = turns(_engine(tm, spec="mtp", spec_max=3, conversation_cache_mib=64))
    assert in_row.token_ids == back.token_ids == want
    assert back.timings["cache_n"] > 0
    assert (back.timings["draft_n"], back.timings["draft_n_accepted"]) == \
        (in_row.timings["draft_n"], in_row.timings["draft_n_accepted"])


def test_a_pass_drafts_the_next_as_a_draft_call_would():
    """With MTP the verify pass also drafts the next pass's tokens (one call less per pass): after each pass
    they equal what a separate draft call at that point gives, and they are used."""
    tm = hybrid_model("qwen3next-mtp")
    m = _engine(tm, spec="mtp", spec_max=3)
    s = m.session()
    row, _ = s.admit(_ids(tm, 25), max_tokens=20, temperature=0, cache_prompt=False)
    checked = 0
    while row in s.active_rows:
        s.step()
        q = s._reqs[row]
        if q is not None and q.next_drafts is not None and q.next_drafts[0] == len(q.fed):
            assert s._mtp_draft(row, len(q.fed)) == q.next_drafts[1]
            checked += 1
    assert checked >= 2
