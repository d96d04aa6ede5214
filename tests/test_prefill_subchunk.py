"""Layer-major prefill (Kernels.prefill_subchunk, STRATA_JAX_PREFILL_SUBCHUNK): each block runs a long chunk as
sub-chunks in turn, its MoE layer's experts streamed once for all of them. It must give what the plain chunk
gives: the same logits at every position and the same greedy tokens, for a hybrid model (qwen4exp: DeltaNet,
gated attention with QSA, PLE, hyper-connections) and a plain MoE, resident and offloaded, and a prompt that
ends inside a sub-chunk."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import strata_jax
from strata_jax.bench.shapes import SHAPES
from strata_jax.dev.synthetic import write_synthetic_gguf
from strata_jax.model import forward as fw


@pytest.fixture(scope="module", params=["qtiny", "tiny"])
def model_path(request, tmp_path_factory):
    return request.param, write_synthetic_gguf(tmp_path_factory.mktemp("sub") / f"{request.param}.gguf",
                                               SHAPES[request.param])


@pytest.mark.parametrize("offloaded", [False, True])
def test_layer_major_prefill_is_the_chunks(model_path, offloaded, monkeypatch):
    name, path = model_path
    spec = SHAPES[name]
    kw = {"expert_slots": spec.n_layers * spec.n_experts // 2} if offloaded else {}
    ids = list(range(5, 5 + 57))  # one 64-token chunk, 57 real: the last sub-chunk is partly padding
    served = []
    real = fw._LayerRows.__init__
    monkeypatch.setattr(fw._LayerRows, "__init__", lambda self, rows: served.append(1) or real(self, rows))
    out = {}
    for sub in ("0", "16"):
        monkeypatch.setenv("STRATA_JAX_PREFILL_SUBCHUNK", sub)
        jax.clear_caches()
        m = strata_jax.load(path, ctx=128, prefill_chunk=64, **kw)
        assert m.kernels.prefill_subchunk == int(sub)
        n = len(served)
        out[sub] = (m.logits(ids), m.generate(ids, max_tokens=4, temperature=0, cache_prompt=False).token_ids,
                    m.stats().get("prefill_streamed_experts"))
        assert (len(served) > n) == (sub == "16")  # the MoE steps were served from the streamed layer
    jax.clear_caches()
    np.testing.assert_allclose(out["16"][0], out["0"][0], rtol=0, atol=1e-4 * np.abs(out["0"][0]).max())
    assert out["16"][1] == out["0"][1]
    assert out["16"][2] == out["0"][2]  # each layer's experts streamed once per chunk either way


def test_subchunk_must_be_a_count(monkeypatch):
    from strata_jax.core.errors import ConfigError
    from strata_jax.engine.config import EngineConfig

    monkeypatch.setenv("STRATA_JAX_PREFILL_SUBCHUNK", "half")
    with pytest.raises(ConfigError, match="STRATA_JAX_PREFILL_SUBCHUNK='half'"):
        EngineConfig.create()
    with pytest.raises(ValueError, match="prefill_subchunk"):
        dataclasses.replace(fw.Kernels(), prefill_subchunk=-1)
