"""GGUFTokenizer against transformers' own GGUF tokenizer: same ids, lossless decode, streaming, chat
templates. Real-model tests skip unless STRATA_TEST_QWEN_GGUF / STRATA_TEST_GEMMA_GGUF name the files."""

import datetime
import json
import time
from pathlib import Path

import numpy as np
import pytest

from strata_jax.core.errors import ConfigError, StrataError
from strata_jax.gguf import tokenizer as tkz
from strata_jax.gguf.reader import GGUFFile
from strata_jax.gguf.tokenizer import GGUFTokenizer

CORPUS = [
    "",
    " ",
    "\n",
    "The quick brown fox jumps over the lazy dog. It wasn't me, she'd said; they'll see.",
    "I'm can't won't they'd we'll you've She's IT'S O'Neil's",
    "def f(x):\n\tif x:\n\t    return x ** 2  # tab then spaces\n        \n    return None\n",
    "function add(a, b) {\n  return a + b;\n}\n\tconst x = [1, 2, 3].map((v) => v * 2);\r\n",
    "我爱自然语言处理。日本語のテキストも。한국어 문장입니다.",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs, 🤖🦜🪿🫎 rare ones",
    "a  b   c\n\n\nd\r\ne\t\tf   \n  ",
    "   leading spaces and trailing   ",
    "3.14159 1234567890 1,000,000 0x1F -42 1e-9 ２０２４",
    "Café naïve résumé Ångström façade Zoë crème brûlée e\u0301 Ünïcödé",
    "Ωμέγα Русский текст عربى हिन्दी ไทย",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHello<end_of_turn>\n<bos>text <eos>",
    "nbsp\u00a0em\u2003zw\u200bspace \x00\x01\x7f control",
    "==================== .... !!!??? ---",
    "<table><tr><td>cell</td></tr></table> <s>struck</s>",
]


# qwen_gguf_path comes from conftest.py (the verified cached default model).
@pytest.fixture(scope="module", params=["qwen", "gemma"])
def pair(request):
    """(ours, transformers' tokenizer for the same file, build seconds)."""
    path = request.getfixturevalue(f"{request.param}_gguf_path")
    transformers = pytest.importorskip("transformers")
    metadata = GGUFFile(path).metadata
    start = time.perf_counter()
    ours = GGUFTokenizer.from_metadata(metadata)
    seconds = time.perf_counter() - start
    # tokenizer_type (the config's model_type) skips transformers' 20 s read of the model config; the
    # tokenizer is built from the GGUF exactly as without it.
    ref = transformers.AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name,
                                                     tokenizer_type=metadata["general.architecture"])
    return ours, ref, seconds


@pytest.fixture(scope="module")
def qwen(qwen_gguf_path):
    return GGUFTokenizer.from_metadata(GGUFFile(qwen_gguf_path).metadata)


@pytest.fixture(scope="module")
def gemma(gemma_gguf_path):
    return GGUFTokenizer.from_metadata(GGUFFile(gemma_gguf_path).metadata)


def test_ids_match_transformers(pair):
    ours, ref, _ = pair
    for text in CORPUS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text, add_special=False) == ref.encode(text, add_special_tokens=False), text
    assert ours.encode_batch(CORPUS) == [ref.encode(t) for t in CORPUS]


def test_special_tokens_as_plain_text_match_transformers(pair):
    """parse_special=False (llama.cpp's /tokenize option) spells special tokens out as text, as transformers'
    split_special_tokens does; the default makes them their ids."""
    ours, ref, _ = pair
    text = "a <|im_start|>b<|im_end|> <start_of_turn>c<eos> d"
    assert ours.encode(text, add_special=False) == ref(text, add_special_tokens=False).input_ids
    plain = ours.encode(text, add_special=False, parse_special=False)
    assert plain == ref(text, add_special_tokens=False, split_special_tokens=True).input_ids
    assert len(plain) > len(ours.encode(text, add_special=False))


def test_pieces_join_to_the_text(pair):
    ours, _, _ = pair
    for text in CORPUS:
        ids = ours.encode(text, add_special=False)
        assert b"".join(ours.piece(i) for i in ids) == text.encode(), text
    assert ours.piece(-1) == ours.piece(10 ** 9) == b""


