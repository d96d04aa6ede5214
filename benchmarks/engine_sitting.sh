#!/usr/bin/env bash
# The engine-refactor sitting: the same workloads on OLD (commit d41abbe, exported to .sitting/old) and NEW
# (the working tree) in one lease of an nvidia-h200, modelled on benchmarks/gpu_sitting.sh.
#
#   bash benchmarks/engine_sitting.sh prep            here, before the calls: export OLD, note NEW's state,
#        check the wheels (.whl) and the carried size
#   bash benchmarks/engine_sitting.sh start [WAIT_S]  on the device: install .whl into /tmp/site, record the
#        machine, snapshot both trees, launch the pipeline in its own session (it outlives the call), wait
#   bash benchmarks/engine_sitting.sh wait [WAIT_S [DEADLINE_S]]   wait up to WAIT_S s (default 560) or until
#        the pipeline ends, then copy what exists to $OUT; DEADLINE_S replaces SITTING_S for phases not started
#   bash benchmarks/engine_sitting.sh pipeline | serve-one ...    (start runs these; not by hand)
#
# Phases, most important first (each pair OLD then NEW, so a cut leaves whole pairs):
#   models   write b30.gguf (17.2 GB, 1-1.5 min) and dense.gguf (qwen2 in the default model's shape) once
#   bench-b30-{old,new}          bench --resident-only, batch 1, 128 tokens, 16-step decode calls
#   serve-dense-p4-{old,new}     serve --parallel 4: 4 clients, then 1
#   serve-b30-p4-{old,new}       the same on B30
#   serve-dense-p1-*, serve-b30-p1-*   the --parallel 1 baseline: 1 client, then 4
# Returned to $OUT: progress, phases.tsv, results-b30-{old,new}.json, loads.json (every load-*.json by name),
# logs.tar.gz (the logs' tails): 6 files of the 8 a call may return.
#
# Knobs: SITTING_S (pipeline deadline, default 1400 s), SITTING_DIR (default /tmp/esit), PY (python3),
# SITE (/tmp/site; NO_WHEELS=1 skips the install), B30_SHAPE (a bench shape, tiny for a dry run), BENCH_ORDER,
# DEFAULT_SPEC ("k=v,..." over the default model's shape), PHASES (names to run, default all),
# SERVE_BATCH ("p4 p1"), CLIENTS_LIMIT_S. Dry run: see benchmarks/engine_sitting.md. The shared steps
# (phases cut at the deadline, rows in phases.tsv; start, wait, collect) are benchmarks/sitting_lib.sh.
set -u
cd "$(dirname "$0")/.."
source benchmarks/sitting_lib.sh /tmp/esit 1400
RUN_TREE=new
RETURNED="progress phases.tsv results-*.json"
TAILED="*.log *.err *.failed"
USAGE="prep|start|wait"
export PYTHONUNBUFFERED=1
B30=$S/models/b30.gguf DENSE=$S/models/dense.gguf

# in_tree TREE: the wrapper that runs a command in one tree's folder and environment (a phase's command
# prefix, unquoted): its own folder first on the path (python -m puts the cwd first, so run from the
# tree), its own compiled-program cache; the models are shared by path
in_tree() { echo "env -C $S/$1 PYTHONPATH=$S/$1:$SITE STRATA_JAX_CACHE=/tmp/sj-$1"; }

# serve-one TREE MODEL PAR PORT CLIENTS...: a fresh server, /health 200, then server_load.py per client count
# (greedy, 64 tokens, 8 requests per client; its untimed warm-up compiles the programs), then the server ends
serve_one() {
  local tree=$1 model=$2 par=$3 port=$4 path c rc failed=0
  shift 4
  cd "$S/$tree" || exit 2  # the script cd'ed to its own tree (NEW's): python -m imports from the cwd
  path=$([ "$model" = b30 ] && echo "$B30" || echo "$DENSE")
  # a port that answers already would be measured instead of this server
  "$PY" -c "import socket, sys; sys.exit(socket.socket().connect_ex(('127.0.0.1', int(sys.argv[1]))) == 0)" "$port" \
    || { echo "port $port is in use: stop"; exit 4; }
  "$PY" -m strata_jax.cli serve --model "$path" --ctx 1024 --parallel "$par" --port "$port" --no-warmup \
    > "$S/serve-$tree-$model-p$par.server.log" 2>&1 &
  SERVER_PID=$!  # global: the EXIT trap runs after this function's locals are gone
  # the next phase's server needs the GPU memory this one holds: TERM, up to 30 s, then KILL
  trap 'kill -TERM $SERVER_PID 2>/dev/null; for _ in $(seq 30); do kill -0 $SERVER_PID 2>/dev/null || break; sleep 1; done
        kill -KILL $SERVER_PID 2>/dev/null' EXIT
  "$PY" - "$port" "$SERVER_PID" <<'PYEOF' || { echo "server never became healthy"; tail -n 40 "$S/serve-$tree-$model-p$par.server.log"; exit 3; }
import os, sys, time, urllib.request, urllib.error
url, pid, t0 = f"http://127.0.0.1:{sys.argv[1]}/health", int(sys.argv[2]), time.time()
while True:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                print(f"healthy after {time.time() - t0:.0f} s"); sys.exit(0)
    except (urllib.error.URLError, OSError):
        pass
    try:
        os.kill(pid, 0)  # the server died (a load error): stop now, not at the phase's limit
    except OSError:
        print("server exited"); sys.exit(1)
    time.sleep(1)
PYEOF
  for c in "$@"; do
    local name=load-$tree-$model-p$par-c$c t0=$SECONDS
    "$PY" "$S/new/benchmarks/server_load.py" "http://127.0.0.1:$port" --clients "$c" --requests $((8 * c)) \
      --max-tokens 64 > "$S/$name.json.tmp" 2> "$S/$name.err"
    rc=$?
    if [ $rc = 0 ]; then mv "$S/$name.json.tmp" "$S/$name.json"; else mv "$S/$name.json.tmp" "$S/$name.failed"; failed=1; fi
    echo "$name: rc $rc after $((SECONDS - t0)) s: $(tr -d '\n ' < "$S/$name.json" 2>/dev/null | head -c 300)"
    tail -n 5 "$S/$name.err"
  done
  return $failed
}

