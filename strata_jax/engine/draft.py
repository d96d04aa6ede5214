"""Draft-model drafts for speculative decoding (EngineConfig.spec "draft:PATH"): a second, smaller GGUF
with the target's vocabulary proposes the next tokens greedily; the target verifies them in one pass.

The draft is a full strata-jax model of its own with a one-row session: each call hands it the whole
sequence, and its row keeps the longest prefix it already holds, so a call prefills only the tokens
accepted since the last one. Being greedy it is deterministic, which is what keeps the verify rule
lossless (engine/session.py). It loads before the target so that the target's memory planning sees
what the draft took.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from strata_jax.core.errors import ConfigError

log = logging.getLogger("strata_jax")

PREFIX = "draft:"


def draft_path(spec: str | None) -> str | None:
    """The draft model's path of a spec value ("draft:PATH"), None for the other drafters."""
    return spec[len(PREFIX):] if spec is not None and spec.startswith(PREFIX) else None


def check_spec(value: str, name: str) -> str:
    """A spec value: "lookup", "mtp", or "draft:PATH" naming an existing file."""
    path = draft_path(value)
    if value in ("lookup", "mtp") or path:
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{name}={value!r}: the draft model {path!r} is not a file. Give the path of a small "
                              "GGUF with the same vocabulary as the model, e.g. --spec draft:qwen2.5-0.5b.gguf.")
        return value
    raise ConfigError(f"{name}={value!r} is invalid: it must be 'lookup' (n-gram drafts from the prompt and output), "
                      "'mtp' (the model's own MTP block drafts) or 'draft:PATH' (a small GGUF model with the same "
                      "vocabulary drafts).")


class DraftModel:
    """`draft(seq, n_max)`: up to n_max tokens `model` (a loaded engine Model, one row) decodes greedily
    after seq."""

    def __init__(self, model: Any):
        self.model = model
        log.info("speculative decoding: draft model %s (%s, %d layers)", os.path.basename(model.gguf.path),
                 model.config.arch, model.config.n_layers)

    def __call__(self, seq: Sequence[int], n_max: int) -> list[int]:
        if n_max < 1 or len(seq) + n_max > self.model.ctx:
            return []
        return list(self.model.generate(list(seq), max_tokens=n_max, temperature=0).token_ids)
