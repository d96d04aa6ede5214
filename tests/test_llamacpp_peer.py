"""The pure logic of benchmarks/llamacpp.py (the llama.cpp peer of `strata-jax bench`): GGUF header
sizes, budget -> --n-cpu-moe, placement flags, llama-bench JSON parsing. Nothing is built or run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from gguf import GGUFReader

from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"

_spec = importlib.util.spec_from_file_location("llamacpp_peer", ROOT / "benchmarks" / "llamacpp.py")
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)

GiB = 1024**3


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory) -> Path:
    # Q4_K experts with Q6_K down projections on odd layers: per-layer expert bytes differ
    spec = SyntheticSpec(arch="qwen3moe", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64,
                         n_experts=8, n_experts_used=2, expert_ffn_dim=256, vocab_size=1024, qtype="Q8_0",
                         expert_qtype="Q4_K", odd_down_qtype="Q6_K")
    return write_synthetic_gguf(tmp_path_factory.mktemp("peer") / "moe.gguf", spec)


def test_header_matches_gguf_reader(moe_gguf):
    h = lc.read_gguf_header(moe_gguf)
    ref = {t.name: (int(t.n_bytes), [int(x) for x in t.shape]) for t in GGUFReader(moe_gguf).tensors}
    assert {t["name"] for t in h["tensors"]} == set(ref)
    for t in h["tensors"]:
        nbytes, shape = ref[t["name"]]
        assert 0 <= t["nbytes"] - nbytes < 32, t["name"]  # offset differences include alignment padding
        assert t["shape"] == shape
    meta = h["metadata"]
    assert meta["general.architecture"] == "qwen3moe"
    assert meta["qwen3moe.block_count"] == 4
    assert meta["tokenizer.ggml.tokens"] == {"array_len": 1024}


def test_footprint(moe_gguf):
    fp = lc.model_footprint(lc.read_gguf_header(moe_gguf))
    ref = {t.name: int(t.n_bytes) for t in GGUFReader(moe_gguf).tensors}
    for i, b in enumerate(fp["expert_bytes"]):
        want = sum(ref[f"blk.{i}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
        assert 0 <= b - want < 3 * 32
    assert fp["expert_bytes"][1] > fp["expert_bytes"][0]  # Q6_K down projections on odd layers
    non_expert = sum(v for k, v in ref.items() if "_exps" not in k)
    assert abs(fp["dense_gpu_bytes"] - (non_expert - ref["token_embd.weight"])) < 32 * len(ref)
    assert (fp["n_layers"], fp["n_kv_heads"], fp["key_length"], fp["n_vocab"], fp["n_experts"]) == (4, 2, 64, 1024, 8)


def test_budget_to_n_cpu_moe(moe_gguf):
    fp = lc.model_footprint(lc.read_gguf_header(moe_gguf))
    eb, n_ctx = fp["expert_bytes"], 128
    margin = lc.margin_bytes(fp, n_ctx, overhead_gib=0.0)["total"]
    assert margin == 2 * 4 * 256 * 2 * (64 + 64) + 4 * 512 * (1024 + 8 * 256)  # KV (n_ctx padded to 256) + compute
    fixed = fp["dense_gpu_bytes"] + margin
    for n in range(len(eb) + 1):  # a budget exactly at the footprint of n_cpu_moe = n gives n
        plan = lc.plan_budget(fp, fixed + sum(eb[n:]), n_ctx, overhead_gib=0.0)
        assert (plan["n_cpu_moe"], plan["gpu_expert_layers"], plan["fits"]) == (n, len(eb) - n, True)
        assert plan["gpu_bytes_estimate"] == fixed + sum(eb[n:])
        if n < len(eb):  # one byte less moves one more layer's experts to the host
            assert lc.plan_budget(fp, fixed + sum(eb[n:]) - 1, n_ctx, overhead_gib=0.0)["n_cpu_moe"] == n + 1
    big = lc.plan_budget(fp, 32 * GiB, n_ctx)
    assert (big["n_cpu_moe"], big["gpu_expert_fraction"], big["fits"]) == (0, 1.0, True)
    tiny = lc.plan_budget(fp, 1, n_ctx)
    assert (tiny["n_cpu_moe"], tiny["gpu_expert_layers"], tiny["fits"]) == (4, 0, False)
    # the default 1 GiB overhead is part of the margin
    assert lc.plan_budget(fp, fixed + sum(eb), n_ctx)["n_cpu_moe"] == 4


def test_placement_flags(moe_gguf):
    fp = lc.model_footprint(lc.read_gguf_header(moe_gguf))
    plan = {"n_cpu_moe": 3}
    assert lc.placement_flags("all-gpu", fp, plan) == (["-ngl", "99"], 0)
    assert lc.placement_flags("cpu-experts", fp, plan) == (["-ngl", "99", "-ncmoe", "4"], 4)
    assert lc.placement_flags("budget", fp, plan) == (["-ngl", "99", "-ncmoe", "3"], 3)
    with pytest.raises(ValueError):
        lc.placement_flags("half", fp, plan)
    assert lc.load_mode_flags("auto", 0) == []  # all on the GPU: llama-bench's default (mmap)
    assert lc.load_mode_flags("auto", 3) == ["-lm", "none"]  # experts on the host: loaded into RAM
    assert lc.load_mode_flags("mmap", 3) == ["-lm", "mmap"]


def test_depth_and_kv_type_flags():
    """llama-bench's -d (KV already filled, as strata-jax decodes after its prompt) and -ctk/-ctv."""
    assert lc.depth_flags(0, "f16") == []
    assert lc.depth_flags(16000, "q8_0") == ["-d", "16000", "-ctk", "q8_0", "-ctv", "q8_0"]
    assert lc.depth_flags(4096, "q8_0,q4_0") == ["-d", "4096", "-ctk", "q8_0", "-ctv", "q4_0"]


