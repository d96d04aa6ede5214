"""Logprobs and penalties on the Python API: logprobs equal log_softmax of `Model.logits` over the prompt
and the generated tokens (the first token's from the prefill); presence/frequency/repeat penalties pick,
at every step, the token a numpy reference picks from the same logits (teacher-forced); zero penalties
leave logits and tokens bit for bit as they were; toggling either per request compiles nothing.

Shape legend: V vocab, T positions, W repeat window.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import strata_jax
from conftest import count_compiles
from strata_jax.core.errors import ConfigError
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.engine import programs
from strata_jax.engine.sampling import (REPEAT_WINDOW, TOP_LOGPROBS, PenaltyState, SamplingMode, SamplingParams,
                                       penalize, sample)
from strata_jax.serving import protocol

MOE = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=128, head_dim=32, expert_ffn_dim=64, ffn_dim=128,
                    vocab_size=512, qtype="Q8_0", seed=5)
PROMPT = "the tea is hot and the rain is there, so she sat on the stairs to read a note"
SHORT = "hello there"  # greedy output repeats itself early: 353, 492, 353, 492, ...


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("lp") / "moe.gguf", MOE)
    return strata_jax.load(path, ctx=256, expert_slots=8, prefill_chunk=16, expert_pools="shared")


def log_softmax(x_TV: np.ndarray) -> np.ndarray:
    x_TV = x_TV.astype(np.float64)
    m = x_TV.max(-1, keepdims=True)
    return x_TV - m - np.log(np.exp(x_TV - m).sum(-1, keepdims=True))


def penalized_np(logits_V, prompt, generated, presence=0.0, frequency=0.0, repeat=1.0, last_n=64):
    """The same formula as sampling.penalize, in numpy float32: repeat over the last `last_n` tokens of
    prompt + generated, then presence/frequency over the generated tokens."""
    out = logits_V.astype(np.float32).copy()
    window = (list(prompt) + list(generated))[-last_n:] if last_n else []
    if repeat != 1:
        for t in set(window):
            out[t] = out[t] / np.float32(repeat) if out[t] > 0 else out[t] * np.float32(repeat)
    counts = np.bincount(np.asarray(generated, np.int64), minlength=len(out)).astype(np.float32)
    if presence or frequency:
        hit = counts > 0
        out[hit] -= np.float32(frequency) * counts[hit] + np.float32(presence)
    return out


def teacher_forced(model, prompt_ids, generated):
    """float32 [len(generated), V]: the next-token logits before each generated token."""
    full = model.logits(list(prompt_ids) + list(generated))
    return full[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(generated)]


# -- penalties -----------------------------------------------------------------------------------------

def test_zero_penalties_leave_logits_bit_identical():
    rng = np.random.default_rng(0)
    B, V = 3, 300
    logits = rng.normal(0, 4, (B, V)).astype(np.float32)
    logits[0, :5] = [0.0, -0.0, -np.inf, 1e30, -1e-30]
    counts = rng.integers(0, 3, (B, V)).astype(np.int32)
    recent = rng.integers(-1, V, (B, REPEAT_WINDOW)).astype(np.int32)
    pen = PenaltyState(jax.numpy.asarray(counts), jax.numpy.asarray(recent))
    for repeat_last_n in (0, 64, REPEAT_WINDOW):
        sp = SamplingParams.make(B, 0.0, repeat_last_n=repeat_last_n)
        out = np.asarray(jax.jit(penalize)(logits, sp, pen))
        assert out.tobytes() == logits.tobytes()
    # and on: each row as the numpy reference computes it
    sp = SamplingParams.make(B, 0.0, presence_penalty=0.5, frequency_penalty=-0.25, repeat_penalty=1.3,
                             repeat_last_n=7)
    out = np.asarray(jax.jit(penalize)(logits, sp, pen))
    for b in range(B):
        gen = np.repeat(np.arange(V), counts[b])  # a generated history with these counts
        win = [t for t in recent[b, -7:] if t >= 0]
        ref = logits[b].copy()
        for t in set(win):
            ref[t] = ref[t] / np.float32(1.3) if ref[t] > 0 else ref[t] * np.float32(1.3)
        c = np.bincount(gen, minlength=V).astype(np.float32)
        ref[c > 0] -= np.float32(-0.25) * c[c > 0] + np.float32(0.5)
        np.testing.assert_allclose(out[b], ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(temperature=0),
                                dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=1),
                                dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=2)],
                         ids=["greedy", "seeded", "seeded-filtered"])
def test_zero_penalties_and_logprobs_change_no_token(moe, kw):
    """Tokens as the sampler alone picks them from the model's logits at each step (the first from the
    prefill), whether penalties are spelled out as zero and whether logprobs are on."""
    base = moe.generate(PROMPT, max_tokens=16, cache_prompt=False, **kw)
    again = moe.generate(PROMPT, max_tokens=16, cache_prompt=False, presence_penalty=0.0, frequency_penalty=0.0,
                         repeat_penalty=1.0, repeat_last_n=REPEAT_WINDOW, logprobs=True, top_logprobs=5, **kw)
    assert again.token_ids == base.token_ids and base.logprobs is None and len(again.logprobs) == 16
    seed = kw.get("seed", 0)
    sp = SamplingParams.make(1, kw["temperature"], kw.get("top_p", 0.95), kw.get("top_k", 40), kw.get("min_p", 0.05))
    key = jax.random.PRNGKey(seed)
    draw = jax.jit(lambda logits, key, sp: sample(logits, key[None], sp, SamplingMode(True, False, False)))
    for i, logits_V in enumerate(teacher_forced(moe, base.prompt_token_ids, base.token_ids)):
        assert int(draw(logits_V[None], jax.random.fold_in(key, i), sp)[0]) == base.token_ids[i], i


PENALTIES = [dict(presence_penalty=2.0), dict(frequency_penalty=1.5), dict(presence_penalty=-2.0),
             dict(repeat_penalty=3.0), dict(repeat_penalty=2.0, repeat_last_n=3),
             dict(presence_penalty=0.7, frequency_penalty=0.6, repeat_penalty=1.4, repeat_last_n=20)]


@pytest.mark.parametrize("pen", PENALTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_penalized_greedy_matches_numpy_reference(moe, pen):
    plain = moe.generate(SHORT, max_tokens=16, temperature=0, cache_prompt=False)
    got = moe.generate(SHORT, max_tokens=16, temperature=0, cache_prompt=False, **pen)
    assert got.token_ids != plain.token_ids  # the penalty acted
    ref_kw = dict(presence=pen.get("presence_penalty", 0.0), frequency=pen.get("frequency_penalty", 0.0),
                  repeat=pen.get("repeat_penalty", 1.0), last_n=pen.get("repeat_last_n", 64))
    prompt = got.prompt_token_ids
    for i, logits_V in enumerate(teacher_forced(moe, prompt, got.token_ids)):
        want = int(np.argmax(penalized_np(logits_V, prompt, got.token_ids[:i], **ref_kw)))
        assert want == got.token_ids[i], (i, pen)
    if pen == dict(presence_penalty=2.0):  # the repeating loop of the plain output is broken
        assert plain.token_ids[:4] == [plain.token_ids[0], plain.token_ids[1]] * 2
        assert got.token_ids[2] != got.token_ids[0]


def test_penalized_seeded_matches_reference_and_prompt_cache(moe):
    pen = dict(presence_penalty=1.0, frequency_penalty=0.5, repeat_penalty=1.2, repeat_last_n=10)
    kw = dict(temperature=0.9, top_p=0.95, top_k=30, min_p=0.0, seed=11)
    got = moe.generate(PROMPT, max_tokens=12, cache_prompt=False, **kw, **pen)
    assert got.token_ids != moe.generate(PROMPT, max_tokens=12, cache_prompt=False, **kw).token_ids
    sp = SamplingParams.make(1, kw["temperature"], kw["top_p"], kw["top_k"], kw["min_p"])
    key, prompt = jax.random.PRNGKey(kw["seed"]), got.prompt_token_ids
    draw = jax.jit(lambda logits, key, sp: sample(logits, key[None], sp, SamplingMode(True, False, False)))
    for i, logits_V in enumerate(teacher_forced(moe, prompt, got.token_ids)):
        ref = penalized_np(logits_V, prompt, got.token_ids[:i], 1.0, 0.5, 1.2, 10)
        assert int(draw(ref[None], jax.random.fold_in(key, i), sp)[0]) == got.token_ids[i], i
    # a reused prompt prefix does not shorten the repeat window: it covers the whole prompt's tail
    moe.generate(PROMPT, max_tokens=2, temperature=0)
    cached = moe.generate(PROMPT + " again", max_tokens=12, **kw, **pen)
    fresh = moe.generate(PROMPT + " again", max_tokens=12, cache_prompt=False, **kw, **pen)
    assert cached.timings["cache_n"] > 0 and cached.token_ids == fresh.token_ids


# -- logprobs -----------------------------------------------------------------------------------------

def test_logprobs_match_log_softmax_of_model_logits(moe):
    got = moe.generate(PROMPT, max_tokens=12, temperature=0, cache_prompt=False, logprobs=True,
                       top_logprobs=TOP_LOGPROBS)
    ref_TV = log_softmax(teacher_forced(moe, got.prompt_token_ids, got.token_ids))
    assert len(got.logprobs) == len(got.token_ids) == 12
    text, decoder = "", moe.tokenizer.stream_decoder()  # offsets: where each token's text starts
    for i, (e, ref_V) in enumerate(zip(got.logprobs, ref_TV)):
        assert e.token_id == got.token_ids[i]
        assert e.logprob == pytest.approx(ref_V[e.token_id], abs=1e-4)
        order = np.argsort(-ref_V, kind="stable")[:TOP_LOGPROBS]
        ids, vals = zip(*e.top)
        np.testing.assert_allclose(vals, ref_V[order], atol=1e-4)
        near_tie = np.abs(np.diff(ref_V[order])) < 1e-4  # only there may the order differ
        assert all(a == b or near_tie[max(j - 1, 0):j + 1].any() for j, (a, b) in enumerate(zip(ids, order)))
        assert e.token_id == ids[0]  # greedy: the top token
        assert e.offset == len(text)
        text += decoder.push(e.token_id)
    assert text + decoder.flush() == got.text
    # fewer alternatives are a prefix of the same list; logprobs without alternatives carry none
    few = moe.generate(PROMPT, max_tokens=12, temperature=0, cache_prompt=False, logprobs=True, top_logprobs=2)
    assert [e.top for e in few.logprobs] == [e.top[:2] for e in got.logprobs]
    none = moe.generate(PROMPT, max_tokens=3, temperature=0, cache_prompt=False, logprobs=True)
    assert all(e.top == [] for e in none.logprobs)
    assert [e.logprob for e in none.logprobs] == [e.logprob for e in got.logprobs[:3]]


def test_logprobs_are_of_the_raw_distribution(moe):
    """Penalties and temperature change which token is drawn, not the reported distribution."""
    got = moe.generate(SHORT, max_tokens=8, temperature=0, cache_prompt=False, presence_penalty=2.0,
                       logprobs=True, top_logprobs=3)
    ref_TV = log_softmax(teacher_forced(moe, got.prompt_token_ids, got.token_ids))
    for e, ref_V in zip(got.logprobs, ref_TV):
        assert e.logprob == pytest.approx(ref_V[e.token_id], abs=1e-4)
        assert [t for t, _ in e.top] == list(np.argsort(-ref_V)[:3])
    assert any(e.token_id != e.top[0][0] for e in got.logprobs)  # a penalised pick that is not the top


def test_stream_chunks_carry_their_tokens_logprobs(moe):
    chunks = list(moe.generate_stream(PROMPT, max_tokens=10, seed=3, temperature=1.0, logprobs=True,
                                      top_logprobs=1, cache_prompt=False))
    assert all(c.logprobs is not None and [e.token_id for e in c.logprobs] == c.token_ids for c in chunks)


def test_partial_utf8_token_text():
    assert protocol.token_text(b"\xe2\x80") == "bytes:\\xe2\\x80"
    assert protocol.token_text(" caf\xe9".encode()) == " café"
    assert protocol.MAX_TOP_LOGPROBS == TOP_LOGPROBS and protocol.REPEAT_WINDOW == REPEAT_WINDOW


def test_invalid_values_are_config_errors(moe):
    for kw, name in ((dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency"),
                     (dict(repeat_penalty=-1.0), "repeat_penalty"), (dict(repeat_penalty=0), "repeat_penalty"),
                     (dict(repeat_last_n=-1), "repeat_last_n"), (dict(repeat_last_n=REPEAT_WINDOW + 1), "repeat_last"),
                     (dict(top_logprobs=21), "top_logprobs"), (dict(top_logprobs=-1), "top_logprobs"),
                     (dict(logprobs=3), "logprobs")):
        with pytest.raises(ConfigError, match=name):
            moe.generate(SHORT, max_tokens=2, **kw)


def test_sampling_values_compile_nothing_once_their_mode_is_compiled(moe):
    """Sampling parameters are traced: new values compile nothing. The decode chunk is compiled once per
    SamplingMode (greedy or sampled, penalties on or off, logprobs or not: what a conditional would decide
    inside its device-side loop), so after one request of each mode no other request compiles."""
    configs = [dict(temperature=0), dict(temperature=0, logprobs=True, top_logprobs=20),
               dict(temperature=0.7, seed=1, presence_penalty=1.0, frequency_penalty=0.3),
               dict(temperature=0, repeat_penalty=1.5, repeat_last_n=5, logprobs=True),
               dict(temperature=1.0, seed=2, top_k=0, top_p=1.0, min_p=0.0, logprobs=True, top_logprobs=3)]
    warm = [dict(temperature=0), dict(temperature=0, logprobs=True, top_logprobs=1),
            dict(temperature=0.2, seed=9, frequency_penalty=-0.5), dict(temperature=0, presence_penalty=0.1, logprobs=True),
            dict(temperature=0.5, seed=3, top_k=5, logprobs=True)]  # the same five modes, other values
    for kw in warm:
        moe.generate(PROMPT, max_tokens=4, cache_prompt=False, **kw)
    jit_entries = programs.decode._cache_size(), programs.prefill._cache_size()
    with count_compiles() as compiles:
        for kw in configs:
            moe.generate(PROMPT, max_tokens=6, cache_prompt=False, **kw)
    assert compiles == []
    # the persistent compilation cache can hide a recompile from the counter; the jit caches cannot
    assert (programs.decode._cache_size(), programs.prefill._cache_size()) == jit_entries
