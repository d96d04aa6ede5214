#!/usr/bin/env bash
# A short GPU check of KV streaming (--kv-resident; one `device` call, ~6 min; carry .whl): (1) its tests on
# the GPU (the host-put CUDA kernel against the all-device cache, bit for bit); (2) the `small` shape at a
# 16,384-token context, decode at that depth and the 16K prompt's prefill, all-device against 2,048 positions
# resident (q8_0 KV): tok/s and kv_vram_hit. Results to $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvcheck}
source benchmarks/check_env.sh
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kv_stream.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc $?" >> "$OUT/pytest.txt"
for resident in "" 2048; do
  name=small-${resident:-all}
  timeout 200 "$PY" -m strata_jax.cli bench --shape small --ctx 16384 --kv q8_0 --prompt-len 16000 --tokens 64 \
    --resident-only ${resident:+--kv-resident $resident} --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc $?" >> "$OUT/bench.txt"
done
"$PY" - "$OUT" >> "$OUT/bench.txt" 2>&1 <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("small-*.json")):
    for r in json.loads(f.read_text())["rows"]:
        print(f.stem, {k: r.get(k) for k in ("decode_tok_s", "prompt_prefill_tok_s", "kv_resident", "kv_vram_hit",
                                              "host_dispatch_ms_per_step", "error")})
PY
tail -n 40 "$OUT"/*.log > "$OUT/logs.txt" 2>&1