def test_experts_regex_is_llama_cpp_s():
    # LLM_FFN_EXPS_REGEX of common/common.h: \.ffn_(up|down|gate|gate_up)_(ch|)exps
    for name in ("blk.0.ffn_up_exps.weight", "blk.12.ffn_gate_up_exps.weight", "blk.3.ffn_down_chexps.weight"):
        assert lc.EXPS_RE.match(name)
    for name in ("blk.0.ffn_up_shexp.weight", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_up.weight", "token_embd.weight"):
        assert not lc.EXPS_RE.match(name)


def test_parse_llama_bench_json():
    """A real `llama-bench -o json` output (CPU build of 0c1e57098, the 'small' synthetic shape)."""
    text = (DATA / "llama_bench_cpu_small.json").read_text()
    parsed = lc.parse_bench_json(text)
    rows = json.loads(text)
    pre, dec = parsed["prefill"], parsed["decode"]
    assert pre["n_prompt"] > 0 and pre["n_gen"] == 0 and pre["avg_ts"] > 0
    assert dec["n_gen"] > 0 and dec["n_prompt"] == 0 and dec["avg_ts"] > 0
    assert parsed["build"]["build_commit"] == rows[0]["build_commit"] == "0c1e57098"
    assert parsed["build"]["backends"] == "CPU"
    fp = {"expert_bytes": [10] * 8}
    args = SimpleNamespace(n_prompt=pre["n_prompt"], n_gen=dec["n_gen"], reps=len(dec["samples_ts"]), model="m.gguf")
    cmd = ["llama-bench", "-m", "m.gguf", "-ngl", "99", "-ncmoe", "2", "-o", "json"]
    row = lc.make_row("budget", parsed, fp, 2, cmd, args)
    assert row["engine"] == "llama.cpp" and row["placement"] == "budget"
    assert (row["gpu_expert_layers"], row["n_cpu_moe"], row["gpu_expert_fraction"]) == (6, 2, 0.75)
    assert row["decode_tok_s"] == dec["avg_ts"] and row["decode_tok_s_std"] == dec["stddev_ts"]
    assert row["prefill_tok_s"] == pre["avg_ts"] and row["n_prompt"] == pre["n_prompt"]
    assert row["command"] == "llama-bench -m m.gguf -ngl 99 -ncmoe 2 -o json"


def test_pack_selection_and_changelog():
    for rel in ("CMakeLists.txt", "ggml/src/ggml.c", "ggml/src/ggml-cuda/mmq.cu", "ggml/src/ggml-cpu/ops.cpp",
                "tools/llama-bench/llama-bench.cpp", "vendor/nlohmann/json.hpp", "src/models/qwen3moe.cpp"):
        assert lc._wanted(rel), rel
    for rel in ("ggml/src/ggml-vulkan/ggml-vulkan.cpp", "tools/server/server.cpp", "tools/CMakeLists.txt",
                "models/ggml-vocab-qwen2.gguf", "docs/build.md", "tests/test-backend-ops.cpp"):
        assert not lc._wanted(rel), rel
    log = "# Changelog\n\n## [Unreleased]\n\n## [0.3.36]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098\n\n" \
          "## [0.3.35]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f\n"
    assert lc._changelog_commit(log, "0.3.36") == "0c1e57098"
    assert lc._changelog_commit(log, "0.3.35") == "4df29be4f"
    assert lc._changelog_commit(log, "0.1.0") is None
