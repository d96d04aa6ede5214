"""Speculative decoding with prompt-lookup drafts (EngineConfig.spec="lookup"): greedy output identical to
plain decode on a synthetic MoE (offloaded and resident) and on the real default model, with drafts
accepted where the text repeats; sampled output keeps the target distribution (chi-square tests of the
acceptance rule against the exact distribution, with biased rules shown to fail them, and of spec on
against spec off end to end), and a seed gives plain decode's tokens; the n-gram drafter and the
adaptive switch; hybrid models' recurrent state rewound past rejected drafts; the fallbacks (a grammar,
several rows) and refusals (bad values)."""

from __future__ import annotations

import collections
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import strata_jax
from strata_jax.bench.shapes import synthetic_model_path
from strata_jax.bench.spec import OracleDrafter
from strata_jax.cli import main
from strata_jax.core.errors import ConfigError
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.engine import lookup
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.lookup import Acceptance, lookup_draft
from strata_jax.engine.sampling import REPEAT_WINDOW, PenaltyState, SamplingMode, SamplingParams, accept_drafts
from strata_jax.engine.session import Session
from strata_jax.serving.app import create_app
from strata_jax.serving.engine import Engine

# 8 experts top-2 per layer, 16 in all
MOE = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=128, head_dim=32, expert_ffn_dim=64, ffn_dim=128,
                    vocab_size=512, qtype="Q8_0", seed=5)
# a random model falls into loops, which lookup drafts; the prompt repeats itself too
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"
N = 40


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("spec") / "moe.gguf", MOE)


@pytest.fixture(scope="module")
def plain(moe_path):
    return strata_jax.load(moe_path, ctx=256).generate(PROMPT, max_tokens=N, temperature=0)


# -- the drafter ------------------------------------------------------------------------------------------

