"""Speculative decoding with prompt-lookup drafts (EngineConfig.spec="lookup"): greedy output identical to
plain decode on a synthetic MoE (offloaded and resident) and on the real default model, with drafts
accepted where the text repeats; the n-gram drafter and the adaptive switch; the fallbacks (sampling,
several rows) and refusals (hybrid models, bad values), checked before weights load."""

from __future__ import annotations

import logging
import time

import pytest

import strata_jax
from strata_jax.bench.shapes import synthetic_model_path
from strata_jax.cli import main
from strata_jax.core.errors import ConfigError
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.engine import lookup
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.lookup import Acceptance, lookup_draft
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


def test_sampling_falls_back_to_plain_decode(moe_path, caplog):
    m = strata_jax.load(moe_path, ctx=256, spec="lookup")
    ref = strata_jax.load(moe_path, ctx=256).generate(PROMPT, max_tokens=8, temperature=0.8, seed=3)
    with caplog.at_level(logging.INFO, logger="strata_jax"):
        out = m.generate(PROMPT, max_tokens=8, temperature=0.8, seed=3)
    assert out.token_ids == ref.token_ids and out.timings["draft_n"] == 0
    assert sum("decodes without speculation" in r.getMessage() for r in caplog.records) == 1


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
    assert body["choices"][0]["text"] == plain.text
    t = body["timings"]
    assert t["draft_n"] >= t["draft_n_accepted"] > 0


# -- options and refusals -------------------------------------------------------------------------------

def test_bad_spec_options_are_refused():
    with pytest.raises(ConfigError, match=r"spec='ngram' is invalid: it must be 'lookup'"):
        EngineConfig(spec="ngram")
    with pytest.raises(ConfigError, match=r"--spec-max 0 is invalid"):
        EngineConfig.create(flags=True, spec="lookup", spec_max="0")
    assert EngineConfig.create(flags=True, spec="lookup", spec_max="6").spec_max == 6


def test_hybrid_model_is_refused_before_weights_load(monkeypatch):
    import strata_jax.engine.model as engine_model

    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the option was checked")

    monkeypatch.setattr(engine_model, "load_params", no_weights)
    with pytest.raises(ConfigError, match=r"spec='lookup' \(--spec\) is not supported for qwen4exp"):
        strata_jax.load(synthetic_model_path("qtiny"), ctx=64, spec="lookup")


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
