#!/usr/bin/env bash
# A short GPU check of core/hostrows.py (one `device` call, ~3 min; carry .whl): (1) the fetch kernel
# against the loop of copies and the resident run on tests/test_offload.py's model, unrolled per-layer
# pools (PART=7's failing case: is the difference the kernel's, or bfloat16 programs differing?);
# (2) a 16-layer qtiny scanned with the kernels, decode host time and the command-buffer conversion log
# (do the loops convert now that LayerRef.pick is no dynamic slice?); (3) its decode HLO's dynamic-slice
# fusions, named with their JAX source (dsf.txt). Results to $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kcheck}
source benchmarks/check_env.sh
timeout 150 "$PY" - > "$OUT/exact.txt" 2>&1 <<'PY'
import sys
sys.path.insert(0, "tests")
import numpy as np, strata_jax
from strata_jax.dev.synthetic import write_synthetic_gguf
from test_offload import SPEC, PROMPT
path = write_synthetic_gguf("/tmp/kcheck-moe.gguf", SPEC)
ref = strata_jax.load(path, ctx=128)
ids = ref.tokenize(PROMPT)
want, want_tok = ref.logits(ids), ref.generate(ids, max_tokens=24, temperature=0).token_ids
for scan in ("off", "on"):
    for fetch in ("loop", "kernel"):
        m = strata_jax.load(path, ctx=128, expert_slots=12, expert_pools="per-layer", layer_scan=scan, expert_fetch=fetch)
        got = m.logits(ids)
        bad = np.nonzero(np.any(got != want, axis=1))[0]
        tok = m.generate(ids, max_tokens=24, temperature=0).token_ids
        print(f"scan {scan} fetch {fetch}: logits rows differing {bad.tolist()} max |d| {np.abs(got - want).max():.3g}; "
              f"tokens equal {tok == want_tok}; misses {m.stats()['misses']}", flush=True)
PY
timeout 200 "$PY" - > "$OUT/qtiny.txt" 2>&1 <<'PY'
import dataclasses, json, os, subprocess, sys
from strata_jax.bench.shapes import SHAPES
from strata_jax.dev.synthetic import write_synthetic_gguf
path = write_synthetic_gguf("/tmp/kcheck-q16.gguf", dataclasses.replace(SHAPES["qtiny"], n_layers=16))
env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_conversion_pass=2",
           STRATA_JAX_COMPILATION_CACHE="0")
for fetch in ("kernel", "loop"):
    out = f"{os.environ['OUT']}/qtiny-{fetch}.json"
    log = subprocess.run([sys.executable, "-m", "strata_jax.cli", "bench", "--model", path, "--tokens", "64",
                          "--prompt-len", "16", "--routing", "realistic", "--cache-fraction", "0.5", "--no-resident",
                          "--expert-fetch", fetch, "--out", out], env=env, capture_output=True, text=True)
    lines = [l.split("] ", 1)[-1] for l in log.stderr.splitlines() if "not convertible" in l or "Unsupported thunk" in l]
    print(fetch, "rc", log.returncode, "conversion:", sorted(set(lines))[:20])
    if log.returncode:
        print(log.stderr[-3000:])
    else:
        r = json.load(open(out))["rows"][0]
        print({k: r.get(k) for k in ("decode_tok_s", "host_dispatch_ms_per_step", "host_wait_ms_per_step", "hit_rate",
                                     "expert_fetch", "fetch_us_per_expert", "layer_scan")}, flush=True)
PY
# (3) the qtiny-16 decode's optimized HLO: every dynamic-slice fusion XLA made (DynamicSliceFusionV2 thunks)
# with its fused computation's ops and their JAX source (op_name metadata): what keeps the scan out
if [ -z "${SKIP_DUMP:-}" ]; then
  rm -rf /tmp/kcheck-dump
  timeout 150 env XLA_FLAGS="--xla_dump_to=/tmp/kcheck-dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*" \
    STRATA_JAX_COMPILATION_CACHE=0 "$PY" -m strata_jax.cli bench --model /tmp/kcheck-q16.gguf --tokens 16 \
    --prompt-len 16 --routing realistic --cache-fraction 0.5 --no-resident --out "$OUT/qtiny-dump.json" \
    > "$OUT/dump.log" 2>&1
  "$PY" benchmarks/dsf_report.py /tmp/kcheck-dump > "$OUT/dsf.txt" 2>&1
fi
cat "$OUT/exact.txt" "$OUT/qtiny.txt"; head -c 6000 "$OUT/dsf.txt" 2>/dev/null
