"""Session with several rows (continuous batching): each request decoded in a batch gives exactly what Model.generate
gives it alone (greedy and seeded), whatever else is in the batch and whenever it was admitted; rows
keep their conversation's prefix for the next turn; decode compiles once; released rows are free."""

from __future__ import annotations

import pytest

import strata_jax
from conftest import count_compiles
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.core.errors import ConfigError
from strata_jax.engine.session import Session
from strata_jax.engine import programs

# 8 experts top-2: up to 4 rows take the few-token MoE path
MOE = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=128, head_dim=32, expert_ffn_dim=64, ffn_dim=128,
                    vocab_size=512, qtype="Q8_0", seed=5)
DENSE = SyntheticSpec(arch="qwen2", n_layers=2, d_model=128, head_dim=32, ffn_dim=128, vocab_size=512, qtype="Q8_0")
PROMPTS = ["hello there", "the tea is hot and the rain is there, so she sat on the stairs to read a note",
           "a", "once upon a time"]
OPEN = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)  # the server's (OpenAI's) sampling defaults


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("batch") / "moe.gguf", MOE)
    # half the experts cached: misses and fetches happen; 16-token prefill chunks: the long prompt takes several
    # one shared pool of 8 slots: three rows' 6 experts per layer fit it
    return strata_jax.load(path, ctx=256, expert_slots=8, prefill_chunk=16, expert_pools="shared")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return strata_jax.load(write_synthetic_gguf(tmp_path_factory.mktemp("batch") / "dense.gguf", DENSE), ctx=128)


def reference(model, prompt, **kw):
    return model.generate(prompt, cache_prompt=False, **kw)


def run(session, schedule):
    """schedule: [(step at which to admit, prompt, kwargs)]. Steps the session until every request is done;
    returns per request {"ids", "text", "finish", "timings", "row", "logprobs"}."""
    out = [{"ids": [], "text": "", "finish": None, "timings": None, "row": None, "logprobs": None} for _ in schedule]
    owner: dict[int, int] = {}

    def take(i, chunks):
        for c in chunks:
            out[i]["ids"] += c.token_ids
            out[i]["text"] += c.text
            if c.logprobs is not None:
                out[i]["logprobs"] = (out[i]["logprobs"] or []) + c.logprobs
            if c.finish_reason is not None:
                out[i]["finish"], out[i]["timings"] = c.finish_reason, c.timings
                owner.pop(out[i]["row"], None)

    step = 0
    todo = sorted(range(len(schedule)), key=lambda i: schedule[i][0])
    while todo or session.active_rows:
        while todo and schedule[todo[0]][0] <= step and session.free_rows:
            i = todo.pop(0)
            row, chunks = session.admit(schedule[i][1], **schedule[i][2])
            out[i]["row"], owner[row] = row, i
            take(i, chunks)
        for row, chunks in session.step().items():
            take(owner[row], chunks)
        step += 1
        assert step < 1000
    return out


def test_batched_greedy_equals_generate(moe):
    refs = [reference(moe, p, max_tokens=n, temperature=0) for p, n in zip(PROMPTS, (20, 12, 25, 6))]
    stop = refs[0].text[5:7]
    stopped = reference(moe, PROMPTS[0], max_tokens=20, temperature=0, stop=stop)
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 20
    s = Session(moe, 3)
    # admitted at different steps; more requests than rows, so the later ones wait for a row to free up
    schedule = [(0, PROMPTS[0], dict(max_tokens=20)), (2, PROMPTS[1], dict(max_tokens=12)),
                (2, PROMPTS[2], dict(max_tokens=25)), (5, PROMPTS[3], dict(max_tokens=6)),
                (7, PROMPTS[0], dict(max_tokens=20, stop=stop))]
    got = run(s, [(t, p, dict(kw, temperature=0, cache_prompt=False)) for t, p, kw in schedule])
    for g, ref in zip(got, [*refs, stopped]):
        assert (g["ids"], g["text"], g["finish"]) == (ref.token_ids, ref.text, ref.finish_reason)
        assert g["timings"]["prompt_n"] == len(ref.prompt_token_ids) and g["timings"]["cache_n"] == 0
        assert g["timings"]["predicted_n"] == len(ref.token_ids) and g["timings"]["prompt_ms"] > 0
    assert got[3]["row"] in (got[0]["row"], got[1]["row"], got[2]["row"])  # a freed row was reused
    assert s.free_rows == 3 and not s.active_rows


