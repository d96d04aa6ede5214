"""Tokenizer and chat template built from a GGUF file's own metadata (no hub, no tokenizer.json).

The vocabulary, merges and token types under `tokenizer.ggml.*` become a HF `tokenizers` BPE model,
shaped the way transformers' GGUF loader shapes it (ids match it exactly), with llama.cpp's choices
where transformers has none: which pre-tokenizer names exist, which tokens end generation.

    tok = GGUFTokenizer.from_metadata(GGUFFile(path).metadata)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from strata_jax.core.errors import ConfigError, GGUFFormatError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# --- pre-tokenizer splits for byte-level ("gpt2") vocabularies ---------------------------------------
# Names and split sequences follow llama.cpp (llama-vocab.cpp), using the original tokenizer.json regex
# where llama.cpp quotes one next to its engine-specific rewrite; ignore_merges and the add_bos default
# too. "default" follows transformers (ByteLevel's GPT-2 regex); llama.cpp splits it more finely.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2_LIKE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SEED_CODER = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
_BAILING = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)"
            r"|\s+")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"

# name -> (regex splits applied in order, ByteLevel applies its GPT-2 regex too, ignore_merges, add_bos default)
_PRE: dict[str, tuple[tuple[str, ...], bool, bool, bool]] = {}


def _pre(names: str, splits: tuple[str, ...], gpt2_regex=False, ignore_merges=False, add_bos=False):
    for name in names.split():
        _PRE[name] = (splits, gpt2_regex, ignore_merges, add_bos)


_pre("default gpt-2 phi-2 mpt olmo jais trillion granite-docling exaone4 gigachat a.x-4.0 mellum modern-bert "
     "jina-es jina-de jina-v2-es jina-v2-de jina-v1-en jina-v2-code roberta-bpe", (), gpt2_regex=True)
_pre("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", (r"\p{N}",), gpt2_regex=True)
_pre("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", (_LLAMA3,),
     ignore_merges=True, add_bos=True)
_pre("dbrx smaug-bpe chatglm-bpe", (_LLAMA3,))
_pre("glm4 glm5", (_LLAMA3,), ignore_merges=True)
_pre("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2", (_QWEN2,))
_pre("qwen35", (_QWEN35,))
_pre("tekken", (_TEKKEN,), ignore_merges=True, add_bos=True)
_pre("gpt-4o llama4 kanana2 talkie minimax-m2", (_GPT4O,))
_pre("deepseek-v3 hunyuan-dense joyai-llm hy_v4", _DEEPSEEK3)
_pre("deepseek-coder", ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"))
_pre("falcon", (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_LIKE, "[0-9][0-9][0-9]"))
_pre("poro-chat bloom gpt3-finnish", (_BLOOM,))
_pre("viking", (_BLOOM, r"\p{N}"))
_pre("seed-coder", (_SEED_CODER,))
_pre("bailingmoe bailingmoe2 llada-moe", (_BAILING,))
_pre("ufakzeka", (_QWEN2[len(_CONTRACTIONS) + 1:],))
_pre("minicpm5", (r"\p{N}{1,3}", _QWEN2.replace(r"|\p{N}|", r"|\p{N}+|")), ignore_merges=True)
_pre("laguna", (r"[^\n]+|[\n]+", _QWEN2))

TOKENIZER_MODELS = ("gpt2", "llama", "gemma4")
SENTENCEPIECE_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")  # transformers' Gemma rules for "llama" vocabularies

# Token texts llama.cpp treats as end-of-generation (llama-vocab.cpp, special_eog_ids); see _stop_ids.
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))
# Fill-in-the-middle padding/repo/file separators also stop generation in llama.cpp.
_FIM_EOG = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_FIM_TEXTS = frozenset(t for texts in _FIM_EOG.values() for t in texts)


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of byte-level vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


@lru_cache(maxsize=1)
def _outside_byte_alphabet() -> re.Pattern:
    return re.compile("[^" + re.escape("".join(_bytes_to_unicode().values())) + "]")


def _merges_from_scores(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a sentencepiece vocabulary, identical to transformers' `generate_merges`: every
    split of every token into two tokens, best score first, then longer left piece, longer right piece,
    ties in vocabulary order."""
    pairs: list[tuple[str, str]] = []
    order: list[float] = []
    for token, score in scores.items():
        if len(token) > 1:
            found = [(token[:i], token[i:]) for i in range(1, len(token))
                     if token[:i] in vocab and token[i:] in vocab]
            if found:
                pairs += found
                order += [score] * len(found)
    if not pairs:
        return []
    len_l = np.fromiter((len(a) for a, _ in pairs), np.int64, len(pairs))
    len_r = np.fromiter((len(b) for _, b in pairs), np.int64, len(pairs))
    rank = np.lexsort((-len_r, -len_l, -np.asarray(order, np.float64)))  # stable, like sorted(reverse=True)
    return [pairs[i] for i in rank.tolist()]