def test_decode_round_trips(pair):
    ours, ref, _ = pair
    for text in CORPUS:
        ids = ours.encode(text, add_special=False)
        assert ours.decode(ids, skip_special=False) == text
        with_bos = ours.encode(text)
        assert ours.decode(with_bos) == ref.decode(with_bos, skip_special_tokens=True)
        assert ours.decode(np.asarray(with_bos)) == ours.decode(with_bos)


def test_stream_decoder_matches_decode(pair):
    ours, _, _ = pair
    for text in CORPUS:
        ids = ours.encode(text)
        for skip in (True, False):
            stream = ours.stream_decoder(skip_special=skip)
            chunks = [stream.push(i) for i in ids] + [stream.flush()]
            assert "".join(chunks) == ours.decode(ids, skip_special=skip), text
            assert not any("\ufffd" in c for c in chunks)


def test_stream_holds_back_split_emoji(pair):
    ours, _, _ = pair
    # An emoji the vocabulary lacks is spelled in byte tokens: nothing may come out until its last byte.
    text = next(t for t in ("🪿", "🫎", "🦜", "𓂀") if len(ours.encode(t, add_special=False)) > 1)
    ids = ours.encode(text, add_special=False)
    stream = ours.stream_decoder()
    chunks = [stream.push(i) for i in ids]
    assert chunks[:-1] == [""] * (len(ids) - 1) and chunks[-1] == text
    assert stream.flush() == ""


def test_build_time(pair):
    ours, _, seconds = pair
    limit = 2.0 if ours.vocab_size < 200_000 else 8.0  # Gemma's 262k vocabulary derives 515k merges
    assert seconds < limit, f"{ours!r} took {seconds:.2f} s to build"