def test_lookup_draft_takes_the_longest_suffix_latest_occurrence():
    # suffix [1, 2, 3] occurred at 0 (then 9, 9) and at 5 (then 7, 1): the latest wins
    assert lookup_draft([1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]
    assert lookup_draft([1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3], 8) == [7, 1, 2, 3]  # up to the end
    # the longest match decides: [5, 1] occurred only once, before 4; the single [1] later before 8
    assert lookup_draft([5, 1, 4, 6, 1, 8, 5, 1], 1) == [4]
    assert lookup_draft([1, 8, 6, 1], 3) == [8, 6, 1]  # a 1-gram when nothing longer repeats
    assert lookup_draft([1, 2, 3, 4], 4) == []  # no earlier occurrence of any suffix
    assert lookup_draft([7], 4) == [] and lookup_draft([], 4) == [] and lookup_draft([3, 3], 0) == []
    assert lookup_draft([3, 3], 4) == [3]
    # ngram_max bounds the match: 5-gram [1..5] repeats, but only up to 4 tokens are matched
    seq = [1, 2, 3, 4, 5, 0, 9, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]
    assert lookup_draft(seq, 2) == [6, 1]  # the latest 4-gram [2, 3, 4, 5] (at 7) is followed by 6
    assert lookup_draft(seq, 2, ngram_max=5) == [0, 9]


def test_acceptance_pauses_drafting_after_low_acceptance_and_resumes():
    a = Acceptance()
    for _ in range(lookup.WINDOW):
        assert a.should_draft()
        a.record(4, 1)  # 25% < MIN_RATE
    assert [a.should_draft() for _ in range(lookup.COOLDOWN)] == [False] * lookup.COOLDOWN
    assert a.should_draft()
    for _ in range(2 * lookup.WINDOW):  # a row that accepts stays drafting
        a.record(4, 2)
        assert a.should_draft()


def test_acceptance_drafts_about_what_it_accepts():
    """The draft count follows the recent acceptance r: one more than the r / (1 - r) drafts a pass accepts in a
    run on average, at least 1, at most n_max; all accepted or nothing recorded yet: n_max; not adaptive: n_max."""
    a = Acceptance()
    assert a.draft_count(6) == 6
    for drafted, accepted, want in ((4, 4, 6), (4, 2, 2), (4, 3, 4), (8, 1, 2)):
        a = Acceptance()
        for _ in range(lookup.WINDOW - 1):
            a.record(drafted, accepted)
        assert a.draft_count(6) == want, (drafted, accepted)
    a = Acceptance(adaptive=False)
    for _ in range(3 * lookup.WINDOW):
        a.record(4, 0)
        assert a.should_draft() and a.draft_count(6) == 6


@pytest.mark.spec_cost
def test_acceptance_weighs_a_pass_against_plain_steps():
    """worth(n): a pass of n drafts is taken when 1 + p + ... + p^n tokens (p: a draft's acceptance after an
    accepted one, over the window) are worth its cost in plain tokens; the first timing of each kind (its
    compile) is dropped; unknown costs, a short window or a forced acceptance always draft; a pause drafts
    nothing for COOLDOWN steps, then tries afresh."""
    a = Acceptance()
    assert a.worth(4)  # nothing known yet
    for _ in range(lookup.WINDOW):
        a.record(4, 2)  # two accepted, then a rejection: p = 8 / 12, 2.605 tokens a pass of 4
    assert a.worth(4)  # no timings yet
    a.timed("pass", 9.0)  # compiles: dropped
    a.timed("plain", 9.0, 16)
    assert a.worth(4)
    for _ in range(3):
        a.timed("plain", 0.160, 16)  # 10 ms a token
    a.timed("pass", 0.026)
    assert a.pass_s[0] == 0.026 and a.token_s[0] == 0.010
    assert a.worth(4)  # 2.605 x 10 ms >= 26 ms
    a.timed("pass", 0.027)
    a.timed("pass", 0.028)  # median 27 ms: a pass of 4 costs more than it emits ...
    assert not a.worth(4) and a.worth(8)  # ... one of 8 (2.92 tokens) does not
    a.pause()
    assert [a.should_draft() for _ in range(lookup.COOLDOWN)] == [False] * lookup.COOLDOWN
    assert a.should_draft() and a.worth(4)  # a fresh window: it tries again
    for _ in range(lookup.WINDOW):
        a.record(4, 4)  # every draft accepted: p = 1, 5 tokens a pass
    assert a.worth(4)
    forced = Acceptance(adaptive=False)
    for _ in range(lookup.WINDOW):
        forced.record(4, 0)
        forced.timed("plain", 0.001, 1)
        forced.timed("pass", 1.0)
    assert forced.worth(4)


@pytest.mark.spec_cost
def test_a_pass_that_does_not_pay_is_not_taken(moe_path, plain, monkeypatch):
    """The session asks worth() before each pass: when it says no, the row decodes plainly (no drafts, the
    same tokens) and pauses drafting."""
    paused = []
    monkeypatch.setattr(Acceptance, "worth", lambda self, n: False)
    monkeypatch.setattr(Acceptance, "pause", lambda self: paused.append(1) or setattr(self, "cooldown", 1))
    m = strata_jax.load(moe_path, ctx=256, spec="lookup")
    out = m.generate(PROMPT, max_tokens=N, temperature=0)
    assert out.token_ids == plain.token_ids
    assert out.timings["draft_n"] == 0 and paused


# -- identical greedy tokens ----------------------------------------------------------------------------

@pytest.mark.parametrize("slots", [None, 8], ids=["resident", "offloaded"])
def test_greedy_spec_equals_plain_decode(moe_path, plain, slots):
    m = strata_jax.load(moe_path, ctx=256, expert_slots=slots, spec="lookup")
    if slots:
        assert not m.cache_plan.resident
    out = m.generate(PROMPT, max_tokens=N, temperature=0)
    assert out.token_ids == plain.token_ids and out.text == plain.text
    t = out.timings
    assert t["draft_n"] >= t["draft_n_accepted"] > 0 and t["predicted_n"] == N
    assert m.host_timing()["decode_calls"] < N - 1  # verify passes took several tokens each
    # a stop-free greedy request that ends on max_tokens inside a pass ends exactly there
    short = m.generate(PROMPT, max_tokens=7, temperature=0)
    assert short.token_ids == plain.token_ids[:7] and short.finish_reason == "length"


def test_a_drafter_of_your_own_keeps_greedy_output_and_its_counts(moe_path, plain):
    """Model.use_drafter: bench/spec.py's oracle (the greedy continuation, each token right with a forced
    probability) drafts; output stays plain decode's, every draft of an always-right oracle is accepted
    (so the passes emit K tokens each), a never-right one gets none accepted, and None turns it off."""
    m = strata_jax.load(moe_path, ctx=256, expert_slots=6)
    ids = m.tokenize(PROMPT)
    ref = plain.token_ids
    for accept, spec_max in ((1.0, 3), (0.0, 2), (0.6, 4)):
        m.use_drafter(OracleDrafter(ref, len(ids), accept, m.config.vocab_size, seed=1, force=False),
                      spec_max=spec_max)
        m.reset_stats()
        out = m.generate(ids, max_tokens=N, temperature=0)
        t = out.timings
        assert out.token_ids == ref, accept
        if accept == 1.0:
            assert t["draft_n_accepted"] == t["draft_n"] >= N - 1 - (N - 1) // (spec_max + 1) - spec_max
            assert m.host_timing()["decode_calls"] <= -(-(N - 1) // (spec_max + 1)) + 1
        elif accept == 0.0:
            assert t["draft_n"] > 0 and t["draft_n_accepted"] == 0
        else:
            assert 0 < t["draft_n_accepted"] < t["draft_n"]
    m.use_drafter(None)
    assert "draft_n" not in m.generate(ids, max_tokens=4, temperature=0).timings
    with pytest.raises(ConfigError, match="spec_max"):
        m.use_drafter(OracleDrafter(ref, len(ids), 1.0, 512), spec_max=0)


def test_a_benchmark_can_force_the_acceptance(moe_path, plain):
    """bench/spec.py's forced acceptance (the verify program's accept_n): drafts the model would reject
    (a constant token) are accepted as many as the oracle says and emitted as drafted; every pass of an
    always-accepting oracle then emits spec_max + 1 tokens."""
    m = strata_jax.load(moe_path, ctx=256)
    ids = m.tokenize(PROMPT)
    bad = 7 if plain.token_ids[0] != 7 else 8
    for accept, spec_max in ((1.0, 3), (0.0, 3)):
        oracle = OracleDrafter([bad] * (N + 8), len(ids), accept, m.config.vocab_size)
        m.use_drafter(oracle, spec_max=spec_max)
        out = m.generate(ids, max_tokens=N, temperature=0)
        t = out.timings
        if accept == 1.0:
            assert t["draft_n_accepted"] == t["draft_n"] and t["draft_n"] + oracle.calls == N - 1  # no plain step
            assert t["draft_n"] >= (oracle.calls - 1) * spec_max
            assert out.token_ids[1:1 + spec_max] == [bad] * spec_max  # the drafts, not the model's tokens
        else:
            assert t["draft_n_accepted"] == 0 and out.token_ids[:4] == plain.token_ids[:4]
    m.use_drafter(None)


def test_verify_pass_looks_each_distinct_expert_up_once(moe_path):
    """A verify pass routes its drafted tokens together: with every position forced to the same k experts,
    a pass counts k lookups per layer, as a one-token step does, not k per token (one fetch per distinct
    expert when offloading). So lookups = layers x k x the few-token calls, and the calls are the emitted
    tokens after the first, less the accepted drafts (each pass emits its accepted drafts + 1)."""
    m = strata_jax.load(moe_path, ctx=256, spec="lookup", spec_max=3)  # 4 tokens x top-2 <= 8 experts: few path
    cfg = m.config
    M, k = len(cfg.moe_layers), cfg.n_experts_used
    m.force_routing(np.broadcast_to(np.arange(k, dtype=np.int32), (1, M, k)))
    m.reset_stats()
    out = m.generate(PROMPT, max_tokens=N, temperature=0)
    t, st = out.timings, m.stats()
    assert t["draft_n_accepted"] > 0 and t["draft_n"] > 0
    calls = N - 1 - t["draft_n_accepted"]
    assert st["lookups"] == M * k * calls  # per token it would be M * k * (calls + draft_n)


def test_rejected_drafts_leave_the_cache_as_plain_decode_does(moe_path, plain):
    """Rollback: a pass writes K/V for every drafted token, rejected ones included; what lies past the
    accepted tokens is overwritten before anything attends to it. After the same greedy request, the
    cache positions the sequence holds equal plain decode's (f32 on CPU; a pass computes several
    positions at once, so to rounding), and the next turn continues from them as plain decode does."""
    spec, base = (strata_jax.load(moe_path, ctx=256, spec=sp) for sp in ("lookup", None))
    outs = [m.generate(PROMPT, max_tokens=N, temperature=0) for m in (spec, base)]
    assert outs[0].token_ids == outs[1].token_ids == plain.token_ids and outs[0].timings["draft_n"] > outs[0].timings["draft_n_accepted"]
    n = len(spec.session().cached_tokens(0))
    assert n == len(base.session().cached_tokens(0)) > N
    for a, b in zip(jax.tree.leaves(spec.session()._kv), jax.tree.leaves(base.session()._kv)):
        np.testing.assert_allclose(np.asarray(a)[:, :, :n], np.asarray(b)[:, :, :n], rtol=1e-5, atol=1e-5)
    turn2 = spec.session().cached_tokens(0) + [7, 8, 9]
    assert spec.generate(turn2, max_tokens=8, temperature=0).token_ids == \
        base.generate(turn2, max_tokens=8, temperature=0).token_ids


def test_a_request_caps_or_turns_off_its_drafts(moe_path, plain):
    """spec_max per request (the Python API's, llama.cpp's speculative.n_max on the server): 0 decodes
    without speculation, 1 drafts at most one token per verify pass; greedy tokens stay plain decode's."""
    from starlette.testclient import TestClient

    m = strata_jax.load(moe_path, ctx=256, spec="lookup", spec_max=4)
    off = m.generate(PROMPT, max_tokens=N, temperature=0, spec_max=0)
    assert off.token_ids == plain.token_ids and off.timings["draft_n"] == 0
    calls = m.host_timing()["decode_calls"]
    one = m.generate(PROMPT, max_tokens=N, temperature=0, spec_max=1)
    passes = m.host_timing()["decode_calls"] - calls
    assert one.token_ids == plain.token_ids and 0 < one.timings["draft_n"] <= passes
    engine = Engine(lambda: m, warmup=False)
    with TestClient(create_app(engine, model_id="moe")) as client:
        assert engine.wait_ready(60)
        body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0}
        none = client.post("/v1/completions", json={**body, "speculative.n_max": 0}).json()
        some = client.post("/v1/completions", json=body).json()
        bad = client.post("/v1/completions", json={**body, "speculative.n_max": -1})
    assert none["choices"][0]["text"] == some["choices"][0]["text"] == plain.text
    assert none["timings"]["draft_n"] == 0 < some["timings"]["draft_n"]
    assert bad.status_code == 400 and "speculative.n_max" in bad.json()["error"]["message"]


def test_grammar_falls_back_to_plain_decode(moe_path, caplog):
    llg = pytest.importorskip("llguidance")  # noqa: F841
    from strata_jax.engine.constrained import request_grammar

    grammar = request_grammar(grammar='root ::= word (" " word)* "."\nword ::= [a-e]+')
    s = Session(strata_jax.load(moe_path, ctx=256, spec="lookup"), 1)
    with caplog.at_level(logging.INFO, logger="strata_jax"):
        row, chunks = s.admit(PROMPT, max_tokens=8, temperature=0, constraint=grammar)
    chunks = list(chunks)
    while row in s.active_rows:
        chunks += s.step().get(row, [])
    assert chunks[-1].timings["draft_n"] == 0
    assert sum("decodes without speculation (it has a grammar" in r.getMessage() for r in caplog.records) == 1


def test_several_rows_decode_without_speculation(moe_path, plain, caplog):
    m = strata_jax.load(moe_path, ctx=256, spec="lookup", parallel=2)
    with caplog.at_level(logging.WARNING, logger="strata_jax"):
        s = Session(m, 2)
    assert s.spec is None and any("one-row sessions only" in r.getMessage() for r in caplog.records)


def test_server_timings_report_drafts(moe_path, plain):
    from starlette.testclient import TestClient

    m = strata_jax.load(moe_path, ctx=256, spec="lookup")
    engine = Engine(lambda: m, warmup=False)
    with TestClient(create_app(engine, model_id="moe")) as client:
        assert engine.wait_ready(60)
        body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N, "temperature": 0}).json()
        metrics = client.get("/metrics.json").json()
    assert body["choices"][0]["text"] == plain.text
    t = body["timings"]
    assert t["draft_n"] >= t["draft_n_accepted"] > 0
    # /metrics counts them (a Prometheus counter's sample is its _total)
    value = lambda f: metrics[f]["samples"][0]["value"]  # noqa: E731
    assert (value("strata_draft_tokens"), value("strata_draft_accepted_tokens")) == (t["draft_n"], t["draft_n_accepted"])
    assert value("strata_draft_acceptance_ratio") == pytest.approx(t["draft_n_accepted"] / t["draft_n"])
    assert value("strata_verify_passes") == t["draft_passes"] > 0
    assert value("strata_tokens_per_verify_pass") == pytest.approx((t["draft_n_accepted"] + t["draft_passes"])
                                                                   / t["draft_passes"])