def test_seeded_sampling_reproduces_alone_or_batched(moe, dense):
    params = [dict(OPEN, seed=1), dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=2),
              dict(OPEN, seed=1), dict(OPEN, seed=3, temperature=1.5), dict(temperature=0)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[3], PROMPTS[2]]
    for model, rows in ((moe, 4), (dense, 3)):
        refs = [reference(model, p, max_tokens=16, **kw) for p, kw in zip(prompts, params)]
        got = run(Session(model, rows), [(i, p, dict(kw, max_tokens=16, cache_prompt=False))
                                              for i, (p, kw) in enumerate(zip(prompts, params))])
        assert [g["ids"] for g in got] == [r.token_ids for r in refs]
    assert refs[0].token_ids != reference(dense, prompts[0], max_tokens=16, **dict(OPEN, seed=4)).token_ids


def test_rows_with_penalties_and_logprobs_equal_single_requests(moe, dense):
    """Each row's penalties act on its own tokens only (a reused row starts afresh) and its logprobs are
    its own: every request equals its run alone, whatever its neighbours ask for."""
    params = [dict(temperature=0, presence_penalty=2.0, logprobs=True, top_logprobs=3), dict(temperature=0),
              dict(OPEN, seed=4, frequency_penalty=1.0, repeat_penalty=1.3, repeat_last_n=8),
              dict(temperature=0, repeat_penalty=2.0, repeat_last_n=3, logprobs=True),
              dict(OPEN, seed=5, presence_penalty=-1.0, logprobs=True, top_logprobs=20),
              dict(temperature=0, frequency_penalty=0.5)]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[2], PROMPTS[0]]
    for model, rows in ((moe, 3), (dense, 2)):
        refs = [reference(model, p, max_tokens=14, **kw) for p, kw in zip(prompts, params)]
        got = run(Session(model, rows), [(i, p, dict(kw, max_tokens=14, cache_prompt=False))
                                              for i, (p, kw) in enumerate(zip(prompts, params))])
        assert [g["ids"] for g in got] == [r.token_ids for r in refs]
        assert refs[0].token_ids != refs[1].token_ids  # the penalty acted
        for g, r in zip(got, refs):
            assert (g["logprobs"] is None) == (r.logprobs is None)
            for a, b in zip(g["logprobs"] or [], r.logprobs or []):
                assert (a.token_id, a.offset, [t for t, _ in a.top]) == (b.token_id, b.offset, [t for t, _ in b.top])
                assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
                assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
        assert len(got[4]["logprobs"][0].top) == 20 and got[3]["logprobs"][0].top == []


def test_rows_keep_each_conversation_prefix(moe):
    s = Session(moe, 3)
    a1, b1 = moe.tokenize("the rain is there and"), moe.tokenize("the rain is there but")
    ra, _ = s.admit(a1, max_tokens=8, temperature=0)
    while s.active_rows:
        s.step()
    rb, _ = s.admit(b1, max_tokens=8, temperature=0)
    assert ra != rb  # most of b's prompt is in a's row, but an unused row keeps a's conversation cached
    while s.active_rows:
        s.step()
    held_a, held_b = s.cached_tokens(ra), s.cached_tokens(rb)
    assert held_a[: len(a1)] == a1 and len(held_a) == len(a1) + 7  # prompt + every token fed back
    assert s.tokens_held() == len(held_a) + len(held_b)
    more = moe.tokenize(" then the tea", add_special=False)
    for conv, row, held in (("a", ra, held_a), ("b", rb, held_b)):  # each next turn goes to its own row,
        turn2 = held + more  # though the third row is the least recently used
        want = reference(moe, turn2, max_tokens=5, temperature=0)
        got = run(s, [(0, turn2, dict(max_tokens=5, temperature=0))])[0]
        assert got["row"] == row, conv
        assert got["timings"]["cache_n"] == len(held) and got["timings"]["prompt_n"] == len(more)
        assert got["ids"] == want.token_ids
    # a new conversation takes the unused row: it evicts nobody
    c = run(s, [(0, moe.tokenize("zzz yyy xxx"), dict(max_tokens=2, temperature=0))])[0]
    assert c["row"] not in (ra, rb) and c["timings"]["cache_n"] == 0
    # every row is taken now: a prompt sharing most (not all) of b's row still goes there, not to the LRU row
    held_b = s.cached_tokens(rb)
    b_alt = held_b[:-3] + moe.tokenize(" xyz", add_special=False)
    got = run(s, [(0, b_alt, dict(max_tokens=2, temperature=0))])[0]
    assert got["row"] == rb and got["timings"]["cache_n"] == len(held_b) - 3
    assert got["ids"] == reference(moe, b_alt, max_tokens=2, temperature=0).token_ids
    # one sharing little with every row takes the least recently used: a's (its second turn ran first)
    d = run(s, [(0, moe.tokenize("qqq"), dict(max_tokens=2, temperature=0))])[0]
    assert d["row"] == ra and d["timings"]["cache_n"] == 0
    # cache_prompt=False never reuses a prefix
    no_cache = run(s, [(0, s.cached_tokens(rb) + more, dict(max_tokens=2, cache_prompt=False))])[0]
    assert no_cache["timings"]["cache_n"] == 0 and no_cache["row"] == c["row"]