CONVERSATIONS = [
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi! Zürich ☀️?"}], None),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
      {"role": "user", "content": "And 3+3?"}], None),
    ([{"role": "user", "content": "Weather in Zürich?"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
      {"role": "tool", "content": "{\"temp_c\": 21}"}],
     [{"type": "function", "function": {
         "name": "get_weather", "description": "Current weather for a city, e.g. «Zürich».",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]),
]


@pytest.mark.parametrize("messages,tools", CONVERSATIONS)
def test_chat_template_matches_transformers(pair, messages, tools):
    ours, ref, _ = pair
    if ours.chat_template is None:
        pytest.skip("this GGUF carries no chat template")
    for gen in (True, False):
        expected = ref.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen, tools=tools) == expected


def test_qwen_special_ids(qwen):
    im_end, eot = qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>")
    assert {im_end, eot} <= qwen.stop_ids
    assert qwen.token_to_id("</s>") not in qwen.stop_ids  # ordinary text in this vocabulary
    assert qwen.eos_id == im_end and not qwen.add_bos and qwen.vocab_size == 151936
    assert qwen.encode("<|im_start|>") == [qwen.token_to_id("<|im_start|>")]


def test_gemma_special_ids(gemma):
    tok = gemma
    assert {tok.eos_id, tok.token_to_id("<end_of_turn>")} <= tok.stop_ids and tok.add_bos
    assert tok.token_to_id("</s>") not in tok.stop_ids  # a user-defined HTML tag here
    if tok.chat_template is None:
        with pytest.raises(ConfigError, match="raw prompt"):
            tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_llama_sentencepiece_matches_transformers(gemma_gguf_path):
    """The plain (non-Gemma) sentencepiece path: merges from scores, Metaspace prefix, decoder strip;
    checked on Gemma's vocabulary relabelled as a llama file against transformers' converter."""
    gguf = pytest.importorskip("transformers.integrations.gguf")
    arch, tokenizer_dict, _ = gguf.get_gguf_tokenizer(gemma_gguf_path)
    ref, _ = gguf.convert_gguf_tokenizer("llama", tokenizer_dict)
    metadata = dict(GGUFFile(gemma_gguf_path).metadata, **{"general.architecture": "llama",
                                                          "tokenizer.ggml.add_space_prefix": True})
    ours = GGUFTokenizer.from_metadata(metadata)
    for text in CORPUS:
        ids = ours.encode(text, add_special=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        # skip_special=False: transformers also marks LlamaTokenizer's default "<s>"/"</s>" special here
        assert ours.decode(ids, skip_special=False) == ref.decode(ids, skip_special_tokens=False), text
        stream = ours.stream_decoder()
        assert "".join([stream.push(i) for i in ids] + [stream.flush()]) == ours.decode(ids), text


# --- synthetic vocabularies: error paths and every pre-tokenizer, no model files needed -----------------

def toy_metadata(**overrides):
    """A byte-level vocabulary: the 256 byte symbols, a few merges, two control tokens (one stored as raw
    text outside the byte alphabet, as llama.cpp's converter writes DeepSeek's) and a user-defined one."""
    alphabet = list(tkz._bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r"]
    added = ["<|endoftext|>", "<｜end▁of▁sentence｜>", "<think>"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + added
    md = {
        "general.architecture": "qwen2",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array([1] * (len(tokens) - 3) + [3, 3, 4], np.int32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": len(tokens) - 3,
        "tokenizer.chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                                   "{% if add_generation_prompt %}<assistant>{% endif %}",
    }
    md.update(overrides)
    return md


def test_unsupported_tokenizer_model_is_clear():
    with pytest.raises(ConfigError, match=r"'rwkv'.*Supported: 'gpt2'"):
        GGUFTokenizer.from_metadata(toy_metadata(**{"tokenizer.ggml.model": "rwkv"}))


def test_unsupported_pre_tokenizer_lists_supported():
    with pytest.raises(ConfigError, match=r"'martian'.*qwen2"):
        GGUFTokenizer.from_metadata(toy_metadata(**{"tokenizer.ggml.pre": "martian"}))


def test_missing_tokenizer_is_a_strata_error():
    md = {k: v for k, v in toy_metadata().items() if k != "tokenizer.ggml.tokens"}
    with pytest.raises(StrataError, match="no tokenizer"):
        GGUFTokenizer.from_metadata(md)


@pytest.mark.parametrize("pre", sorted(tkz._PRE))
def test_every_pre_tokenizer_builds_and_round_trips(pre):
    tok = GGUFTokenizer.from_metadata(toy_metadata(**{"tokenizer.ggml.pre": pre}))
    for text in CORPUS + ["x<｜end▁of▁sentence｜><think>é"]:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special=False) == text, (pre, text)
        stream = tok.stream_decoder()
        assert "".join([stream.push(i) for i in ids] + [stream.flush()]) == tok.decode(ids), (pre, text)
    n = tok.vocab_size
    assert tok.encode("<|endoftext|><｜end▁of▁sentence｜><think>") == [n - 3, n - 2, n - 1]
    assert tok.decode([n - 3, n - 2, n - 1]) == "<think>"  # control tokens skipped, user-defined kept
    assert tok.eos_id in tok.stop_ids and n - 2 in tok.stop_ids


def test_chat_template_helpers_and_errors():
    template = ("{{ bos_token }}|{{ strftime_now('%Y') }}|{{ x | tojson }}|{{ x | tojson(indent=2) }}|"
                "{{ x | tojson(separators=(',', ':')) }}")
    tok = GGUFTokenizer.from_metadata(toy_metadata(**{"tokenizer.ggml.bos_token_id": 0,
                                                      "tokenizer.chat_template": template}))
    x = {"city": "Zürich", "<tag>": [1, 2]}
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}], x=x)
    assert out == "|".join(["!", str(datetime.datetime.now().year), json.dumps(x, ensure_ascii=False),
                            json.dumps(x, ensure_ascii=False, indent=2),
                            json.dumps(x, ensure_ascii=False, separators=(",", ":"))])

    plain = GGUFTokenizer.from_metadata(toy_metadata())
    assert plain.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi\n<assistant>"
    with pytest.raises(ConfigError, match="empty conversation"):
        plain.apply_chat_template([])
    no_template = {k: v for k, v in toy_metadata().items() if k != "tokenizer.chat_template"}
    with pytest.raises(ConfigError, match="raw prompt"):
        GGUFTokenizer.from_metadata(no_template).apply_chat_template([{"role": "user", "content": "hi"}])
    raising = GGUFTokenizer.from_metadata(toy_metadata(
        **{"tokenizer.chat_template": "{{ raise_exception('only user/assistant roles') }}"}))
    with pytest.raises(ConfigError, match="only user/assistant roles"):
        raising.apply_chat_template([{"role": "user", "content": "hi"}])
    broken = GGUFTokenizer.from_metadata(toy_metadata(**{"tokenizer.chat_template": "{% for m in messages %}"}))
    with pytest.raises(ConfigError, match="does not parse"):
        broken.apply_chat_template([{"role": "user", "content": "hi"}])



# -- fill in the middle -------------------------------------------------------------------------------------

def _infill(tok, ctx=8192, **kw):
    """Model.infill_tokens over a tokenizer alone (it reads only the tokenizer and the context)."""
    from types import SimpleNamespace

    from strata_jax.engine.model import Model
    return Model.infill_tokens(SimpleNamespace(tokenizer=tok, ctx=ctx), **kw)


def test_infill_layout_is_llama_cpps(qwen):
    """Qwen2.5-Coder names no FIM tokens in its GGUF: they are found by spelling, as llama.cpp does, and the
    prompt is llama.cpp's /infill layout (tools/server/README.md): the repository pattern, then
    [PRE]prefix[SUF]suffix[MID], the code tokenized with special tokens as plain text."""
    assert qwen.fim_ids == {"pre": 151659, "suf": 151661, "mid": 151660, "rep": 151663, "sep": 151664}
    text = lambda s: qwen.encode(s, add_special=False, parse_special=False)  # noqa: E731
    pre, suf = "def f(x):\n    return <|im_end|>", "\n\nprint(f(2))\n"
    got = _infill(qwen, prefix=pre, suffix=suf, extra=[{"filename": "util.py", "text": "X = 1\n"}], prompt="x")
    assert got == ([151663, *text("myproject\n"), 151664, *text("util.py\n"), *text("X = 1\n"), 151664,
                    *text("filename\n"), 151659, *text(pre), *text("x"), 151661, *text(suf), 151660])
    assert qwen.token_to_id("<|im_end|>") not in got  # code is text, whatever it spells


def test_infill_keeps_the_prefix_end_and_the_suffix_start(qwen):
    """A 3:1 window: the prefix's last 3/4 of FIM_WINDOW tokens next to the gap, the suffix's first quarter
    (less 2); a small context halves the window, and extra files fill what the context leaves."""
    from strata_jax.engine.model import FIM_WINDOW
    text = lambda s: qwen.encode(s, add_special=False, parse_special=False)  # noqa: E731
    pre, suf = "".join(f"a{i} = {i}\n" for i in range(2000)), "".join(f"b{i} = {i}\n" for i in range(2000))
    got = _infill(qwen, prefix=pre, suffix=suf)
    i_pre, i_suf, i_mid = got.index(151659), got.index(151661), got.index(151660)
    assert got[i_pre + 1:i_suf] == text(pre)[-(3 * FIM_WINDOW // 4):]
    assert got[i_suf + 1:i_mid] == text(suf)[:FIM_WINDOW // 4 - 2] and i_mid == len(got) - 1
    small = _infill(qwen, ctx=1024, prefix=pre, suffix=suf, n_predict=64)
    assert small.index(151661) - small.index(151659) - 1 == 3 * 512 // 4 and len(small) < 1024 - 64
    big = [{"filename": f"f{i}.py", "text": "y = 2\n" * 400} for i in range(8)]
    cut = _infill(qwen, ctx=4096, prefix="a", suffix="b", extra=big, n_predict=100)
    files = cut[:cut.index(151659)]  # the latest files' tokens, as many as 4096 - 2048 - 2 * 100 leaves
    assert len(files) == 4096 - 2048 - 200 and files[-1 - len(text("filename\n")):] == [151664, *text("filename\n")]
    open_ended = _infill(qwen, ctx=4096, prefix=pre, suffix=suf, extra=big)  # n_predict -1: still fits, with room
    assert len(open_ended) <= 4096 - 16 and len(open_ended[:open_ended.index(151659)]) == 4096 - 2048 - 32


def test_infill_without_fim_tokens_is_refused(gemma):
    with pytest.raises(ConfigError, match="no fill-in-the-middle tokens"):
        _infill(gemma, prefix="a", suffix="b")