# -- sampling: the target distribution ----------------------------------------------------------------------

def chi2_pvalue(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty: a normal in the cube root, close enough
    for a 1e-3 threshold at df >= 3, with no scipy)."""
    v = 2 / (9 * df)
    return 0.5 * math.erfc(((stat / df) ** (1 / 3) - (1 - v)) / math.sqrt(v) / math.sqrt(2))


def goodness_of_fit(counts: dict, probs: dict) -> float:
    """p-value of observed counts against exact probabilities (categories expecting < 5 pooled)."""
    n = sum(counts.values())
    assert set(counts) <= set(probs), set(counts) - set(probs)  # a sequence the target never gives
    small = [c for c in probs if probs[c] * n < 5]
    o = [counts.get(c, 0) for c in probs if c not in small] + [sum(counts.get(c, 0) for c in small)]
    e = [probs[c] * n for c in probs if c not in small] + [sum(probs[c] for c in small) * n]
    o, e = (o, e) if e[-1] else (o[:-1], e[:-1])
    return chi2_pvalue(sum((a - b) ** 2 / b for a, b in zip(o, e)), len(e) - 1)


def two_sample(a: collections.Counter, b: collections.Counter) -> float:
    """p-value that two samples of categories come from one distribution (categories seen < 10 times pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    cats = [c for c in set(a) | set(b) if a[c] + b[c] >= 10]
    rest = (na - sum(a[c] for c in cats), nb - sum(b[c] for c in cats))
    pairs = [(a[c], b[c]) for c in cats] + ([rest] if sum(rest) else [])
    k1, k2 = math.sqrt(nb / na), math.sqrt(na / nb)
    return chi2_pvalue(sum((x * k1 - y * k2) ** 2 / (x + y) for x, y in pairs), len(pairs) - 1)


# positions 0, 1, 2 of a verify pass over V = 6 tokens; drafts d1 = 1 (after position 0) and d2 = 0
LOGITS_TV = np.array([[1.2, 1.0, 0.6, 0.1, -0.5, -2.0],
                      [0.3, 1.1, -0.2, 0.9, 0.0, -1.0],
                      [0.5, -0.4, 1.3, 0.2, 0.8, -0.1]], np.float32)
DRAFTS = (1, 0)
TRIALS = 20000


def target_sequences(temperature: float, top_k: int) -> dict:
    """The exact distribution of a pass's emitted tokens: x_j ~ p_j (softmax of the top_k logits /
    temperature) while every earlier x equals its draft."""
    p = []
    for row in LOGITS_TV:
        keep = row >= np.sort(row)[-top_k]
        z = np.where(keep, np.exp((row - row.max()) / temperature), 0.0)
        p.append(z / z.sum())
    probs, prefix, mass = {}, (), 1.0
    for j, p_j in enumerate(p):
        d = DRAFTS[j] if j < len(DRAFTS) else None
        for t in np.flatnonzero(p_j):
            if t != d:
                probs[prefix + (int(t),)] = mass * p_j[t]
        if d is None:
            break
        prefix, mass = prefix + (d,), mass * p_j[d]
    return probs, p


def test_acceptance_rule_keeps_the_target_distribution():
    temperature, top_k = 0.7, 4  # the processed distribution, not the raw softmax, is the target
    probs, p = target_sequences(temperature, top_k)
    V = LOGITS_TV.shape[1]
    sp = SamplingParams.make(1, temperature=temperature, top_p=1.0, top_k=top_k, min_p=0.0)
    pen = PenaltyState(jnp.zeros((1, V), jnp.int32), jnp.full((1, REPEAT_WINDOW), -1, jnp.int32))
    mode = SamplingMode(sample=True, penalties=False, logprobs=False)

    @jax.jit
    def passes(seeds):
        def one(seed):
            key = jax.random.key_data(jax.random.PRNGKey(seed))
            tok_T, n_acc, _, _ = accept_drafts(jnp.asarray(LOGITS_TV), jnp.asarray(DRAFTS), 2, key, 0, 3, sp, pen, mode)
            return tok_T, n_acc
        return jax.vmap(one)(seeds)

    tok_NT, n_acc_N = map(np.asarray, passes(jnp.arange(TRIALS)))
    emitted = collections.Counter(tuple(t[: a + 1].tolist()) for t, a in zip(tok_NT, n_acc_N))
    assert goodness_of_fit(emitted, probs) > 1e-3
    assert abs(n_acc_N.mean() - p[0][1] * (1 + p[1][0])) < 0.02  # acceptance: p0(d1) (1 + p1(d2))
    assert np.array_equal(np.asarray(passes(jnp.arange(4))[0]), tok_NT[:4])  # a seed gives its tokens again

    # the test has power: rules that are subtly wrong fail it with these trials
    rng = np.random.default_rng(0)

    def biased(resample_from_p: bool):
        out = collections.Counter()
        for _ in range(TRIALS):
            seq = ()
            for j, p_j in enumerate(p):
                d = DRAFTS[j] if j < len(DRAFTS) else None
                if d is not None and (not resample_from_p or rng.random() < p_j[d]):
                    seq += (d,)  # always accepting, or accepting with probability p(d) ...
                    continue
                seq += (int(rng.choice(len(p_j), p=p_j)),)  # ... then drawing from p, not the residual
                break
            out[seq] += 1
        return out

    for rule in (False, True):
        counts = biased(rule)
        assert goodness_of_fit({c: n for c, n in counts.items() if c in probs}, probs) < 1e-3


@pytest.fixture(scope="module")
def spec_model(moe_path):
    return strata_jax.load(moe_path, ctx=256, spec="lookup")


@pytest.fixture(scope="module")
def plain_model(moe_path):
    return strata_jax.load(moe_path, ctx=256)


def looping(m, plain) -> list[int]:
    """The prompt followed by its greedy continuation, which loops: lookup drafts from the first step."""
    return m.tokenize(PROMPT) + plain.token_ids


SAMPLED = dict(temperature=1.0, top_k=3)  # few tokens per step: the drafts are often drawn, and few categories


def test_sampled_spec_matches_plain_decode_distribution(spec_model, plain_model, plain):
    ids, n = looping(spec_model, plain), 600
    on, off, drafted, accepted = collections.Counter(), collections.Counter(), 0, 0
    for seed in range(n):  # independent samples: spec on and off take different seeds
        a = spec_model.generate(ids, max_tokens=3, seed=seed, **SAMPLED)
        on[tuple(a.token_ids)] += 1
        drafted, accepted = drafted + a.timings["draft_n"], accepted + a.timings["draft_n_accepted"]
        off[tuple(plain_model.generate(ids, max_tokens=3, seed=n + seed, **SAMPLED).token_ids)] += 1
    assert drafted > accepted > 50, (drafted, accepted)
    assert two_sample(on, off) > 1e-3, (on.most_common(10), off.most_common(10))


def test_sampled_spec_same_seed_gives_plain_decode_tokens(spec_model, plain_model, plain):
    """Each token is drawn with the key and step plain decode uses, penalties and logprobs included."""
    ids = looping(spec_model, plain)
    kw = dict(max_tokens=16, presence_penalty=-1.0, repeat_penalty=0.9, logprobs=True, top_logprobs=2, **SAMPLED)
    accepted = 0
    for seed in range(4):
        a, b = spec_model.generate(ids, seed=seed, **kw), spec_model.generate(ids, seed=seed, **kw)
        ref = plain_model.generate(ids, seed=seed, **kw)
        assert a.token_ids == b.token_ids == ref.token_ids
        np.testing.assert_allclose([lp.logprob for lp in a.logprobs], [lp.logprob for lp in ref.logprobs], atol=1e-4)
        assert [[t for t, _ in lp.top] for lp in a.logprobs] == [[t for t, _ in lp.top] for lp in ref.logprobs]
        accepted += a.timings["draft_n_accepted"]
    assert accepted > 0


# -- options and refusals -------------------------------------------------------------------------------

def test_bad_spec_options_are_refused():
    with pytest.raises(ConfigError, match=r"spec='ngram' is invalid: it must be 'lookup' .* or 'draft:PATH'"):
        EngineConfig(spec="ngram")
    with pytest.raises(ConfigError, match=r"--spec-max 0 is invalid"):
        EngineConfig.create(flags=True, spec="lookup", spec_max="0")
    assert EngineConfig.create(flags=True, spec="lookup", spec_max="6").spec_max == 6


@pytest.mark.parametrize("slots", [None, 40])
def test_hybrid_spec_rewinds_recurrent_state(slots):
    """qtiny (the seed's architecture: gated DeltaNet, QSA, PLE): a verify pass advances every recurrent
    state over all its drafts; hybrid.rewind stops each recurrent part after the accepted tokens, from its
    state before the pass and what the pass taped. Greedy tokens equal plain decode's, resident and
    offloaded, with drafts both accepted and rejected; afterwards the row's recurrent state and its cached
    K/V equal plain decode's (to rounding: a pass computes several positions at once). Without the rewind
    the state would hold rejected drafts (the check below fails, and the tokens drift)."""
    path = synthetic_model_path("qtiny")
    spec, base = (strata_jax.load(path, ctx=256, spec=sp, expert_slots=slots) for sp in ("lookup", None))
    # 120 tokens: qtiny's random weights fall into repeats late (66 drafts, 8 accepted)
    outs = [m.generate(PROMPT, max_tokens=120, temperature=0) for m in (spec, base)]
    assert outs[0].token_ids == outs[1].token_ids
    t = outs[0].timings
    assert t["draft_n"] > t["draft_n_accepted"] > 0, t
    n = len(spec.session().cached_tokens(0))
    assert n == len(base.session().cached_tokens(0)) > 120
    kv_s, kv_b = spec.session()._kv, base.session()._kv
    assert kv_s.rec is not None
    for a, b in zip(jax.tree.leaves(kv_s.rec), jax.tree.leaves(kv_b.rec)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves((kv_s.k_LBSKDh, kv_s.v_LBSKDh)), jax.tree.leaves((kv_b.k_LBSKDh, kv_b.v_LBSKDh))):
        np.testing.assert_allclose(np.asarray(a)[:, :, :n], np.asarray(b)[:, :, :n], rtol=1e-4, atol=1e-4)


def test_hybrid_pass_that_keeps_every_draft_needs_no_rewind(monkeypatch):
    """qtiny with an always-right oracle: every pass keeps all it fed, so the verify program takes the pass's
    own recurrent state (lax.cond) instead of hybrid.rewind's; tokens, state and cached K/V stay
    plain decode's. The rewind is counted by tracing: the cond traces both branches once per program."""
    from strata_jax.engine import programs

    path = synthetic_model_path("qtiny")
    spec, base = (strata_jax.load(path, ctx=256) for _ in range(2))
    ids = spec.tokenize(PROMPT)
    ref = base.generate(ids, max_tokens=24, temperature=0)
    spec.use_drafter(OracleDrafter(ref.token_ids, len(ids), 1.0, spec.config.vocab_size, seed=1, force=False),
                     spec_max=3)
    out = spec.generate(ids, max_tokens=24, temperature=0)
    assert out.token_ids == ref.token_ids
    assert out.timings["draft_n_accepted"] == out.timings["draft_n"] > 0
    kv_s, kv_b = spec.session()._kv, base.session()._kv
    for a, b in zip(jax.tree.leaves(kv_s.rec), jax.tree.leaves(kv_b.rec)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    # the kept branch is the pass's own state: with the rewind made to return garbage, nothing changes
    monkeypatch.setattr(programs, "rewind", lambda cfg, before, *a, **k: jax.tree.map(jnp.zeros_like, before))
    programs.verify.clear_cache()
    again = spec.generate(ids, max_tokens=24, temperature=0)
    assert again.token_ids == ref.token_ids


def test_draft_model_drafts_and_greedy_stays_plain_decode(moe_path, plain, tmp_path):
    """spec "draft:PATH": a second GGUF with the same vocabulary drafts greedily. The model as its own draft
    proposes its own greedy tokens, so nearly every draft is accepted and a pass emits several tokens; a
    dense model of another shape (same vocabulary) drafts worse but the tokens stay plain decode's."""
    m = strata_jax.load(moe_path, ctx=256, spec=f"draft:{moe_path}")
    out = m.generate(PROMPT, max_tokens=N, temperature=0)
    assert out.token_ids == plain.token_ids
    t = out.timings
    assert t["draft_n_accepted"] >= 0.9 * t["draft_n"] > 0, t
    assert m.host_timing()["decode_calls"] < N // 2
    dense = write_synthetic_gguf(tmp_path / "dense.gguf", SyntheticSpec(arch="qwen2", n_layers=1, d_model=64,
                                                                        head_dim=16, ffn_dim=64, vocab_size=512,
                                                                        qtype="Q8_0", seed=9))
    other = strata_jax.load(moe_path, ctx=256, spec=f"draft:{dense}").generate(PROMPT, max_tokens=N, temperature=0)
    assert other.token_ids == plain.token_ids and other.timings["draft_n"] > 0


def test_draft_model_with_another_vocabulary_is_refused(moe_path, tmp_path):
    other = write_synthetic_gguf(tmp_path / "v.gguf", SyntheticSpec(arch="qwen2", n_layers=1, d_model=64, head_dim=16,
                                                                    ffn_dim=64, vocab_size=320, qtype="Q8_0"))
    with pytest.raises(ConfigError, match=r"its vocabulary differs from the model's \(320 tokens against 512"):
        strata_jax.load(moe_path, ctx=256, spec=f"draft:{other}")
    with pytest.raises(ConfigError, match=r"the draft model '/no/such.gguf' is not a file"):
        EngineConfig(spec="draft:/no/such.gguf")


def test_cli_generate_spec(moe_path, plain, capsys):
    rc = main(["generate", "--model", str(moe_path), "--prompt", PROMPT, "-n", str(N), "-t", "0", "--ctx", "256",
               "--spec", "lookup", "--spec-max", "3"])
    out = capsys.readouterr()
    assert rc == 0 and out.out == plain.text + "\n"
    assert "drafts: " in out.err and " accepted" in out.err and "drafts: 0/" not in out.err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(moe_path), "--prompt", "x", "--spec", "medusa"])
    assert "invalid choice: 'medusa'" in capsys.readouterr().err


