#!/usr/bin/env bash
# One `device` call (~4 min; carry .whl): which reads of a scanned layer's slice keep qwen4exp's decode loop in
# XLA's command buffers. (1) benchmarks/slice_probe.py's small programs; (2) a 16-layer qwen4exp with qseed's
# attention dims, decoded by `bench` once per form (slice_probe.py bench ...): the conversion log's "not
# convertible" count, host ms per step, and the decode HLO's dynamic-slice fusions (dsf_report.py). To $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/slcheck}
source benchmarks/check_env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -z "${SKIP_PROBE:-}" ] && timeout 200 "$PY" benchmarks/slice_probe.py > "$OUT/probe.jsonl" 2>&1
"$PY" - <<'PY'
import dataclasses
from strata_jax.bench.shapes import SHAPES
from strata_jax.dev.synthetic import write_synthetic_gguf
write_synthetic_gguf("/tmp/slcheck-q16.gguf", dataclasses.replace(
    SHAPES["qtiny"], n_layers=16, n_heads=16, n_kv_heads=2, head_dim=256, rope_dim=64, rope_sections=(11, 11, 10), indexer_head_dim=128))
PY
for forms in ${FORMS:-kv:slice kv:slice+hc:shift kv:before+hc:shift kv:f32+hc:shift kv:gather+hc:shift}; do
  d=/tmp/slcheck-dump-$forms; rm -rf "$d"
  timeout 150 env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=2 STRATA_JAX_COMPILATION_CACHE=0 \
    XLA_FLAGS="--xla_dump_to=$d --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*" \
    "$PY" benchmarks/slice_probe.py bench "$forms" --model /tmp/slcheck-q16.gguf --tokens ${TOKENS:-64} --prompt-len 300 \
    --ctx 1024 --routing realistic --cache-fraction 0.5 --no-resident --out "$OUT/bench-$forms.json" \
    > "$OUT/log-$forms.txt" 2>&1
  echo "== $forms rc $? not_convertible $(grep -c 'not convertible' "$OUT/log-$forms.txt")"
  "$PY" - "$OUT/bench-$forms.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["rows"][0]
    print({k: r.get(k) for k in ("decode_tok_s", "host_dispatch_ms_per_step", "host_wait_ms_per_step", "hit_rate")})
except Exception as e:
    print("no row:", e)
PY
  "$PY" benchmarks/dsf_report.py "$d" > "$OUT/dsf-$forms.txt" 2>&1
  grep "^==" "$OUT/dsf-$forms.txt" | cut -c1-260
done 2>&1 | tee "$OUT/summary.txt"
cat "$OUT/probe.jsonl" 2>/dev/null