def _get(md: Mapping[str, Any], key: str, default: Any = None) -> Any:
    return md.get(f"tokenizer.ggml.{key}", default)


def _token_id(md: Mapping[str, Any], key: str, n: int, default: int | None = None) -> int | None:
    v = _get(md, key)
    if v is None or not 0 <= int(v) < n:
        return default if default is not None and 0 <= default < n else None
    return int(v)


# fill-in-the-middle tokens by role: the GGUF's tokenizer.ggml.fim_*_token_id, else the first token spelled as
# one of these (llama.cpp's llama-vocab.cpp, which finds Qwen2.5-Coder's this way: its GGUF names none)
FIM_SPELLINGS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
            "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
            "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
            "<|middle|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}


def _fim_ids(md: Mapping[str, Any], tokens: list[str]) -> dict[str, int]:
    """The vocabulary's fill-in-the-middle tokens by role (pre, suf, mid, rep, sep), those it has."""
    index = {t: i for i, t in reversed(list(enumerate(tokens)))}  # the first of duplicates
    out = {}
    for role, spellings in FIM_SPELLINGS.items():
        i = _token_id(md, f"fim_{role}_token_id", len(tokens))
        if i is None:
            i = next((index[t] for t in spellings if t in index), None)
        if i is not None:
            out[role] = i
    return out


class StreamDecoder:
    """Incremental detokenization: `push(id)` returns the text that became printable, holding back an
    incomplete UTF-8 sequence (an emoji split across byte tokens) until its last byte arrives."""

    def __init__(self, pieces: list[bytes], skip: frozenset[int], strip_first_space: bool):
        self._pieces, self._skip = pieces, skip
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = strip_first_space  # the Strip decoder drops one leading space of the whole text

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id in self._skip or not 0 <= token_id < len(self._pieces):
            return ""  # ids past the vocabulary decode to nothing, as in decode()
        return self._emit(self._utf8.decode(self._pieces[token_id]))

    def flush(self) -> str:
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if self._strip and text:
            self._strip = False
            text = text[1:] if text[0] == " " else text
        return text


