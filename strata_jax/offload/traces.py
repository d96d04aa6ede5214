"""Routing trace files: what `strata-jax trace record` writes and every trace reader takes.

A trace is int32 [T, L, k]: for each token processed (a prompt's tokens, then the generated ones), each
MoE layer, the routed expert ids (-1 padding). The file is an .npz with two members:
- `trace`: that array;
- `meta`: a JSON document as uint8 bytes: {"format": FORMAT, "model": file name, "fingerprint": the
  model file's (gguf/reader.py), "experts": experts per layer, "prompts": [{"name", "start", "prefill",
  "decode"}, ...]}: each prompt's rows are trace[start : start + prefill + decode].
`read_trace` also takes the shared JSON traces (offload/simulate.py load_trace: granite, Mixtral).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from strata_jax.core.errors import ConfigError
from strata_jax.offload.simulate import load_trace

FORMAT = "strata-jax routing trace 1"


def save_trace(path, trace_TLk: np.ndarray, *, model: str, fingerprint: str, experts: int,
               prompts: list[dict]) -> Path:
    path = Path(path)
    meta = {"format": FORMAT, "model": model, "fingerprint": fingerprint, "experts": int(experts), "prompts": prompts}
    with open(path, "wb") as f:  # a file object: numpy would add .npz to a name without it
        np.savez_compressed(f, trace=np.asarray(trace_TLk, np.int32),
                            meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    return path


def read_trace(path, prompt: str | None = None) -> tuple[np.ndarray, dict]:
    """(int32 [T, L, k], meta) of a trace file, all prompts or the one named `prompt`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no trace file at {path}: give a file from `strata-jax trace record` (.npz) or a "
                          "shared JSON trace.")
    if path.suffix == ".json":
        try:
            return load_trace(path, prompt), {"format": "shared JSON", "model": path.parent.name}
        except (KeyError, ValueError) as e:
            raise ConfigError(f"{path} is not a readable JSON routing trace: {e}") from None
    try:
        with np.load(path) as z:
            trace, meta = z["trace"], json.loads(z["meta"].tobytes())
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{path} is not a routing trace file (.npz with `trace` and `meta`): {e}") from None
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} is a trace of format {meta.get('format')!r}; this version reads {FORMAT!r}.")
    if prompt is not None:
        names = [p["name"] for p in meta["prompts"]]
        if prompt not in names:
            raise ConfigError(f"prompt {prompt!r} is not in {path}; it has {', '.join(names)}")
        p = meta["prompts"][names.index(prompt)]
        trace = trace[p["start"]: p["start"] + p["prefill"] + p["decode"]]
    return trace, meta
