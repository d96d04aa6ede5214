"""Run llama.cpp's convert_hf_to_gguf.py on a tiny qwen4exp checkpoint, without editing the converter.

    python qwen4exp_convert.py CONVERTER_DIR --pre NAME HF_DIR --outfile OUT --outtype f32

Two things differ from a real checkpoint, and are put right around the converter:
- the tiny vocabulary (the Qwen2 tokenizer cut to its first pieces) has a pre-tokenizer hash the
  converter does not list, though its pre-tokenizer is Qwen2's: `--pre` names it;
- transformers' config loader renames the "full_attention" layer types of a real config.json to
  "indexed_attention", which the converter then writes as compress ratio 0 (QSA off); the names are
  put back after it loads the config, as a real checkpoint's config.json has them.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    converter_dir, argv = argv[0], argv[1:]
    pre = None
    if "--pre" in argv:
        i = argv.index("--pre")
        pre, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    sys.path.insert(0, converter_dir)
    import conversion.base as base

    if pre is not None:
        base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    load = base.ModelBase.load_hparams

    def load_hparams(dir_model, is_mistral_format):
        config = load(dir_model, is_mistral_format)
        for c in (config, config.get("text_config") or {}):
            if "layer_types" in c:
                c["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in c["layer_types"]]
        return config

    base.ModelBase.load_hparams = staticmethod(load_hparams)
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    import convert_hf_to_gguf

    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(sys.argv[1:])