pipeline() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  # OLD's writer first: its code is fixed, NEW may be mid-refactor; NEW's if OLD's fails
  local margs=("$S/models" --b30-shape "${B30_SHAPE:-b30}" --dense "${DEFAULT_SPEC:-}")
  phase models 400 $(in_tree old) "$PY" "$S/new/benchmarks/engine_sitting_models.py" "${margs[@]}" \
    || phase models-newwriter 400 $(in_tree new) "$PY" "$S/new/benchmarks/engine_sitting_models.py" "${margs[@]}"
  note "models: $(ls -l "$S/models" 2>&1 | tail -n +2 | awk '{print $5, $9}' | tr '\n' ' '); disk: $(df -h "$S" | tail -1)"
  want() { [ -z "${PHASES:-}" ] || [[ " $PHASES " == *" $1 "* ]]; }
  local t port=8200 par model clients
  if want bench-b30; then
    # BENCH_ORDER: the trees' runs in order, e.g. "old new new old old new" (alternated, so neither tree
    # always runs first in the lease); run i writes results-b30-<tree>-r<i>.json
    local i=0
    for t in ${BENCH_ORDER:-old new}; do
      i=$((i + 1))
      phase "bench-b30-$t-r$i" 300 $(in_tree "$t") "$PY" -m strata_jax.cli bench --model "$B30" --label b30 \
        --resident-only --tokens 128 --prompt-len 32 --routing model --decode-chunk 16 --out "$S/results-b30-$t-r$i.json"
    done
  fi
  for par in ${SERVE_BATCH:-p4 p1}; do
    for model in dense b30; do
      want "serve-$model-$par" || continue
      # the target's 4 clients first on --parallel 4; the baseline's lone client first on --parallel 1
      clients=$([ "$par" = p4 ] && echo "4 1" || echo "1 4")
      for t in old new; do
        port=$((port + 1))
        phase "serve-$model-$par-$t" "$([ "$model" = b30 ] && echo 420 || echo 240)" $(in_tree "$t") \
          bash "$S/new/benchmarks/engine_sitting.sh" serve-one "$t" "$model" "${par#p}" "$port" $clients
      done
    done
  done
  note "pipeline: done"
}

collect_more() {  # every load-*.json in one file, keyed by its name: a call returns at most 8 files
  "$PY" - "$S" "$OUT/loads.json" <<'PYEOF'
import glob, json, os, sys
docs = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "load-*.json"))):
    try:
        docs[os.path.basename(f)[:-5]] = json.load(open(f))
    except ValueError as e:
        docs[os.path.basename(f)[:-5]] = {"error": f"unreadable: {e}"}
json.dump(docs, open(sys.argv[2], "w"), indent=1)
PYEOF
}

prepare() {  # NEW as sent and OLD as prep exported it, each snapshotted; the machine as NEW sees it
  [ -d .sitting/old/strata_jax ] || { note "no .sitting/old (carry .sitting): stop"; return 1; }
  snapshot "$S/new"
  rm -rf "$S/old" && cp -a .sitting/old "$S/old"
  cat .sitting/meta.txt >> "$S/progress" 2>/dev/null
  machine_info $(in_tree new)
  $(in_tree old) "$PY" -c "import sys, jax, strata_jax
print('old:', strata_jax.__file__, 'python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())" \
    >> "$S/progress" 2>&1
}

prep() {  # here, not on the device
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file: ask git where it is
  mkdir -p "$(dirname "$exclude")" && touch "$exclude"
  for p in /.whl/ /.sitting/; do grep -qxF "$p" "$exclude" || echo "$p" >> "$exclude"; done
  rm -rf .sitting/old && mkdir -p .sitting/old
  git archive d41abbe | tar -x -C .sitting/old
  { echo "OLD d41abbe ($(git log -1 --format='%h %s' d41abbe | cut -c1-100))"
    echo "NEW working tree on $(git rev-parse --short=12 HEAD), diff sha256 $(git diff HEAD | sha256sum | cut -c1-16), $(date -u +%FT%TZ)"
    git status --short | head -40; } > .sitting/meta.txt
  cat .sitting/meta.txt
  ls .whl/*.whl || echo "MISSING: .whl (see benchmarks/engine_sitting.md)"
  du -sh .whl .sitting
  echo "tree as sent: $(git ls-files -co --exclude-standard -z | du -ch --files0-from=- | tail -1)"
}

case "${1:-}" in
  serve-one) shift; serve_one "$@" ;;
  prep) prep ;;
  *) sitting_main "$@" ;;
esac
