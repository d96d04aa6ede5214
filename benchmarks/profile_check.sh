#!/usr/bin/env bash
# One `device` call (~6 min; carry .whl): (1) a 16-layer qtiny scanned with the decode program's loops
# unrolled inside the CUDA graph (STRATA_JAX_XLA_DECODE): does every loop convert, and what is the host
# time per step? (2) where a qseed-shaped decode step's GPU time goes, by named scope (scope_profile.py),
# by the RUNS below; B30 8 layers resident beside them. Results to $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pcheck}
mkdir -p "$OUT"
PY=${PY:-python3}
if [ -z "${NO_WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export STRATA_JAX_CACHE=/tmp/sjk PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 200 "$PY" - > "$OUT/qtiny-unroll.txt" 2>&1 <<'PY'
import dataclasses, json, os, subprocess, sys
from strata_jax.bench.shapes import SHAPES
from strata_jax.dev.synthetic import write_synthetic_gguf
path = write_synthetic_gguf("/tmp/pcheck-q16.gguf", dataclasses.replace(SHAPES["qtiny"], n_layers=16))
for label, extra in (("unroll", {"STRATA_JAX_XLA_DECODE": "--xla_gpu_command_buffer_unroll_loops=true"}), ("plain", {})):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_conversion_pass=2",
               STRATA_JAX_COMPILATION_CACHE="0", **extra)
    out = f"{os.environ['OUT']}/qtiny-{label}.json"
    log = subprocess.run([sys.executable, "-m", "strata_jax.cli", "bench", "--model", path, "--tokens", "64",
                          "--prompt-len", "16", "--routing", "realistic", "--cache-fraction", "0.5", "--no-resident",
                          "--out", out], env=env, capture_output=True, text=True)
    lines = [l.split("] ", 1)[-1] for l in log.stderr.splitlines() if "not convertible" in l or "Unsupported thunk" in l]
    print(label, "rc", log.returncode, "conversion:", sorted(set(lines))[:20])
    if log.returncode:
        print(log.stderr[-3000:])
    else:
        r = json.load(open(out))["rows"][0]
        print({k: r.get(k) for k in ("decode_tok_s", "host_dispatch_ms_per_step", "host_wait_ms_per_step", "hit_rate",
                                     "expert_fetch", "fetch_us_per_expert", "layer_scan")}, flush=True)
PY
# RUNS: one scope_profile.py run per line, "ENV=... --args" (default: qseed 8 layers resident and with half
# the experts cached, with the IQ3_S experts through the dequantize path (auto) and the fused kernel (on))
RUNS=${RUNS:-"STRATA_JAX_QMATVEC= --shape qseed --layers 8
STRATA_JAX_QMATVEC=1 --shape qseed --layers 8
STRATA_JAX_QMATVEC=1 --shape qseed --layers 8 --slots-fraction 0.5
STRATA_JAX_QMATVEC= --shape b30 --layers 8"}
while read -r envs args; do
  [ -n "$envs" ] || continue
  echo "== $envs $args" >> "$OUT/scope.txt"
  env "$envs" TAG="${envs#*=}" timeout 300 "$PY" benchmarks/scope_profile.py $args >> "$OUT/scope.txt" 2>&1
  rm -rf "$OUT/scope-dump"
done <<< "$RUNS"
rm -f /tmp/*-8L.gguf