def test_release_frees_the_row(moe):
    s = Session(moe, 2)
    keep_ref = reference(moe, PROMPTS[1], max_tokens=10, temperature=0)
    r_long, _ = s.admit(PROMPTS[0], max_tokens=200, temperature=0)
    r_keep, first = s.admit(PROMPTS[1], max_tokens=10, temperature=0)
    ids = [t for c in first for t in c.token_ids]
    for _ in range(3):
        ids += [t for c in s.step().get(r_keep, []) for t in c.token_ids]
    assert s.generated(r_long) == 4 and s.free_rows == 0
    with pytest.raises(ConfigError, match="busy"):
        s.admit(PROMPTS[2], max_tokens=2)
    assert s.release(r_long) == 4 and s.active_rows == [r_keep] and s.free_rows == 1
    assert len(s.cached_tokens(r_long)) == len(moe.tokenize(PROMPTS[0])) + 3  # written tokens stay reusable
    r_new, _ = s.admit(PROMPTS[3], max_tokens=3, temperature=0)
    assert r_new == r_long
    while r_keep in s.active_rows:
        ids += [t for c in s.step().get(r_keep, []) for t in c.token_ids]
    assert ids == keep_ref.token_ids  # the neighbours' churn did not disturb it


def test_decode_compiles_once(moe):
    s = Session(moe, 3)
    # the decode call is compiled once per SamplingMode of the rows it serves (the union): warm those used
    run(s, [(0, "warm up", dict(max_tokens=3, temperature=0)), (1, "and again", dict(max_tokens=2, seed=1)),
            (2, "warm", dict(max_tokens=3, presence_penalty=0.5, logprobs=True, seed=2))])
    jit_entries = programs.decode._cache_size(), programs.prefill._cache_size()
    with count_compiles() as compiles:
        got = run(s, [(0, PROMPTS[0], dict(max_tokens=6, temperature=0.7, seed=5)),
                      (1, PROMPTS[2], dict(max_tokens=9, temperature=0)),
                      (3, PROMPTS[3], dict(max_tokens=4, top_k=5, seed=9)),
                      (8, PROMPTS[0] + " again", dict(max_tokens=5, temperature=0)),  # a cached prefix
                      (9, PROMPTS[1], dict(max_tokens=4, presence_penalty=1.0, logprobs=True, top_logprobs=5))])
        row, _ = s.admit("bye", max_tokens=50, repeat_penalty=1.2, logprobs=True)
        s.step()
        s.release(row)
    assert compiles == []
    # the persistent compilation cache can hide a recompile from the counter; the jit caches cannot
    assert (programs.decode._cache_size(), programs.prefill._cache_size()) == jit_entries
    assert got[3]["timings"]["cache_n"] > 0


def test_invalid_sessions_and_requests(moe):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="at least one row"):
            Session(moe, bad)
    s = Session(moe, 2)
    with pytest.raises(ConfigError, match="max_tokens"):
        s.admit("hi", max_tokens=0)
    with pytest.raises(ConfigError, match="temperature"):
        s.admit("hi", temperature=-1)
    with pytest.raises(ConfigError, match="exceed the context"):
        s.admit([1] * 300)
    assert s.free_rows == 2 and s.step() == {}


def test_pools_too_small_for_the_rows_is_a_clear_error(tmp_path):
    path = write_synthetic_gguf(tmp_path / "moe.gguf", MOE)
    m = strata_jax.load(path, ctx=64, expert_slots=8)  # a pool per layer: 4 slots each
    with pytest.raises(ConfigError, match="3 rows can route 6 distinct experts.*parallel=3"):
        Session(m, 3)
    m = strata_jax.load(path, ctx=64, expert_slots=12, parallel=3)  # 6 slots per layer
    Session(m, 3)
    with pytest.raises(ConfigError, match="at least 12"):
        strata_jax.load(path, ctx=64, expert_slots=8, parallel=3)