class GGUFTokenizer:
    """Encode/decode and chat-template rendering for one GGUF vocabulary. Build with `from_metadata`."""

    def __init__(self, tokenizer: Tokenizer, *, tokens: list[str], model: str, pre: str | None,
                 bos_id: int | None, eos_id: int | None, pad_id: int | None, unk_id: int | None,
                 mask_id: int | None, stop_ids: frozenset[int], add_bos: bool, add_eos: bool,
                 special_ids: frozenset[int], id_to_key: dict[int, str], strip_first_space: bool,
                 chat_template: str | None, named_templates: dict[str, str], fim_ids: dict[str, int] | None = None):
        self._tok = tokenizer
        self.tokens = tokens  # the vocabulary as the file spells it
        self.model, self.pre = model, pre
        self.vocab_size = len(tokens)
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = bos_id, eos_id, pad_id, unk_id
        self.mask_id = mask_id
        self.stop_ids = stop_ids
        self.add_bos, self.add_eos = add_bos, add_eos
        self.special_ids = special_ids  # dropped by decode(skip_special=True)
        self._id_to_key = id_to_key
        self._strip_first_space = strip_first_space
        self._pieces: list[bytes] | None = None
        self._plain_tok: Tokenizer | None = None
        self.chat_template = chat_template
        self.named_templates = named_templates
        self.fim_ids = fim_ids or {}  # fill-in-the-middle tokens by role: pre, suf, mid, rep, sep (those it has)
        self._compiled: dict[str, Any] = {}

    # --- construction ---------------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> GGUFTokenizer:
        md = metadata
        model = _get(md, "model")
        tokens = _get(md, "tokens")
        if model is None or tokens is None:
            raise GGUFFormatError(
                "the GGUF has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens are missing); "
                "this file cannot be used for text generation without one."
            )
        if model not in TOKENIZER_MODELS:
            raise ConfigError(
                f"tokenizer.ggml.model {model!r} is not supported. Supported: 'gpt2' (byte-level BPE), "
                "'llama' (SentencePiece BPE with byte fallback), 'gemma4'."
            )
        tokens = list(tokens)
        n = len(tokens)
        types = np.asarray(_get(md, "token_type", np.full(n, NORMAL)), dtype=np.int64)
        if len(types) != n:
            raise GGUFFormatError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens.")
        arch = str(md.get("general.architecture", ""))
        pre = _get(md, "pre")
        spm = model != "gpt2"
        # llama.cpp's defaults for sentencepiece files that name no special tokens
        bos_id = _token_id(md, "bos_token_id", n, 1 if model == "llama" else None)
        eos_id = _token_id(md, "eos_token_id", n, 2 if model == "llama" else None)
        unk_id = _token_id(md, "unknown_token_id", n, 0 if model == "llama" else None)
        pad_id = _token_id(md, "padding_token_id", n)
        mask_id = _token_id(md, "mask_token_id", n)

        if spm:
            tok, keys, add_prefix, add_bos_default = cls._build_sentencepiece(md, model, arch, tokens, unk_id)
            strip_first = add_prefix
            pre = None
        else:
            pre = pre or "default"
            if pre not in _PRE:
                raise ConfigError(
                    f"tokenizer.ggml.pre {pre!r} (pre-tokenizer of this byte-level vocabulary) is not supported. "
                    f"Supported: {', '.join(sorted(_PRE))}."
                )
            tok, keys, add_bos_default = cls._build_byte_level(md, tokens, types, pre)
            strip_first = False

        special_ids, id_to_key = cls._add_special_tokens(tok, tokens, types, keys,
                                                         named=(bos_id, eos_id, unk_id, pad_id))
        add_bos = bool(_get(md, "add_bos_token", add_bos_default))
        if model == "gemma4":  # its chat template writes <bos>; transformers adds none (llama.cpp#21500)
            add_bos = False
        add_eos = bool(_get(md, "add_eos_token", False))
        if add_bos and bos_id is None:
            add_bos = False
        templates = {k[len("tokenizer.chat_template."):]: v for k, v in md.items()
                     if k.startswith("tokenizer.chat_template.") and isinstance(v, str)}
        return cls(tok, tokens=tokens, model=model, pre=pre, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
                   unk_id=unk_id, mask_id=mask_id, stop_ids=_stop_ids(md, tokens, types, eos_id),
                   add_bos=add_bos, add_eos=add_eos, special_ids=special_ids, id_to_key=id_to_key,
                   strip_first_space=strip_first, chat_template=md.get("tokenizer.chat_template"),
                   named_templates=templates, fim_ids=_fim_ids(md, tokens))

    @staticmethod
    def _build_byte_level(md, tokens: list[str], types: np.ndarray, pre: str):
        spell, outside = _bytes_to_unicode(), _outside_byte_alphabet()
        # llama.cpp's converter stores added tokens (control, user-defined) as raw text, e.g. DeepSeek's
        # "<｜end▁of▁sentence｜>": they keep that spelling and become added tokens below. Any other token
        # written outside the byte alphabet is respelled from its UTF-8 bytes, as transformers does.
        raw = (types == CONTROL) | (types == USER_DEFINED) | (types == UNKNOWN)
        keys = [t if raw[i] or not outside.search(t) else "".join(spell[b] for b in t.encode("utf-8"))
                for i, t in enumerate(tokens)]
        vocab = {k: i for i, k in enumerate(keys)}
        merges = _get(md, "merges")
        if merges is None:
            raise GGUFFormatError("byte-level vocabulary without tokenizer.ggml.merges; the GGUF is incomplete.")
        splits, gpt2_regex, ignore_merges, add_bos = _PRE[pre]
        tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], dropout=None,
                                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                   byte_fallback=False, ignore_merges=ignore_merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_regex)]
        )
        tok.decoder = decoders.ByteLevel()
        return tok, keys, add_bos

    @staticmethod
    def _build_sentencepiece(md, model: str, arch: str, tokens: list[str], unk_id: int | None):
        """Sentencepiece BPE with byte fallback, as transformers' GGUF loader builds it (LlamaTokenizer,
        GemmaTokenizer, or Phi-3's variant, chosen by architecture)."""
        gemma = model == "llama" and arch in SENTENCEPIECE_GEMMA_ARCHS
        keys = tokens
        if gemma:
            # Gemma stores its multi-space tokens as real spaces, but looks them up as "▁▁".
            keys = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {k: i for i, k in enumerate(keys)}
        merges = _get(md, "merges")
        if merges is not None:
            merges = [tuple(m.split(" ", 1)) for m in merges]
        elif gemma:  # Gemma's scores do not follow its merge order; its token order does
            merges = _merges_from_scores(vocab, {k: -i for i, k in enumerate(keys)})
        else:
            scores = _get(md, "scores")
            if scores is None:
                raise GGUFFormatError("sentencepiece vocabulary without merges or scores; the GGUF is incomplete.")
            merges = _merges_from_scores(vocab, dict(zip(keys, np.asarray(scores, np.float64).tolist())))
        unk = keys[unk_id] if unk_id is not None else None
        tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None))
        add_prefix = False
        if gemma or model == "gemma4":
            tok.normalizer = normalizers.Replace(" ", "▁")
        elif arch == "phi3":  # the prefix space comes from a normalizer, so "  hi" keeps both spaces
            add_prefix = True
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        else:
            add_prefix = bool(_get(md, "add_space_prefix", True))
            tok.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
        return tok, keys, add_prefix, True

    @staticmethod
    def _add_special_tokens(tok: Tokenizer, tokens, types, keys, *, named):
        """Control and unknown tokens (and the named bos/eos/unk/pad) become special added tokens, matched
        whole in the text and dropped by decode(skip_special); user-defined ones become plain added tokens
        (matched whole, always decoded), as llama.cpp and transformers treat them."""
        special: dict[str, int] = {}
        marked = np.flatnonzero((types == CONTROL) | (types == UNKNOWN)).tolist()
        for i in marked + [i for i in named if i is not None]:
            special.setdefault(keys[i], i)
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
        known = set(keys).union(special)
        user = [tokens[i] for i in np.flatnonzero(types == USER_DEFINED).tolist()]
        user = [t for t in dict.fromkeys(user) if t in known and t not in special]
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
        id_to_key = {i: k for k, i in {k: i for i, k in enumerate(keys)}.items()}  # later duplicates win
        special_ids = frozenset(tok.token_to_id(t) for t in special)
        for t in special:
            id_to_key[tok.token_to_id(t)] = t
        return special_ids, id_to_key

    # --- encode / decode ------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text ("<|im_start|>") become their ids, or, with
        parse_special=False, are tokenized as the plain text they are spelled with (llama.cpp's
        parse_special). `add_special` adds BOS (and EOS) when the file asks for them."""
        if not isinstance(text, str):
            raise ConfigError(f"encode() takes a str, got {type(text).__name__}.")
        ids = (self._tok if parse_special else self._plain()).encode(text, add_special_tokens=False).ids
        if add_special:
            if self.add_bos:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def _plain(self) -> Tokenizer:
        """A copy of the tokenizer that splits special tokens' text like any other (its own object: the
        switch is the tokenizer's state, and requests tokenize on several threads)."""
        if self._plain_tok is None:
            plain = Tokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain_tok = plain
        return self._plain_tok

    def encode_batch(self, texts: list[str], add_special: bool = True) -> list[list[int]]:
        out = [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]
        if add_special:
            pre = [self.bos_id] if self.add_bos else []
            post = [self.eos_id] if self.add_eos and self.eos_id is not None else []
            out = [pre + ids + post for ids in out]
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`; with `skip_special`, control tokens (BOS, <|im_end|>...) are left out.
        Ids past the vocabulary (padded embedding rows) decode to nothing."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        return self._tok.decode(ids[ids >= 0].tolist(), skip_special_tokens=skip_special)

    def stream_decoder(self, skip_special: bool = True, keep: Iterable[int] = ()) -> StreamDecoder:
        """keep: special ids whose text stays in the output anyway (llama.cpp's preserved tokens: the
        markers a tool-call parser reads)."""
        skip = self.special_ids.difference(keep) if skip_special else frozenset()
        return StreamDecoder(self._piece_bytes(), skip, self._strip_first_space)

    def _piece_bytes(self) -> list[bytes]:
        """The bytes each id contributes to decoded text, mirroring the tokenizer's decoder."""
        if self._pieces is None:
            pieces = [b""] * max(self.vocab_size, max(self._id_to_key, default=-1) + 1)
            if self.model == "gpt2":
                inv = _unicode_to_bytes()
                for i, k in self._id_to_key.items():
                    try:
                        pieces[i] = bytes(inv[c] for c in k)
                    except KeyError:  # not byte-alphabet text (an added token): its own UTF-8
                        pieces[i] = k.encode("utf-8")
            else:
                byte_token = re.compile(r"<0x([0-9A-Fa-f]{2})>")
                for i, k in self._id_to_key.items():
                    m = byte_token.fullmatch(k)
                    pieces[i] = bytes([int(m.group(1), 16)]) if m else k.replace("▁", " ").encode("utf-8")
            self._pieces = pieces
        return self._pieces

    def piece(self, token_id: int) -> bytes:
        """The bytes token_id contributes to decoded text, special tokens spelled out (b"" past the
        vocabulary): llama.cpp's token piece."""
        pieces = self._piece_bytes()
        return pieces[token_id] if 0 <= token_id < len(pieces) else b""

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._id_to_key.get(int(token_id))

    # --- chat template --------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None, **template_kwargs) -> str:
        """Render the GGUF's chat template the way transformers' `apply_chat_template(tokenize=False)` does."""
        template = self.chat_template
        if tools and "tool_use" in self.named_templates:
            template = self.named_templates["tool_use"]
        if template is None:
            raise ConfigError(
                "this GGUF has no chat template (tokenizer.chat_template is missing); pass a raw prompt "
                "instead of chat messages, or supply a template."
            )
        if not messages:
            raise ConfigError("cannot apply a chat template to an empty conversation; pass at least one message.")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ConfigError("tools must be JSON-schema dicts ({'type': 'function', 'function': {...}}).")
        chat = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise ConfigError(f"chat messages must be dicts with 'role' and 'content', got {m!r}.")
            m = {k: v for k, v in _plain(m).items() if v is not None}
            reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
            if reasoning is not None:  # templates read one of several names for it
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            chat.append(m)
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.unk_id,
                 "pad_token": self.pad_id, "mask_token": self.mask_id}
        context = {k: self.tokens[i] for k, i in names.items() if i is not None}
        context.update(_plain(template_kwargs))
        documents = context.pop("documents", None)
        jinja2 = _jinja()
        try:
            if template not in self._compiled:
                self._compiled[template] = _compile(template)
            return self._compiled[template].render(messages=chat, tools=_plain(tools), documents=documents,
                                                   add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"the GGUF's chat template does not parse (line {e.lineno}): {e.message}. "
                              "Pass a raw prompt instead.") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            # raise_exception() from the template, or messages shaped unlike what it expects
            raise ConfigError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None

    def __repr__(self) -> str:
        return (f"GGUFTokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_id}, eos={self.eos_id}, stop={sorted(self.stop_ids)})")


def _stop_ids(md, tokens: list[str], types: np.ndarray, eos_id: int | None) -> frozenset[int]:
    """End-of-generation ids, following llama.cpp: eos/eot/eom, FIM pad/repo/sep, and tokens with a
    known end-of-turn text."""
    n = len(tokens)
    named = (eos_id, _token_id(md, "eot_token_id", n), _token_id(md, "eom_token_id", n))
    ids = {i for i in named if i is not None}
    # Only tokens the file marks non-normal, and "</s>" only as a control token: it is the HTML
    # strikethrough tag in Qwen's (normal) and Gemma's (user-defined) vocabularies, not an end of turn.
    by_text: dict[str, int] = {}
    for i in np.flatnonzero(types != NORMAL).tolist():
        t = tokens[i]
        if (t in _EOG_TEXTS or t in _FIM_TEXTS) and (t != "</s>" or types[i] == CONTROL):
            by_text.setdefault(t, i)
    for key, texts in _FIM_EOG.items():
        fid = _token_id(md, f"{key}_token_id", n)
        ids.update([fid] if fid is not None else [by_text[t] for t in texts if t in by_text])
    ids.update(i for t, i in by_text.items() if t in _EOG_TEXTS)
    texts = {tokens[i] for i in ids}
    has_call = bool(texts & {"<|call|>", "<|calls|>"})
    if "<|end|>" in texts and has_call and texts & {"<|return|>", "<|flush|>"}:
        ids.discard(by_text["<|end|>"])  # gpt-oss / solar-open: "<|end|>" ends a message, not the generation
    if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:
        ids.discard(by_text["</s>"])  # gemma4 / plamo: "</s>" is ordinary text
    return frozenset(ids)


def _plain(value: Any) -> Any:
    """A copy of template input built from plain JSON types, so the sandbox only sees data."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, np.generic):
        return value.item()
    for base in (str, bool, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=1)
def _jinja():
    import jinja2
    import jinja2.ext
    import jinja2.sandbox
    return jinja2


def _compile(template: str):
    """The template compiled in transformers' environment: sandboxed, trim/lstrip blocks, its tojson,
    raise_exception, strftime_now, and `{% generation %}` blocks rendered as plain text."""
    jinja2 = _jinja()

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
