"""Bad input gets a clear error naming the problem and the fix; the CLI turns it into one line and
exit code 2, never a traceback. Uses small synthetic GGUFs (random weights, real byte-level tokenizer)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType

import strata_jax
from strata_jax.core.errors import (ConfigError, GGUFFormatError, MissingTensorError, TensorShapeError,
                               UnsupportedArchitectureError, UnsupportedQuantTypeError)
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.gguf.reader import GGUFFile
from strata_jax.engine.model import Model

SPEC = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=128, head_dim=32, expert_ffn_dim=64, ffn_dim=128,
                     vocab_size=512, qtype="Q8_0")


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "moe.gguf", SPEC)


@pytest.fixture(scope="module")
def model(moe_path):
    return strata_jax.load(moe_path, ctx=64)


def test_bad_magic(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(p)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(GGUFFormatError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(GGUFFormatError, match="directory"):
        GGUFFile(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.99, 200])
def test_truncated_file(tmp_path, moe_path, keep):
    data = moe_path.read_bytes()
    n = int(len(data) * keep) if keep < 1 else keep
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(GGUFFormatError, match="truncated|Download the file again"):
        GGUFFile(p)


def test_unsupported_architecture(tmp_path):
    p = write_synthetic_gguf(tmp_path / "rwkv.gguf", dataclasses.replace(SPEC, arch="rwkv6"))
    with pytest.raises(UnsupportedArchitectureError, match="rwkv6.*Supported: llama, qwen2, qwen3, qwen2moe, qwen3moe, olmoe"):
        strata_jax.load(p)


@pytest.mark.parametrize("kind, factor, match", [
    ("dynamic", 4.0, "rope.scaling.type 'dynamic' is not supported; supported: none, linear, yarn"),
    ("longrope", 1.0, "rope.scaling.type 'longrope' is not supported"),
    ("yarn", 0.5, "rope.scaling.factor 0.5 for yarn rope scaling is not supported; it must be at least 1"),
])
def test_unknown_rope_scaling_is_refused_by_name(moe_path, tmp_path, kind, factor, match):
    from gguf import GGUFValueType
    from reference_models import rewrite_gguf

    from strata_jax.model.config import ModelConfig, RopeScaling

    def scaled(kind, factor):
        return GGUFFile(rewrite_gguf(moe_path, tmp_path / f"{kind}.gguf", extra_kv=[
            ("qwen3moe.rope.scaling.type", kind, GGUFValueType.STRING),
            ("qwen3moe.rope.scaling.factor", factor, GGUFValueType.FLOAT32)]))

    assert ModelConfig.from_gguf(scaled("linear", 4.0)).rope_scaling == RopeScaling("linear", 4.0)  # the keys are read
    with pytest.raises(UnsupportedArchitectureError, match=match):
        ModelConfig.from_gguf(scaled(kind, factor))


def test_missing_tensor(moe_path):
    g = GGUFFile(moe_path)
    del g.tensors["blk.1.attn_v.weight"]
    with pytest.raises(MissingTensorError, match="blk.1.attn_v.weight"):
        Model(g)


def test_wrong_shape(moe_path):
    g = GGUFFile(moe_path)
    g.metadata["qwen3moe.attention.head_count"] = 8  # 8 heads x 32 no longer matches attn_q's rows
    with pytest.raises(TensorShapeError, match=r"attn_q.weight' has shape \(128, 128\), expected \(256, 128\)"):
        Model(g)


def test_unsupported_quant_type(moe_path):
    g = GGUFFile(moe_path)
    t = g.tensors["blk.0.attn_q.weight"]
    g.tensors[t.name] = dataclasses.replace(t, ggml_type=GGMLQuantizationType.Q8_1)
    with pytest.raises(UnsupportedQuantTypeError, match="Q8_1.*Q4_K"):
        Model(g)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_k=1.5), "top_k"),
    (dict(min_p=2), "min_p"),
    (dict(stop=[""]), "stop"),
])
def test_bad_generation_options(model, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        model.generate("hello", **kwargs)


def test_bad_prompts(model):
    with pytest.raises(ConfigError, match="empty"):
        model.generate([])
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        model.generate([1, 2, 10**6])
    with pytest.raises(ConfigError, match="exceed the context of 64"):
        model.generate(list(range(100)))
    with pytest.raises(ConfigError, match="token ids"):
        model.logits("hello")


def test_generation_basics(model):
    out = model.generate("the tea", max_tokens=6, temperature=0)
    assert out.finish_reason in ("length", "stop")
    assert out.prompt_token_ids == model.tokenize("the tea")
    assert out.timings["prompt_n"] == len(out.prompt_token_ids)
    assert out.timings["predicted_n"] == len(out.token_ids)
    chunks = list(model.generate_stream("the tea", max_tokens=6, temperature=0))
    assert "".join(c.text for c in chunks) == out.text
    assert sum((c.token_ids for c in chunks), []) == out.token_ids
    # a message list goes through the chat template
    msgs = [{"role": "user", "content": "hi"}]
    assert model.prompt_tokens(msgs) == model.tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_logits_shape_and_determinism(model):
    ids = model.tokenize("a test of the logits")
    a, b = model.logits(ids), model.logits(ids)
    assert a.shape == (len(ids), SPEC.vocab_size) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    # the last row is the next-token distribution that generation samples greedily from
    assert model.generate(ids, max_tokens=1, temperature=0).token_ids in ([int(a[-1].argmax())], [])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "strata_jax.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_generate_streams_and_reports_speed(moe_path):
    r = _cli("generate", "--model", str(moe_path), "--prompt", "the tea", "-n", "5", "-t", "0", "--ctx", "64")
    assert r.returncode == 0, r.stderr
    assert "prefill:" in r.stderr and "tok/s" in r.stderr and "decode:" in r.stderr
    ref = strata_jax.load(moe_path, ctx=64).generate("the tea", max_tokens=5, temperature=0).text
    assert r.stdout == ref + "\n"


def test_cli_generate_with_expert_cache_options(moe_path):
    r = _cli("generate", "--model", str(moe_path), "--prompt", "the tea", "-n", "5", "-t", "0", "--ctx", "64",
             "--expert-slots", "4", "--policy", "lfu", "--no-prefetch")
    assert r.returncode == 0, r.stderr
    assert "4 slots (25% of 16 experts), offloading" in r.stderr
    assert "hit rate" in r.stderr and "slots of 16" in r.stderr
    ref = strata_jax.load(moe_path, ctx=64).generate("the tea", max_tokens=5, temperature=0).text
    assert r.stdout == ref + "\n"
    r = _cli("generate", "--model", str(moe_path), "--prompt", "x", "--policy", "nope", "--expert-slots", "4")
    assert r.returncode == 2 and "unknown cache policy 'nope'" in r.stderr
    r = _cli("generate", "--model", str(moe_path), "--prompt", "x", "--expert-slots", "1")
    assert r.returncode == 2 and "too few" in r.stderr
    r = _cli("generate", "--model", str(moe_path), "--prompt", "x", "--prefetch-depth", "-1")
    assert r.returncode == 2 and "--prefetch-depth -1 is invalid" in r.stderr
    r = _cli("generate", "--model", str(moe_path), "--prompt", "x", "--expert-pools", "per-expert")
    assert r.returncode == 2 and "invalid choice: 'per-expert'" in r.stderr
    r = _cli("generate", "--model", str(moe_path), "--prompt", "x", "--expert-slots", "4",
             "--policy", "static:/nonexistent/profile.npy")
    assert r.returncode == 2 and "cannot read the static policy's profile" in r.stderr
    # decode in 2-step calls: the same text; a zero chunk is refused before loading
    r = _cli("generate", "--model", str(moe_path), "--prompt", "the tea", "-n", "5", "-t", "0", "--ctx", "64",
             "--expert-slots", "4", "--decode-chunk", "2")
    assert r.returncode == 0 and r.stdout == ref + "\n", r.stderr
    r = _cli("generate", "--model", str(moe_path), "--prompt", "x", "--decode-chunk", "0")
    assert r.returncode == 2 and "--decode-chunk 0 is invalid" in r.stderr


def test_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    r = _cli("generate", "--model", str(bad), "--prompt", "x")
    assert r.returncode == 2
    assert "strata-jax: error:" in r.stderr and "not a GGUF file" in r.stderr and "Traceback" not in r.stderr
    r = _cli("inspect", str(bad), "--vram-budget", "lots")
    assert r.returncode == 2 and "32GiB" in r.stderr and "Traceback" not in r.stderr


def test_cli_inspect(moe_path):
    r = _cli("inspect", str(moe_path), "--vram-budget", "2GiB", "--ctx", "256")
    assert r.returncode == 0, r.stderr
    assert "qwen3moe: 2 layers" in r.stdout
    assert "2 MoE layers x 8 experts = 16" in r.stdout
    assert "routed experts" in r.stdout and "Q8_0" in r.stdout
    assert "16 expert slots (100% of 16 experts)" in r.stdout
    r = _cli("inspect", str(moe_path), "--vram-budget", "10KiB")
    assert "too small" in r.stdout



def test_prompt_cache_reuses_prefix_and_changes_nothing(moe_path):
    """A follow-up prompt that extends the previous prompt + reply re-runs only the new tokens, and gives
    exactly what a cold run gives."""
    warm = strata_jax.load(moe_path, ctx=64)
    cold = strata_jax.load(moe_path, ctx=64)
    first = warm.generate("the tea", max_tokens=6, temperature=0)
    follow = first.prompt_token_ids + first.token_ids + warm.tokenize(" and the rain")
    a = warm.generate(follow, max_tokens=6, temperature=0)
    b = cold.generate(follow, max_tokens=6, temperature=0, cache_prompt=False)
    assert a.token_ids == b.token_ids
    # everything fed through the model last time is reused: the prompt and all but the last reply token
    assert a.timings["cache_n"] == len(first.prompt_token_ids) + len(first.token_ids) - 1
    assert a.timings["prompt_n"] == len(follow) - a.timings["cache_n"]
    assert b.timings["cache_n"] == 0
    # a different prompt shares nothing; an identical one re-runs just its last token
    assert warm.generate("zzz", max_tokens=2, temperature=0).timings["cache_n"] == 0
    again = warm.generate("zzz", max_tokens=2, temperature=0)
    assert again.timings["cache_n"] == len(warm.tokenize("zzz")) - 1
    np.testing.assert_array_equal(warm.logits(follow), cold.logits(follow))


def test_abandoned_stream_keeps_a_valid_cache(moe_path):
    m = strata_jax.load(moe_path, ctx=64)
    stream = m.generate_stream("the tea", max_tokens=20, temperature=0)
    next(stream)
    stream.close()  # the client went away mid-generation
    ref = strata_jax.load(moe_path, ctx=64).generate("the tea is", max_tokens=5, temperature=0)
    out = m.generate("the tea is", max_tokens=5, temperature=0)
    assert out.token_ids == ref.token_ids and out.timings["cache_n"] > 0


def test_stop_token_ends_the_device_loop_and_keeps_the_cache_exact(moe_path):
    """Decode runs chunks of steps on the device, one chunk queued ahead of the host. A sampled stop id
    ends the chunk's loop there and the queued chunk runs no step: the reply stops at the same place,
    the KV cache holds the prompt and the reply (a follow-up reuses them; the stop token itself was
    never fed), and the follow-up gives exactly what a cold run gives."""
    ref = strata_jax.load(moe_path, ctx=64).generate("the tea", max_tokens=8, temperature=0)
    stop = ref.token_ids[3]
    assert stop not in ref.token_ids[:3]
    warm = strata_jax.load(moe_path, ctx=64, decode_chunk=2)  # chunks: tokens 1-2, 3 (the stop), none
    warm.tokenizer.stop_ids = frozenset({stop})
    first = warm.generate("the tea", max_tokens=8, temperature=0)
    assert first.finish_reason == "stop" and first.token_ids == ref.token_ids[:3]
    host = warm.host_timing()
    # tokens 1-2, then the stop token (its chunk's second step never ran), then a queued chunk with no step
    assert host["decode_steps"] == 3 and host["decode_calls"] == 3 and host["dispatch_ms_per_step"] > 0
    follow = first.prompt_token_ids + first.token_ids + [stop] + warm.tokenize(" and the rain")
    a = warm.generate(follow, max_tokens=6, temperature=0)
    assert a.timings["cache_n"] == len(first.prompt_token_ids) + len(first.token_ids)
    cold = strata_jax.load(moe_path, ctx=64)
    cold.tokenizer.stop_ids = frozenset({stop})
    assert a.token_ids == cold.generate(follow, max_tokens=6, temperature=0, cache_prompt=False).token_ids


@pytest.mark.parametrize("bad", [0, -3, 2.5, "16", True])
def test_bad_decode_chunk_is_a_config_error(moe_path, bad):
    with pytest.raises(ConfigError, match="decode_chunk=.* must be a positive integer"):
        strata_jax.load(moe_path, ctx=64, decode_chunk=bad)


def test_decode_chunk_default_follows_the_device(moe_path, caplog):
    """16 steps per call on a GPU (where the launch of a step costs as much as the step), 1 elsewhere; the
    load log says which."""
    from strata_jax.engine.config import default_decode_chunk

    assert default_decode_chunk("gpu") == 16 and default_decode_chunk("cpu") == 1
    with caplog.at_level("INFO", logger="strata_jax"):
        m = strata_jax.load(moe_path, ctx=64)
    assert m.decode_chunk == default_decode_chunk(m.device.platform)
    assert f"decode {m.decode_chunk} step" in caplog.text


def test_cli_generate_runs_until_the_model_stops_and_says_which_limit_cut_it(moe_path, capsys):
    from strata_jax.cli import main

    # no --max-tokens: the answer ends where the model stops, or at the context's end, not at a fixed count
    assert main(["generate", "--model", str(moe_path), "--prompt", "the tea", "-t", "0", "--ctx", "64"]) == 0
    out, err = capsys.readouterr()
    ref = strata_jax.load(moe_path, ctx=64).generate("the tea", max_tokens=64, temperature=0)
    assert out == ref.text + "\n"
    if ref.finish_reason == "length":
        assert len(ref.prompt_token_ids) + len(ref.token_ids) == 64
        assert "finish: length (stopped at the context limit --ctx 64; raise it with --ctx N" in err
    else:
        assert "finish: stop\n" in err
    assert main(["generate", "--model", str(moe_path), "--prompt", "the tea", "-t", "0", "--ctx", "64",
                 "-n", "3"]) == 0
    out, err = capsys.readouterr()
    if ref.finish_reason == "length" or len(ref.token_ids) > 3:
        assert "finish: length (stopped at --max-tokens 3; raise it with --max-tokens N)" in err


def test_cli_generate_says_when_it_compiles_and_the_time_to_first_token(moe_path):
    r = _cli("generate", "--model", str(moe_path), "--prompt", "the tea", "-n", "5", "-t", "0", "--ctx", "64")
    assert r.returncode == 0, r.stderr
    err = r.stderr
    # announced before the wait (after the "loaded" line), then timed once done
    loaded = err.index("strata-jax: loaded ")
    # (the decode program compiles on a thread beside the prefill's: engine/session.py _compile_beside)
    for program, how in (("prefill", ""), ("decode", " beside")):
        announced = err.index(f"compiling the {program} program{how} (first run only; ")
        assert announced > loaded
        assert re.search(rf"(compiled|read from the compilation cache) the {program} program{how} \(attention over "
                         rf"[\d,]+ positions\) in \d+\.\d s", err[announced:]), err
    summary = err.splitlines()[-2] if "experts:" in err.splitlines()[-1] else err.splitlines()[-1]
    assert re.search(r"first token after \d+\.\d\d s \(\d+\.\d s of it compiling\); prefill:", summary), summary
    assert "compiling: " in summary and "in all (first run only: " in summary
