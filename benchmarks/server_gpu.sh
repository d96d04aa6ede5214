#!/usr/bin/env bash
# `strata-jax serve` under load: for --parallel 1 and 4, a fresh server on MODEL, then
# benchmarks/server_load.py with 1 and with 4 streaming clients (greedy, 64 tokens, 8 requests per client
# after an untimed warm-up). Writes OUTDIR/load-p{P}-c{C}.json and each server's log.
#
#   bash benchmarks/server_gpu.sh MODEL.gguf OUTDIR [CTX]      (PY=python3 by default)
set -u
MODEL=$1 OUTD=$2 CTX=${3:-1024}
PY=${PY:-python3}
mkdir -p "$OUTD"
for par in 1 4; do
  port=$((8100 + par))
  "$PY" -m strata_jax.cli serve --model "$MODEL" --ctx "$CTX" --parallel "$par" --port "$port" \
    > "$OUTD/serve-p$par.log" 2>&1 &
  pid=$!
  "$PY" - "$port" <<'PYEOF' || { echo "server --parallel $par never became healthy"; kill $pid; continue; }
import sys, time, httpx
url = f"http://127.0.0.1:{sys.argv[1]}/health"
for _ in range(300):
    try:
        if httpx.get(url, timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(1)
sys.exit(1)
PYEOF
  for c in 1 4; do
    "$PY" benchmarks/server_load.py "http://127.0.0.1:$port" --clients "$c" --requests $((8 * c)) --max-tokens 64 \
      > "$OUTD/load-p$par-c$c.json" 2> "$OUTD/load-p$par-c$c.err"
    echo "--parallel $par, $c clients: $(tr -d '\n ' < "$OUTD/load-p$par-c$c.json" | head -c 400)"
  done
  kill -TERM "$pid"
  wait "$pid"
done
