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
    if len(sys.argv) > 2:  # a slow store: the first step compiles against its shapes while it loads
        import time
        import strata_jax.offload.manager as manager
        load_store = manager.load_expert_store
        manager.load_expert_store = lambda *a: (time.sleep(float(sys.argv[2])), load_store(*a))[1]
        m = strata_jax.load(write_synthetic_gguf(sys.argv[1], spec), ctx=256, expert_slots=8)
        assert m.experts.loading
    else:
        m = strata_jax.load(write_synthetic_gguf(sys.argv[1], spec), ctx=256, expert_slots=8).wait_loaded()
    print("TEXT " + json.dumps(m.generate("hello there", max_tokens=8, temperature=0).text))
    print("COUNTS " + json.dumps({k.rsplit("/", 1)[1]: v for k, v in counts.items() if "compilation_cache" in k}))
""")


def _run(tmp_path, *args, **env):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([sys.executable, "-c", RUN, str(tmp_path / "moe.gguf"), *args], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "STRATA_JAX_CACHE": str(tmp_path / "cache"),
                                           "JAX_PLATFORMS": "cpu", **env})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = {x.split(" ", 1)[0]: json.loads(x.split(" ", 1)[1]) for x in out.stdout.splitlines() if " " in x}
    return lines["COUNTS"], out.stderr, lines["TEXT"]


def test_a_restart_compiles_nothing_it_compiled_before(tmp_path):
    first, log, _ = _run(tmp_path)
    assert first.get("cache_misses", 0) > 0 and first.get("cache_hits", 0) == 0
    assert f"compiled programs are kept in {tmp_path / 'cache' / 'xla'}" in log
    # the first request's decode program compiled on a thread beside its prefill's; its call found it made
    assert "compiling the decode program beside (" in log and "compiled the decode program beside (" in log
    assert "compiled the decode program (" not in log and "compiled the prefill program (" in log
    second, _, _ = _run(tmp_path)
    assert second.get("cache_misses", 0) == 0 and second["cache_hits"] == first["cache_misses"]
    off, log, _ = _run(tmp_path, STRATA_JAX_COMPILATION_CACHE="0")
    assert not off.get("cache_hits") and "compiled programs are kept" not in log


def test_the_first_step_compiles_while_the_store_loads(tmp_path):
    """An offloading model's load returns before its expert store is in; the first step compiles against
    the store's shapes meanwhile, then runs from the program it put in the cache, with the same tokens."""
    _, _, text = _run(tmp_path / "now")
    counts, log, slow = _run(tmp_path / "slow", "8")
    assert slow == text
    assert counts.get("cache_hits", 0) >= 2  # the prefill and decode calls found their programs compiled ahead
    for program in ("decode", "prefill"):  # the decode call the prompt leads to compiles ahead too
        compiled = log.index(f"compiled the {program} program")
        assert log.index("experts loaded", compiled) < log.index(f"read from the compilation cache the {program} program")
