"""EngineConfig: every option validated once, before the model file is opened; errors name the option
(or the CLI flag) and the fix; the environment gives defaults in one place; platform and model steps.

A path that does not exist proves the order: a bad option must be reported, not the missing file."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

import strata_jax
from strata_jax.cli import main
from strata_jax.engine.config import FLAGS, OPTIONS, EngineConfig, xla_options_from_env
from strata_jax.core.errors import ConfigError, GGUFFormatError
from strata_jax.model.kernels import Kernels
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf

MISSING = "/nonexistent/model.gguf"
ENV = ("STRATA_JAX_QMATVEC", "STRATA_JAX_MOE_PREFILL", "STRATA_JAX_COMPILATION_CACHE", "STRATA_JAX_STATE_ROWS",
       "STRATA_JAX_PREFILL_CACHED")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("options, match", [
    (dict(ctx=0), r"ctx=0 is invalid: it must be a positive context length"),
    (dict(conversation_cache_mib=-1), r"conversation_cache_mib=-1 is invalid: it must be an integer >= 0"),
    (dict(conversation_cache_disk_mib=0), r"conversation_cache_disk_mib=0 is invalid: it must be a positive"),
    (dict(conversation_cache_dir=""), r"conversation_cache_dir='' is invalid: it must be a folder path"),
    (dict(ctx="64"), r"ctx='64' is invalid"),
    (dict(dtype="int8"), r"dtype='int8' is invalid: it must be one of auto, float32, bfloat16, float16"),
    (dict(kv="q5_0"), r"kv='q5_0' is invalid: it must be one of f16, q8_0, q4_0 .* or K,V .* such as q8_0,q4_0"),
    (dict(kv="q8_0,q4_0,f16"), r"kv='q8_0,q4_0,f16' is invalid"),
    (dict(kv=8), r"kv=8 is invalid"),
    (dict(prefill_chunk=100), r"prefill_chunk=100 is invalid: it must be a power of two >= 16"),
    (dict(prefill_chunk=8), r"prefill_chunk=8 is invalid: it must be a power of two >= 16"),
    (dict(decode_chunk=0), r"decode_chunk=0 is invalid: it must be a positive integer"),
    (dict(decode_chunk=True), r"decode_chunk=True is invalid"),
    (dict(dequantize_dense="yes"), r"dequantize_dense='yes' is invalid: it must be True or False"),
    (dict(expert_slots=0), r"expert_slots=0 is invalid: it must be a positive integer"),
    (dict(vram_budget="banana"), r"vram_budget='banana' is not a size: write e.g. 32GiB"),
    (dict(vram_reserve=-1), r"vram_reserve=-1 is not a size"),
    (dict(policy="nope"), r"policy: unknown cache policy 'nope'; choose one of lfu, lrfu, lru"),
    (dict(policy=3), r"policy=3 is invalid: it must be a policy name"),
    (dict(policy="static:/nonexistent/profile.npy"), r"policy: cannot read the static policy's profile"),
    (dict(prefetch=-1), r"prefetch=-1 is invalid: it must be a depth >= 0"),
    (dict(expert_pools="per-expert"), r"expert_pools='per-expert' is invalid: it must be 'per-layer' or 'shared'"),
    (dict(parallel=0), r"parallel=0 is invalid: it must be an integer >= 1"),
    (dict(record_routing=1), r"record_routing=1 is invalid: it must be True or False"),
    (dict(kernels="on"), r"kernels='on' is invalid: it must be a strata_jax.model.kernels.Kernels"),
    (dict(compilation_cache="no"), r"compilation_cache='no' is invalid"),
    (dict(ple_table="gpu"), r"ple_table='gpu' is invalid: it must be 'auto' or 'device' or 'host'"),
    (dict(layer_scan="yes"), r"layer_scan='yes' is invalid: it must be 'on' or 'off'"),
    (dict(expert_fetch="fast"), r"expert_fetch='fast' is invalid: it must be 'auto' or 'kernel' or 'loop'"),
    (dict(spec="draft:/no/draft.gguf"), r"the draft model '/no/draft.gguf' is not a file"),
    (dict(prefill_chunk="automatic"), r"prefill_chunk='automatic' is invalid: .* or 'auto'"),
])
def test_bad_option_is_refused_before_the_file_is_read(options, match):
    with pytest.raises(ConfigError, match=match):
        strata_jax.load(MISSING, **options)


def test_good_options_reach_the_file():
    with pytest.raises(GGUFFormatError, match="no such file"):
        strata_jax.load(MISSING, ctx=64, vram_budget="32GiB", policy="lrfu(0.5)", prefetch=True, parallel=2)
    with pytest.raises(GGUFFormatError, match="no such file"):
        strata_jax.load(MISSING, EngineConfig.create(expert_slots=8))


def test_unknown_option_lists_the_valid_names():
    with pytest.raises(ConfigError, match=r"unknown option 'vram'; the engine options are: ctx, dtype, .*vram_budget"):
        strata_jax.load(MISSING, vram="32GiB")
    with pytest.raises(ConfigError, match="not an EngineConfig"):
        strata_jax.load(MISSING, {"ctx": 64})


def test_a_config_and_options_combine():
    base = EngineConfig.create(ctx=64, policy="lfu")
    with pytest.raises(ConfigError, match="decode_chunk=0"):
        strata_jax.load(MISSING, base, decode_chunk=0)
    c = base.replace(decode_chunk=4)
    assert (c.ctx, c.policy, c.decode_chunk) == (64, "lfu", 4) and base.decode_chunk is None


def test_values_are_normalized_and_frozen():
    import jax.numpy as jnp

    c = EngineConfig.create(vram_budget="2GiB", vram_reserve="512MiB", prefetch=True, dtype=jnp.bfloat16)
    assert (c.vram_budget, c.vram_reserve, c.prefetch, c.dtype) == (2 << 30, 512 << 20, 1, "bfloat16")
    assert EngineConfig.create(prefetch=False).prefetch == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.ctx = 5
    with pytest.raises(ConfigError, match="ctx=0"):  # built directly, it is checked too
        EngineConfig(ctx=0)
    assert EngineConfig() == EngineConfig.create()


def test_policy_objects_and_static_profiles(tmp_path):
    from strata_jax.offload.policies import lrfu_policy

    pol = lrfu_policy(0.25)
    assert EngineConfig.create(policy=pol).policy is pol
    np.save(tmp_path / "profile.npy", np.ones((2, 8), np.float32))
    assert EngineConfig.create(policy=f"static:{tmp_path / 'profile.npy'}").policy.endswith("profile.npy")
    np.save(tmp_path / "flat.npy", np.ones(8, np.float32))
    with pytest.raises(ConfigError, match=r"policy: .*flat.npy' holds \(8,\), not a profile or a trace"):
        EngineConfig.create(policy=f"static:{tmp_path / 'flat.npy'}")


def test_the_environment_gives_defaults(monkeypatch):
    assert EngineConfig.create().kernels == Kernels("auto", "dense")
    assert EngineConfig.create().compilation_cache is True
    monkeypatch.setenv("STRATA_JAX_QMATVEC", "1")
    monkeypatch.setenv("STRATA_JAX_MOE_PREFILL", "grouped")
    monkeypatch.setenv("STRATA_JAX_COMPILATION_CACHE", "0")
    c = EngineConfig.create()
    assert c.kernels == Kernels("on", "grouped") and c.compilation_cache is False
    monkeypatch.setenv("STRATA_JAX_QMATVEC", "0")
    assert EngineConfig.create().kernels.qmatvec == "off"
    assert EngineConfig.create().kernels.prefill_cached == "off"
    monkeypatch.setenv("STRATA_JAX_PREFILL_CACHED", "1")
    assert EngineConfig.create().kernels.prefill_cached == "on"
    # an explicit option wins over the environment
    c = EngineConfig.create(kernels=Kernels("auto", "dense"), compilation_cache=True)
    assert c.kernels == Kernels("auto", "dense") and c.compilation_cache is True


def test_decode_xla_options_come_typed_from_the_environment(monkeypatch):
    monkeypatch.setenv("STRATA_JAX_XLA_DECODE", "--xla_gpu_command_buffer_unroll_loops=true xla_dump_hlo_pass_re=fusion "
                       "--xla_gpu_autotune_level=0")
    assert xla_options_from_env() == (("xla_dump_hlo_pass_re", "fusion"), ("xla_gpu_autotune_level", 0),
                                     ("xla_gpu_command_buffer_unroll_loops", True))
    monkeypatch.setenv("STRATA_JAX_XLA_DECODE", "--xla_gpu_command_buffer_unroll_loops")
    with pytest.raises(ConfigError, match="write each option as --xla_name=value"):
        xla_options_from_env()
    # the prefill program's own, apart from the decode's
    monkeypatch.setenv("STRATA_JAX_XLA_PREFILL", "--xla_gpu_enable_command_buffer=FUSION,CUBLAS")
    assert xla_options_from_env("prefill") == (("xla_gpu_enable_command_buffer", "FUSION,CUBLAS"),)
    monkeypatch.setenv("STRATA_JAX_XLA_PREFILL", "xla_gpu_enable_command_buffer")
    with pytest.raises(ConfigError, match="STRATA_JAX_XLA_PREFILL has"):
        xla_options_from_env("prefill")


@pytest.mark.parametrize("var, value", [("STRATA_JAX_QMATVEC", "yes"), ("STRATA_JAX_MOE_PREFILL", "sparse"),
                                        ("STRATA_JAX_COMPILATION_CACHE", "off"), ("STRATA_JAX_STATE_ROWS", "on"),
                                        ("STRATA_JAX_PREFILL_CACHED", "yes")])
def test_a_bad_environment_value_names_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=f"{var}='{value}' is invalid: set "):
        strata_jax.load(MISSING)


def test_resolved_fills_the_platform_defaults():
    c = EngineConfig.create()
    cpu, gpu = c.resolved("cpu"), c.resolved("gpu")
    assert (cpu.dtype, cpu.decode_chunk, cpu.dequantize_dense, cpu.kernels.platform) == ("float32", 1, True, "cpu")
    assert (gpu.dtype, gpu.decode_chunk, gpu.dequantize_dense, gpu.kernels.platform) == ("bfloat16", 16, False, "gpu")
    mine = EngineConfig.create(dtype="float16", decode_chunk=4, dequantize_dense=False).resolved("cpu")
    assert (mine.dtype, mine.decode_chunk, mine.dequantize_dense) == ("float16", 4, False)


def test_check_model_leaves_ctx_to_the_planner_and_warns(caplog):
    moe = types.SimpleNamespace(context_length=32768, is_moe=True, arch="qwen3moe")
    dense = types.SimpleNamespace(context_length=2048, is_moe=False, arch="qwen2")
    assert EngineConfig.create().check_model(moe).ctx is None  # load's plan_context fills it
    with caplog.at_level("WARNING", logger="strata_jax"):
        assert EngineConfig.create(ctx=8192).check_model(dense).ctx == 8192
        EngineConfig.create(vram_budget="8GiB", policy="lfu").check_model(dense)  # the budget sizes its ctx
        EngineConfig.create(vram_budget="8GiB").check_model(moe)
    msgs = [r.getMessage() for r in caplog.records]
    assert "ctx 8192 exceeds the model's trained context 2048; quality may degrade past it" in msgs
    assert "policy ignored: qwen2 is a dense model, it has no expert cache" in msgs
    assert len(msgs) == 2  # the MoE model uses its expert options: no warning


def test_a_dense_model_logs_the_expert_options_it_ignores(tmp_path, caplog):
    spec = SyntheticSpec(arch="qwen2", n_layers=1, d_model=64, head_dim=16, ffn_dim=64, vocab_size=512, qtype="Q8_0")
    path = write_synthetic_gguf(tmp_path / "dense.gguf", spec)
    with caplog.at_level("WARNING", logger="strata_jax"):
        m = strata_jax.load(path, ctx=32, expert_slots=4)
    assert m.experts is None and "expert_slots ignored: qwen2 is a dense model" in caplog.text


def test_a_loaded_model_keeps_its_resolved_config(tmp_path):
    spec = SyntheticSpec(arch="qwen2", n_layers=1, d_model=64, head_dim=16, ffn_dim=64, vocab_size=512, qtype="Q8_0")
    m = strata_jax.load(write_synthetic_gguf(tmp_path / "dense.gguf", spec), ctx=32, prefill_chunk=64)
    c = m.engine_config
    assert (c.ctx, c.prefill_chunk, c.dtype, c.decode_chunk, c.kernels.platform) == (32, 64, "float32", 1, "cpu")
    assert (m.ctx, m.prefill_chunk, m.decode_chunk, m.kernels) == (32, 64, 1, c.kernels)


# -- the command line --------------------------------------------------------------------------------------

def _cli(capsys, *argv) -> tuple[int, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's own errors (a choice, a non-number for a float flag)
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--vram-budget", "banana"], "--vram-budget 'banana' is not a size: write e.g. 32GiB"),
    (["--vram-reserve", "lots"], "--vram-reserve 'lots' is not a size"),
    (["--temperature", "-1"], "--temperature -1.0 is invalid: it must be a number >= 0 (0 = greedy)"),
    (["--top-p", "0"], "--top-p 0.0 is invalid: it must be a number in (0, 1]"),
    (["--top-k", "-1"], "--top-k -1 is invalid: it must be an integer >= 0"),
    (["--min-p", "2"], "--min-p 2.0 is invalid: it must be a number in [0, 1]"),
    (["--max-tokens", "0"], "--max-tokens 0 is invalid: it must be an integer >= 1"),
    (["--stop", ""], "--stop '' is invalid: each stop string must be non-empty"),
    (["--policy", "nope"], "--policy: unknown cache policy 'nope'; choose one of"),
    (["--policy", "static:/nonexistent/p.npy"], "--policy: cannot read the static policy's profile"),
    (["--decode-chunk", "0"], "--decode-chunk 0 is invalid: it must be a positive integer"),
    (["--decode-chunk", "two"], "--decode-chunk 'two' is invalid: it must be a positive integer"),
    (["--prefill-chunk", "100"], "--prefill-chunk 100 is invalid: it must be a power of two >= 16"),
    (["--ctx", "0"], "--ctx 0 is invalid: it must be a positive context length"),
    (["--kv", "int8"], "--kv 'int8' is invalid: it must be one of f16, q8_0, q4_0"),
    (["--expert-slots", "-4"], "--expert-slots -4 is invalid: it must be a positive integer"),
    (["--prefetch-depth", "-1"], "--prefetch-depth -1 is invalid: it must be a depth >= 0"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--rope-scale", "0.5"], "--rope-scale '0.5' is invalid: it must be a factor >= 1"),
    (["--rope-scale", "four"], "--rope-scale 'four' is invalid: it must be a factor >= 1"),
    (["--yarn-orig-ctx", "0"], "--yarn-orig-ctx 0 is invalid: it must be a positive context length"),
    (["--rope-scaling", "dynamic"], "argument --rope-scaling: invalid choice: 'dynamic'"),
    (["--expert-fetch", "fast"], "argument --expert-fetch: invalid choice: 'fast'"),
    (["--expert-cache-state", "/nonexistent/dir/state"],
     "--expert-cache-state '/nonexistent/dir/state' is invalid: its parent directory /nonexistent/dir does not exist"),
])
def test_cli_generate_refuses_bad_flags_before_loading(capsys, flags, message):
    rc, err = _cli(capsys, "generate", "--model", MISSING, "--prompt", "x", *flags)
    assert rc == 2 and message in err, err
    assert "no such file" not in err and "Traceback" not in err


def test_cli_good_flags_reach_the_file(capsys):
    rc, err = _cli(capsys, "generate", "--model", MISSING, "--prompt", "x", "--vram-budget", "32GiB", "-t", "0",
                   "--decode-chunk", "4", "--prefill-chunk", "64", "--policy", "lrfu(0.5)", "--prefetch-depth", "1",
                   "--kv", "q8_0,q4_0")
    assert rc == 2 and "no such file" in err


def test_cli_bad_environment_value(capsys, monkeypatch):
    monkeypatch.setenv("STRATA_JAX_QMATVEC", "2")
    rc, err = _cli(capsys, "generate", "--model", MISSING, "--prompt", "x")
    assert rc == 2 and "STRATA_JAX_QMATVEC='2' is invalid" in err and "no such file" not in err


def test_cli_serve_builds_the_config_before_anything(capsys):
    # serve opens the GGUF header before it listens; a bad flag is reported before that
    rc, err = _cli(capsys, "serve", "--model", MISSING, "--vram-budget", "banana")
    assert rc == 2 and "--vram-budget 'banana' is not a size" in err and "no such file" not in err
    rc, err = _cli(capsys, "serve", "--model", MISSING, "--policy", "mru")
    assert rc == 2 and "--policy: unknown cache policy 'mru'" in err


def test_cli_bench_validates_its_engine_options_before_writing(capsys, tmp_path):
    out = tmp_path / "rows.json"
    for flags, message in ((["--policy", "nope"], "--policy: unknown cache policy"),
                           (["--vram-budget", "banana"], "--vram-budget 'banana' is not a size"),
                           (["--prefetch-depth", "-2"], "--prefetch-depth -2 is invalid")):
        rc, err = _cli(capsys, "bench", "--shape", "tiny", "--out", str(out), *flags)
        assert rc == 2 and message in err, err
    assert not out.exists()


def test_cli_flags_map_to_options():
    assert set(FLAGS) <= set(OPTIONS)
    c = EngineConfig.create(flags=True, ctx="64", prefill_chunk="32", decode_chunk="2", expert_slots="8",
                            prefetch="1", parallel="3")
    assert (c.ctx, c.prefill_chunk, c.decode_chunk, c.expert_slots, c.prefetch, c.parallel) == (64, 32, 2, 8, 1, 3)


def test_cli_decode_chunk_help_names_the_platform_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: 16 on a GPU" in text and "1 elsewhere" in text


def test_ple_table_flag_is_checked_and_named():
    from strata_jax.cli import build_parser, engine_config

    with pytest.raises(ConfigError, match=r"--ple-table 'gpu' is invalid"):
        EngineConfig.create(flags=True, ple_table="gpu")
    assert EngineConfig.create().ple_table == "auto"
    args = build_parser().parse_args(["generate", "--ple-table", "host", "--prompt", "x"])
    assert engine_config(args).ple_table == "host"


def test_rope_scaling_override_sets_the_models_context(tmp_path):
    """--rope-scaling yarn --rope-scale 4 over a file without scaling: the config the forward pass reads has
    YaRN over the file's context, and ctx defaults to 4x it; yarn without a factor anywhere is refused."""
    spec = SyntheticSpec(arch="qwen2", n_layers=1, d_model=64, head_dim=16, ffn_dim=64, vocab_size=512, qtype="Q8_0")
    path = write_synthetic_gguf(tmp_path / "dense.gguf", spec)
    m = strata_jax.load(path, rope_scaling="yarn", rope_scale=4, yarn_orig_ctx=256, dtype="float32")
    r = m.config.rope_scaling
    assert (r.kind, r.factor, r.orig_ctx) == ("yarn", 4.0, 256) and m.config.context_length == 1024
    assert m.ctx == 1024
    with pytest.raises(ConfigError, match=r"rope scaling 'linear' needs a factor \(--rope-scale\)"):
        strata_jax.load(path, rope_scaling="linear")
    assert strata_jax.load(path, rope_scaling="none").config.rope_scaling is None


def test_a_session_compiles_its_prefill_with_the_prefill_options(monkeypatch):
    """STRATA_JAX_XLA_PREFILL reaches the prefill program alone (its own jit, compiled with those options; a
    GPU option parses on a CPU too); without it the session runs the module's one."""
    import strata_jax
    from strata_jax.bench.shapes import synthetic_model_path
    from strata_jax.engine import programs

    path = synthetic_model_path("tiny")
    plain = strata_jax.load(path, ctx=64)
    want = plain.generate([5, 6, 7], max_tokens=3, temperature=0).token_ids
    assert plain._session._prefill_fn is programs.prefill
    monkeypatch.setenv("STRATA_JAX_XLA_PREFILL", "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL")
    m = strata_jax.load(path, ctx=64)
    assert m.generate([5, 6, 7], max_tokens=3, temperature=0).token_ids == want
    fn = m._session._prefill_fn
    assert fn is not programs.prefill and fn._cache_size() == 1 and m._session._decode is programs.decode