# -- the real default model ---------------------------------------------------------------------------------

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
EDIT = [{"role": "user", "content": "Rewrite this function with `subtotal` renamed to `net`. Reply with the code "
                                    "only.\n\n```python\n" + CODE + "```"}]


@pytest.mark.slow
def test_default_model_code_edit_accepts_drafts(qwen_gguf_path):
    plain_m = strata_jax.load(qwen_gguf_path, ctx=512)
    spec_m = strata_jax.load(qwen_gguf_path, ctx=512, spec="lookup")
    runs = {}
    for name, m in (("plain", plain_m), ("spec", spec_m)):
        m.generate(EDIT, max_tokens=6, temperature=0)  # compile the programs this request needs
        t0 = time.perf_counter()
        runs[name] = (m.generate(EDIT, max_tokens=48, temperature=0), time.perf_counter() - t0)
    (a, ta), (b, tb) = runs["plain"], runs["spec"]
    assert b.token_ids == a.token_ids
    assert b.timings["draft_n_accepted"] > 10, b.timings
    logging.getLogger("strata_jax").warning(
        "spec lookup on the default model: %d tokens, plain %.1f tok/s, spec %.1f tok/s, %d/%d drafts accepted",
        len(a.token_ids), len(a.token_ids) / ta, len(b.token_ids) / tb, b.timings["draft_n_accepted"],
        b.timings["draft_n"])
