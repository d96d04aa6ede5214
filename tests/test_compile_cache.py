"""The persistent compilation cache (EngineConfig.compilation_cache, on by default): a second process on
the same machine loading the same model and running the same request compiles nothing, every program
coming from the cache under STRATA_JAX_CACHE/xla (JAX's own cache-hit and cache-miss events); the
location is logged; STRATA_JAX_COMPILATION_CACHE=0 turns it off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

RUN = textwrap.dedent("""
    import collections, json, logging, sys
    from jax import monitoring
    counts = collections.Counter()
    monitoring.register_event_listener(lambda name, **kw: counts.update([name]))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import strata_jax
    from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
    spec = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=128, head_dim=32, expert_ffn_dim=64, ffn_dim=128,
                         vocab_size=512, qtype="Q8_0", seed=5)
    m = strata_jax.load(write_synthetic_gguf(sys.argv[1], spec), ctx=256, expert_slots=8)
    m.generate("hello there", max_tokens=8, temperature=0)
    print("COUNTS " + json.dumps({k.rsplit("/", 1)[1]: v for k, v in counts.items() if "compilation_cache" in k}))
""")


def _run(tmp_path, **env):
    out = subprocess.run([sys.executable, "-c", RUN, str(tmp_path / "moe.gguf")], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "STRATA_JAX_CACHE": str(tmp_path / "cache"),
                                           "JAX_PLATFORMS": "cpu", **env})
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("COUNTS "))
    return json.loads(line[len("COUNTS "):]), out.stderr


def test_a_restart_compiles_nothing_it_compiled_before(tmp_path):
    first, log = _run(tmp_path)
    assert first.get("cache_misses", 0) > 0 and first.get("cache_hits", 0) == 0
    assert f"compiled programs are kept in {tmp_path / 'cache' / 'xla'}" in log
    second, _ = _run(tmp_path)
    assert second.get("cache_misses", 0) == 0 and second["cache_hits"] == first["cache_misses"]
    off, log = _run(tmp_path, STRATA_JAX_COMPILATION_CACHE="0")
    assert not off.get("cache_hits") and "compiled programs are kept" not in log
